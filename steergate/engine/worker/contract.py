"""The start-up contract between the steering adapters and vLLM's private runner API.

The adapters (:mod:`engine.worker.runner` for the V1 model runner,
:mod:`engine.worker.runner_v2` for V2) patch private methods and read batch
internals that vLLM may change in any release. Found mid-request, such a change
crashes the engine or, worse, steers the wrong tokens. So everything the adapters
rely on is checked before the engine serves, and a mismatch refuses to start with a
message naming each difference:

* at plugin registration (every process, no model needed): the vLLM version and the
  class-level facts -- methods and the parameter lists our wrappers forward, which
  vLLM method still calls the one we hook, dataclass fields, that a platform subclass
  does not override a hooked method;
* when a runner has built its model (worker, still start-up): attributes that only
  exist on instances, and features the adapters cannot steer exactly
  (microbatching, prefill context parallelism, adaptive draft verification).

Every check returns a list of problems (empty = fine); callers raise
:class:`ContractError` with all of them.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from types import CodeType
from typing import Any

SUPPORTED_SERIES = "0.32"

# Instance attributes (dotted paths from the runner) each adapter reads.
V1_RUNNER_ATTRS = (
    "input_batch.req_ids",
    "input_batch.num_reqs",
    "input_batch.num_computed_tokens_cpu",
    "input_batch.num_prompt_tokens",
    "input_batch.generators",  # engine.worker.cpu_seeds
    "discard_request_mask.np",  # engine.worker.cpu_seeds
    "query_start_loc.np",
    "requests",
    "max_num_reqs",
    "max_num_tokens",
    "model_config",
    "vllm_config.compilation_config",
    "vllm_config.parallel_config",
    "device",
)
V2_RUNNER_ATTRS = (
    "req_states.prompt_len.np",
    "max_num_reqs",
    "max_num_tokens",
    "model_config",
    "vllm_config.compilation_config",
    "vllm_config.parallel_config",
    "device",
)
# V2 builds these in initialize_kv_cache; each must exist and be None (feature off).
V2_OFF_AFTER_KV_INIT = {
    "adaptive_verification": "adaptive draft verification re-lays out each request's "
    "tokens on the GPU only, so the host cannot tell which token belongs to which request",
    "pcp_manager": "prefill context parallelism splits a request's tokens across ranks",
    "ubatch_runner": "microbatching runs each forward on a slice of the step's tokens",
}


class ContractError(RuntimeError):
    """vLLM differs from what an adapter relies on, or runs a feature it cannot steer."""

    def __init__(self, what: str, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"steergate: refusing to start: {what}:\n{lines}")


def raise_if(what: str, problems: Sequence[str]) -> None:
    if problems:
        raise ContractError(what, problems)


# ---- registration time (class level) -----------------------------------------


def version_problems(version: str) -> list[str]:
    if version.split(".")[:2] != SUPPORTED_SERIES.split("."):
        return [f"vLLM is {version}; the steering adapters are written for {SUPPORTED_SERIES}.x"]
    return []


def v1_problems() -> list[str]:
    """Everything :mod:`engine.worker.runner` and :mod:`engine.worker.compile_tag` use."""
    try:
        from vllm.compilation import caching
        from vllm.config import ParallelConfig
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.sched.output import SchedulerOutput
        from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError as exc:
        return [f"a module the adapter uses does not import: {exc}"]

    runner = GPUModelRunner
    problems = [
        *method_problems(runner, "load_model"),
        *method_problems(runner, "get_model"),
        *method_problems(runner, "_prepare_inputs", ("self", "scheduler_output",
                                                     "num_scheduled_tokens")),
        *method_problems(runner, "_on_request_state_removed", ("self", "req_id", "req_state")),
        *call_problems(runner, "execute_model", "_prepare_inputs"),
        *call_problems(runner, "_update_states", "_on_request_state_removed"),
        *property_problems(InputBatch, ("req_ids", "num_reqs")),
        *field_problems(SchedulerOutput, ("total_num_scheduled_tokens",)),
        *field_problems(CachedRequestState, ("sampling_params",)),
        *field_problems(SamplingParams, ("extra_args",)),
        *property_problems(ParallelConfig, ("use_ubatching",)),
        *method_problems(caching, "aot_compile_hash_factors", ("vllm_config",)),
    ]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:  # a GPU build without the CPU runner
        return problems
    return problems + override_problems(
        CPUModelRunner, runner,
        ("_prepare_inputs", "_on_request_state_removed", "_update_states", "execute_model"),
    ) + [  # engine.worker.cpu_seeds: the seeded-sampling rewind on the CPU runner
        *method_problems(CPUModelRunner, "_sample", ("self", "logits", "spec_decode_metadata")),
        *method_problems(CPUModelRunner, "_bookkeeping_sync"),
        *call_problems(CPUModelRunner, "sample_tokens", "_sample"),
        *call_problems(CPUModelRunner, "sample_tokens", "_bookkeeping_sync"),
    ]


def v2_problems() -> list[str] | None:
    """Everything :mod:`engine.worker.runner_v2` uses; None if this build has no V2 runner."""
    try:
        from vllm.v1.worker.gpu.input_batch import InputBatch
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    except Exception:  # noqa: BLE001 - any import failure means V2 cannot be selected here
        return None
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    runner = GPUModelRunner
    problems = [
        *method_problems(runner, "load_model"),
        *method_problems(runner, "get_model"),
        *method_problems(runner, "initialize_kv_cache"),
        *method_problems(runner, "prepare_inputs"),
        *method_problems(runner, "add_requests", ("self", "scheduler_output")),
        *method_problems(runner, "_remove_request", ("self", "req_id")),
        *call_problems(runner, "execute_model", "prepare_inputs"),
        *call_problems(runner, "execute_model", "add_requests"),
        *call_problems(runner, "execute_model", "finish_requests"),
        *call_problems(runner, "finish_requests", "_remove_request"),
        *field_problems(InputBatch, ("req_ids", "num_reqs", "num_tokens", "idx_mapping_np",
                                     "query_start_loc_np", "num_computed_tokens_np")),
        *field_problems(NewRequestData, ("req_id", "sampling_params")),
        *field_problems(SchedulerOutput, ("scheduled_new_reqs",)),
    ]
    try:
        from vllm.v1.worker.cpu.model_runner import CPUModelRunner
    except Exception:  # noqa: BLE001
        return problems
    return problems + override_problems(
        CPUModelRunner, runner,
        ("prepare_inputs", "add_requests", "_remove_request", "finish_requests", "execute_model",
         "initialize_kv_cache"),
    )


def method_problems(owner: Any, name: str, params: Sequence[str] | None = None) -> list[str]:
    """``owner.name`` exists; with ``params``, its parameter names are exactly those
    (our wrapper forwards them positionally)."""
    label = f"{_name(owner)}.{name}"
    fn = getattr(owner, name, None)
    if not callable(fn):
        return [f"{label} is missing"]
    if params is None:
        return []
    got = tuple(inspect.signature(inspect.unwrap(fn)).parameters)
    if got != tuple(params):
        return [f"{label} takes ({', '.join(got)}); the adapter expects ({', '.join(params)})"]
    return []


def call_problems(owner: type, caller: str, callee: str) -> list[str]:
    """``owner.caller`` still calls ``callee`` (else our hook silently never runs)."""
    fn = getattr(owner, caller, None)
    code = getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None
    if code is None:
        return [f"{_name(owner)}.{caller} is missing"]
    if callee not in set(_names(code)):
        return [f"{_name(owner)}.{caller} no longer calls {callee}, which the adapter hooks"]
    return []


def field_problems(cls: type, names: Sequence[str]) -> list[str]:
    have = set(getattr(cls, "__dataclass_fields__", {})) | set(
        getattr(cls, "__struct_fields__", ())
    )
    return [f"{_name(cls)} has no field {n!r}" for n in names if n not in have]


def property_problems(cls: type, names: Sequence[str]) -> list[str]:
    return [
        f"{_name(cls)}.{n} is not a property"
        for n in names
        if not isinstance(inspect.getattr_static(cls, n, None), property)
    ]


def override_problems(sub: type, base: type, names: Sequence[str]) -> list[str]:
    """The adapter patches ``names`` on ``base``; an override in ``sub`` would bypass it."""
    if not issubclass(sub, base):
        return [f"{_name(sub)} no longer subclasses {_name(base)}"]
    return [
        f"{_name(sub)} overrides {n}, so the hook on {_name(base)} would not run"
        for n in names
        if any(n in klass.__dict__ for klass in sub.__mro__[: sub.__mro__.index(base)])
    ]


# ---- model load time (instance level) ------------------------------------------


def attribute_problems(obj: Any, paths: Sequence[str], label: str = "model runner") -> list[str]:
    problems = []
    for path in paths:
        cur = obj
        for part in path.split("."):
            try:
                cur = getattr(cur, part)
            except AttributeError:
                problems.append(f"the {label} has no {path}")
                break
    return problems


def feature_problems(vllm_config: Any) -> list[str]:
    """Configured features that change which tokens one forward sees."""
    parallel = vllm_config.parallel_config
    problems = []
    if parallel.use_ubatching:
        problems.append(
            "microbatching is on (--enable-dbo or --ubatch-size > 1): each microbatch's "
            "forward sees only its slice of the step's tokens, while the steering index "
            "is laid out for the whole step; start the engine without it"
        )
    if int(getattr(parallel, "prefill_context_parallel_size", 1) or 1) > 1:
        problems.append(
            "prefill context parallelism is on: it splits a request's tokens across "
            "ranks, which the steering index does not follow; start without it"
        )
    return problems


def off_after_kv_init_problems(runner: Any) -> list[str]:
    problems = []
    for attr, why in V2_OFF_AFTER_KV_INIT.items():
        if not hasattr(runner, attr):
            problems.append(f"the V2 model runner has no {attr}")
        elif getattr(runner, attr) is not None:
            problems.append(f"{attr} is active: {why}")
    return problems


def _names(code: CodeType) -> Iterator[str]:
    """Attribute and global names a function uses, nested code (comprehensions,
    closures) included."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield from _names(const)


def _name(owner: Any) -> str:
    """``module.Class`` (V1 and V2 runners are both called ``GPUModelRunner``)."""
    if inspect.ismodule(owner):
        return owner.__name__
    return f"{owner.__module__}.{owner.__qualname__}"
