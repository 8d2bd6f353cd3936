"""The vLLM adapter for the V2 model runner (``vllm/v1/worker/gpu/model_runner.py``).

V2 keeps no ``self.requests`` and no persistent batch: request state lives in
``req_states`` rows, each step's layout is a fresh ``InputBatch`` returned by
``prepare_inputs``, and finished *and preempted* requests go through
``_remove_request`` (a preempted request comes back later as a new one). So the
hooks differ from V1's, while tables, op and layers are shared:

* ``load_model``: :func:`engine.worker.runner.attach` (tables, layer wrapping,
  instance and feature checks);
* ``initialize_kv_cache``: refuse features V2 only builds here (adaptive draft
  verification, prefill context parallelism, microbatching);
* ``add_requests``: register each new request's payload (from
  ``NewRequestData.sampling_params``);
* ``_remove_request``: release its slot;
* ``prepare_inputs``: fill the index from the returned ``InputBatch``: request i of
  ``req_ids`` owns tokens ``[query_start_loc_np[i], query_start_loc_np[i+1])`` from
  position ``num_computed_tokens_np[i]``; its prompt length is
  ``req_states.prompt_len`` of its row (not ``prefill_len``, which after a
  preemption also counts the tokens generated before it).

If :func:`engine.worker.contract.v2_problems` found differences, :func:`install`
patches only ``load_model``, to refuse with them, so an engine that selects V2
fails at start-up instead of serving unsteered.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from steergate.engine.worker import capture, contract
from steergate.engine.worker.runner import _after_execute, attach, payload_of
from steergate.engine.worker.tables import SteeringTables, StepRequest

_PATCHED = "_steergate_patched"


def install(problems: Sequence[str] | None) -> None:
    """Patch the V2 runner (idempotent); ``problems`` from :func:`contract.v2_problems`
    (None: this build has no V2 runner)."""
    if problems is None:
        return
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2

    if V2.__dict__.get(_PATCHED):
        return
    if problems:
        setattr(V2, "load_model", _refuse(V2.load_model, problems))  # noqa: B010
    else:
        setattr(V2, "load_model", _after_load(V2.load_model))  # noqa: B010
        setattr(V2, "initialize_kv_cache", _after_kv_init(V2.initialize_kv_cache))  # noqa: B010
        setattr(V2, "add_requests", _after_add(V2.add_requests))  # noqa: B010
        setattr(V2, "_remove_request", _after_remove(V2._remove_request))  # noqa: B010
        setattr(V2, "prepare_inputs", _after_prepare(V2.prepare_inputs))  # noqa: B010
        setattr(V2, "execute_model", _after_execute(V2.execute_model))  # noqa: B010
    setattr(V2, _PATCHED, True)


def _refuse(load_model: Callable[..., Any], problems: Sequence[str]) -> Callable[..., Any]:
    @functools.wraps(load_model)
    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise contract.ContractError(
            "vLLM's V2 model runner does not match the steering adapter "
            "(VLLM_USE_V2_MODEL_RUNNER=0 selects the V1 runner)",
            problems,
        )

    return refuse


def _after_load(load_model: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(load_model)
    def load_model_and_wrap(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = load_model(self, *args, **kwargs)
        attach(self, contract.V2_RUNNER_ATTRS)
        return result

    return load_model_and_wrap


def _after_kv_init(init: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(init)
    def init_and_check(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = init(self, *args, **kwargs)
        if getattr(self, "_steergate", None) is not None:
            contract.raise_if(
                "this engine configuration cannot be steered exactly",
                contract.off_after_kv_init_problems(self),
            )
        return result

    return init_and_check


def _after_add(add: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(add)
    def add_and_register(self: Any, scheduler_output: Any) -> Any:
        result = add(self, scheduler_output)
        tables: SteeringTables | None = getattr(self, "_steergate", None)
        if tables is not None:
            for new in scheduler_output.scheduled_new_reqs:
                payload = payload_of(new.sampling_params, new.req_id, tables.hidden_size)
                if payload is not None:
                    tables.add_request(new.req_id, payload)
                capture.register(new.sampling_params, new.req_id)
        return result

    return add_and_register


def _after_remove(remove: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(remove)
    def remove_and_release(self: Any, req_id: str) -> Any:
        result = remove(self, req_id)
        tables: SteeringTables | None = getattr(self, "_steergate", None)
        if tables is not None:
            tables.remove_request(req_id)
            # V2 removes preempted requests too: a resumed one starts capture afresh
            # (docs/steering-op.md: preemption is exact on the V1 runner).
            capture.unregister(req_id)
        return result

    return remove_and_release


def _after_prepare(prepare: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(prepare)
    def prepare_and_fill(self: Any, *args: Any, **kwargs: Any) -> Any:
        input_batch = prepare(self, *args, **kwargs)
        tables: SteeringTables | None = getattr(self, "_steergate", None)
        if tables is not None:
            fill(self, tables, input_batch)
        return input_batch

    return prepare_and_fill


def fill(runner: Any, tables: SteeringTables, batch: Any) -> None:
    """Point this step's tokens (V2 ``InputBatch`` layout) at their slots."""
    _plan_capture(runner, batch)
    if tables.num_steered_requests == 0 and not tables.index_dirty:
        return
    qsl = batch.query_start_loc_np
    computed = batch.num_computed_tokens_np
    rows = batch.idx_mapping_np
    prompt_len = runner.req_states.prompt_len.np
    step = [
        StepRequest(req_id, int(qsl[i]), int(qsl[i + 1]), int(computed[i]),
                    int(prompt_len[rows[i]]))
        for i, req_id in enumerate(batch.req_ids[: batch.num_reqs])
        if tables.is_steered(req_id)
    ]
    tables.fill(step, batch.num_tokens)


def _plan_capture(runner: Any, batch: Any) -> None:
    st = capture.state()
    if st is None or not st.reqs:
        return
    qsl, computed = batch.query_start_loc_np, batch.num_computed_tokens_np
    rows, prompt_len = batch.idx_mapping_np, runner.req_states.prompt_len.np
    st.plan_step([
        (req_id, int(qsl[i]), int(qsl[i + 1]), int(computed[i]), int(prompt_len[rows[i]]))
        for i, req_id in enumerate(batch.req_ids[: batch.num_reqs])
    ])
