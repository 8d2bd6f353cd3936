"""The vLLM adapter for the V1 model runner, and what both adapters share.

Three hooks on ``GPUModelRunner`` (``CPUModelRunner`` subclasses it and overrides
only ``load_model``, so that one is patched on both classes):

* ``load_model``: allocate the tables and wrap the decoder layers;
* ``_prepare_inputs``: after vLLM has laid out the step's tokens, register newly
  seen steered requests and fill the per-token slot index;
* ``_on_request_state_removed``: vLLM's hook for finished requests; release slots.

On ``CPUModelRunner`` also ``_sample`` and ``_bookkeeping_sync``, for a vLLM bug that
killed the engine on seeded sampling (:mod:`engine.worker.cpu_seeds`).

:func:`attach` (tables + layer wrapping + the start-up checks that need a built
runner) and :func:`payload_of` are shared with :mod:`engine.worker.runner_v2`.
Everything else (tables, slots, phases) lives in :mod:`engine.worker.tables`; what
the hooks rely on is checked by :mod:`engine.worker.contract` before the engine serves.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from steergate.engine import capture_io
from steergate.engine.payload import XARGS_KEY, Payload, decode_payload
from steergate.engine.worker import capture as worker_capture
from steergate.engine.worker import contract, conventions, cpu_seeds
from steergate.engine.worker.layers import find_decoder_layers, wrap_layers
from steergate.engine.worker.tables import SteeringTables, StepRequest
from steergate.shared.settings import EngineSettings

logger = logging.getLogger("vllm.steergate.worker")  # inherits vLLM's handlers

_PATCHED = "_steergate_patched"


def install() -> None:
    """Patch the V1 runner classes (idempotent). Run :func:`contract.v1_problems` first."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    classes: list[type] = [GPUModelRunner]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        classes.append(CPUModelRunner)
        cpu_seeds.install(CPUModelRunner)  # a vLLM bug that killed the engine
    except ImportError:  # a GPU build without the CPU runner
        pass
    for cls in classes:
        if cls.__dict__.get(_PATCHED):
            continue
        if "load_model" in cls.__dict__:
            setattr(cls, "load_model", _after_load(cls.__dict__["load_model"]))  # noqa: B010
        if cls is GPUModelRunner:
            setattr(cls, "_prepare_inputs", _after_prepare(GPUModelRunner._prepare_inputs))  # noqa: B010
            setattr(cls, "_on_request_state_removed",  # noqa: B010
                    _on_removed(GPUModelRunner._on_request_state_removed))
            setattr(cls, "execute_model", _after_execute(GPUModelRunner.execute_model))  # noqa: B010
        setattr(cls, _PATCHED, True)


def _after_load(load_model: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(load_model)
    def load_model_and_wrap(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = load_model(self, *args, **kwargs)
        if attach(self, contract.V1_RUNNER_ATTRS) is not None:
            self._steergate_seen = set()
        return result

    return load_model_and_wrap


def attach(runner: Any, required: Sequence[str]) -> SteeringTables | None:
    """Allocate the tables and wrap the model's decoder layers, after checking the
    runner's instance attributes (``required``) and its features. Returns the new
    tables, or None when the runner already had them."""
    if not conventions.steering_enabled():
        if getattr(runner, "_steergate_off_logged", False) is False:
            runner._steergate_off_logged = True
            logger.warning("steergate: STEERGATE_STEERING=off: serving %s unsteered",
                           conventions.architecture_of(runner.model_config))
        return None
    existing: SteeringTables | None = getattr(runner, "_steergate", None)
    if existing is not None:
        # load_model ran again (a new model object): wrap its layers around the same
        # tables; wrapping is idempotent per layer, so the same model is not re-wrapped.
        support = select(runner.model_config)
        wrap_layers(*_checked_layers(runner, support), existing, support.convention)
        return None
    contract.raise_if(
        f"vLLM {type(runner).__name__} does not match the steering adapter",
        contract.attribute_problems(runner, required),
    )
    contract.raise_if(
        "this engine configuration cannot be steered exactly",
        contract.feature_problems(runner.vllm_config),
    )
    support = select(runner.model_config)
    layers, present = _checked_layers(runner, support)
    compilation = runner.vllm_config.compilation_config
    # CUDA graphs pad a step up to a capture size; padded tokens must find row 0.
    capture = int(getattr(compilation, "max_cudagraph_capture_size", 0) or 0)
    max_tokens = max(runner.max_num_tokens, capture)
    tables = SteeringTables(
        hidden_size=runner.model_config.get_hidden_size(),
        layers=present,
        num_slots=runner.max_num_reqs + 1,
        max_tokens=max_tokens,
        dtype=runner.model_config.dtype,
        device=runner.device,
        max_clamps=EngineSettings().max_clamps_per_site,
    )
    # Before the first trace: an engine that cannot capture keeps the op out of its graphs.
    worker_capture.call_op(capture_io.refusal(runner.vllm_config) is None)
    wrap_layers(layers, present, tables, support.convention)
    runner._steergate = tables
    worker_capture.install_state(worker_capture.new_state(present, tables.hidden_size))
    logger.info(
        "steergate: steering %s (%s convention): %d layers x 3 hooks, %d slots, "
        "%d-token index (%s)", support.architecture, support.convention.name,
        len(present), tables.num_slots, max_tokens, type(runner).__module__,
    )
    return tables


def select(model_config: Any) -> conventions.Support:
    """The verified support entry for the served model; refuses to start otherwise
    (vLLM does not catch it: the worker's load fails and the engine exits)."""
    return conventions.lookup(conventions.architecture_of(model_config),
                              conventions.vllm_class_of(model_config))


def _checked_layers(runner: Any, support: conventions.Support) -> tuple[Any, list[int]]:
    model = runner.get_model()
    layers, present = find_decoder_layers(model)
    contract.raise_if(
        f"{support.architecture}'s layers do not match the {support.convention.name} "
        "steering convention",
        conventions.check_layers(support, model, layers, present),
    )
    return layers, present


def _after_prepare(prepare: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(prepare)
    def prepare_and_fill(self: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> Any:
        result = prepare(self, scheduler_output, num_scheduled_tokens)
        tables: SteeringTables | None = getattr(self, "_steergate", None)
        if tables is not None:
            _fill(self, tables, scheduler_output.total_num_scheduled_tokens)
            _plan_capture(self)
        return result

    return prepare_and_fill


def _fill(runner: Any, tables: SteeringTables, num_tokens: int) -> None:
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    req_ids = batch.req_ids[:num_reqs]
    seen: set[str] = runner._steergate_seen
    for req_id in req_ids:
        if req_id not in seen:
            seen.add(req_id)
            state = runner.requests.get(req_id)
            params = getattr(state, "sampling_params", None)
            payload = payload_of(params, req_id, tables.hidden_size)
            if payload is not None:
                tables.add_request(req_id, payload)
            worker_capture.register(params, req_id)
    if tables.num_steered_requests == 0 and not tables.index_dirty:
        return
    qsl = runner.query_start_loc.np
    computed = batch.num_computed_tokens_cpu
    prompt = batch.num_prompt_tokens
    step = [
        StepRequest(req_id, int(qsl[i]), int(qsl[i + 1]), int(computed[i]), int(prompt[i]))
        for i, req_id in enumerate(req_ids)
        if tables.is_steered(req_id)
    ]
    tables.fill(step, num_tokens)


def _plan_capture(runner: Any) -> None:
    st = worker_capture.state()
    if st is None or not st.reqs:
        return
    batch = runner.input_batch
    qsl = runner.query_start_loc.np
    computed = batch.num_computed_tokens_cpu
    prompt = batch.num_prompt_tokens
    st.plan_step([
        (req_id, int(qsl[i]), int(qsl[i + 1]), int(computed[i]), int(prompt[i]))
        for i, req_id in enumerate(batch.req_ids[: batch.num_reqs])
    ])


def _after_execute(execute: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(execute)
    def execute_and_flush(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return execute(self, *args, **kwargs)
        finally:
            # The step's rows reach the files before its output leaves the worker.
            st = worker_capture.state()
            if st is not None:
                st.flush()

    return execute_and_flush


def payload_of(params: Any, req_id: str, hidden_size: int) -> Payload | None:
    """The steering payload in a request's ``SamplingParams.extra_args``, if any,
    checked in full against the tables' ``hidden_size`` (``decode_payload``) before it
    can reach them."""
    extra = getattr(params, "extra_args", None) or {}
    text = extra.get(XARGS_KEY)
    if not text:
        return None
    try:
        return decode_payload(text, hidden_size)
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        # The API server builds payloads; a bad one is our bug, not the caller's.
        # Crashing the engine would take every other request down with it.
        logger.error("steergate: request %s has an unreadable steering payload (%s); "
                     "serving it unsteered", req_id, exc)
        return None


def _on_removed(hook: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(hook)
    def release(self: Any, req_id: str, req_state: Any) -> None:
        hook(self, req_id, req_state)
        tables: SteeringTables | None = getattr(self, "_steergate", None)
        if tables is not None:
            self._steergate_seen.discard(req_id)
            tables.remove_request(req_id)
            worker_capture.unregister(req_id)

    return release
