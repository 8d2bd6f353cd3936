"""The V2 model-runner adapter against vLLM 0.32's real V2 classes on CPU.

The runner is a bare ``GPUModelRunner`` (V2) instance holding a real
``RequestState``, with the collaborators that need a GPU or Triton (block tables,
model state, sampler, ...) stubbed. vLLM's own ``add_requests``,
``update_requests``, ``finish_requests`` and ``gather_batch_req_state`` run
unchanged through our hooks; only ``prepare_inputs`` (Triton kernels) is replaced
by building its ``InputBatch`` the way it does on the host."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from steergate.engine.payload import XARGS_KEY, encode_payload
from steergate.engine.worker import contract, runner_v2
from steergate.engine.worker.contract import ContractError
from steergate.engine.worker.tables import SteeringTables

pytest.importorskip("vllm")
import vllm.v1.worker.cpu.buffer_utils as cpu_buffers  # noqa: E402
import vllm.v1.worker.gpu.buffer_utils as gpu_buffers  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.worker.gpu.input_batch import InputBatch  # noqa: E402
from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2  # noqa: E402
from vllm.v1.worker.gpu.states import RequestState  # noqa: E402

H = 4
HOOKED = ("load_model", "initialize_kv_cache", "add_requests", "_remove_request", "prepare_inputs")


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


@pytest.fixture()
def v2(monkeypatch: pytest.MonkeyPatch) -> Iterator[type]:
    """The real V2 class with our hooks installed, restored afterwards."""
    for name in HOOKED:
        monkeypatch.setattr(V2, name, getattr(V2, name))
    monkeypatch.setattr(V2, "_steergate_patched", False, raising=False)
    runner_v2.install(contract.v2_problems())
    assert hasattr(V2.add_requests, "__wrapped__")
    yield V2


@pytest.fixture()
def rig(v2: type, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    # What vLLM's CPU worker does (vllm/v1/worker/cpu/shm.py) so that RequestState's
    # "UVA" buffers are plain host tensors.
    monkeypatch.setattr(gpu_buffers, "UvaBuffer", cpu_buffers.UvaBuffer)
    states = RequestState(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=32,
                          num_speculative_steps=0, vocab_size=100, device=torch.device("cpu"))
    states.apply_staged_writes = _noop  # Triton kernels; the host mirrors are what we read
    r = object.__new__(v2)
    stub = SimpleNamespace(add_request=_noop, remove_request=_noop, apply_staged_writes=_noop,
                           append_block_ids=_noop)
    r.__dict__.update(
        req_states=states, model_state=stub, block_tables=stub, lora_state=stub,
        adaptive_verification=None, pooling_runner=None, encoder_cache=None, pp_handler=None,
        prompt_logprobs_worker=None, sampler=None, is_last_pp_rank=False, use_pp=False,
        pcp_manager=None, decode_query_len=1, kv_block_zeroer=None,
    )
    tables = SteeringTables(hidden_size=H, layers=[0], num_slots=5, max_tokens=32)
    r._steergate = tables
    return SimpleNamespace(runner=r, tables=tables, states=states)


def _payload(phase: str, value: float) -> str:
    return encode_payload(phase, {("post_block", 0): np.full(H, value, np.float32)})[0]


def _new(req_id: str, prompt: int, phase: str | None = None, value: float = 1.0,
         generated: int = 0) -> NewRequestData:
    extra = {XARGS_KEY: _payload(phase, value)} if phase else None
    tokens = list(range(10, 10 + prompt))
    return NewRequestData(
        req_id=req_id, prompt_token_ids=tokens, mm_features=[],
        sampling_params=SamplingParams(max_tokens=8, extra_args=extra), pooling_params=None,
        block_ids=([],), num_computed_tokens=0, lora_request=None,
        prefill_token_ids=tokens + list(range(50, 50 + generated)),
    )


def _step(r: Any, scheduled: dict[str, int], new: list[NewRequestData] = (),
          cached: dict[str, int] | None = None, finished: set[str] = frozenset(),
          preempted: set[str] | None = None) -> InputBatch:
    """One execute_model up to the forward: vLLM's own state updates, then the
    InputBatch prepare_inputs would return (host part), through our prepare hook."""
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = list(new)
    out.num_scheduled_tokens = scheduled
    out.total_num_scheduled_tokens = sum(scheduled.values())
    out.finished_req_ids = set(finished)
    out.preempted_req_ids = preempted
    if cached:
        out.scheduled_cached_reqs = CachedRequestData(
            req_ids=list(cached), resumed_req_ids=set(), new_token_ids=[[] for _ in cached],
            all_token_ids={}, new_block_ids=[None] * len(cached),
            num_computed_tokens=list(cached.values()), num_output_tokens=[0] * len(cached))
    r.finish_requests(out)
    r.add_requests(out)
    r.update_requests(out)
    if not scheduled:
        return None
    state, _ = r.gather_batch_req_state(out, dummy_run=False)
    batch = _input_batch(r, state)
    return runner_v2._after_prepare(lambda *_: batch)(r)  # the hook V2.prepare_inputs has


def _input_batch(r: Any, s: Any) -> InputBatch:
    n = len(s.req_ids)
    qsl = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(s.num_scheduled_tokens, out=qsl[1:])
    t = s.num_tokens
    zeros = torch.zeros(t, dtype=torch.int64)
    return InputBatch(
        req_ids=s.req_ids, num_reqs=n, num_reqs_after_padding=n,
        idx_mapping=torch.from_numpy(s.idx_mapping_np), idx_mapping_np=s.idx_mapping_np,
        expanded_idx_mapping=torch.from_numpy(s.idx_mapping_np),
        expanded_local_pos=torch.zeros(n, dtype=torch.int32),
        num_scheduled_tokens=s.num_scheduled_tokens, num_tokens=t, num_tokens_after_padding=t,
        num_draft_tokens=0, num_draft_tokens_per_req=None,
        query_start_loc=torch.from_numpy(qsl), query_start_loc_np=qsl,
        seq_lens=torch.zeros(n, dtype=torch.int32),
        seq_lens_cpu_upper_bound=torch.zeros(n, dtype=torch.int32), dcp_local_seq_lens=None,
        num_computed_tokens_np=r.req_states.num_computed_tokens_np[s.idx_mapping_np],
        prefill_len_np=s.prefill_len_np,
        num_computed_prefill_tokens_np=s.num_computed_prefill_tokens_np,
        is_prefilling_np=s.is_prefilling_np, has_prefill=s.has_prefill,
        decode_graph_eligible=s.decode_graph_eligible, input_ids=zeros, positions=zeros,
        is_padding=torch.zeros(t, dtype=torch.bool), logits_indices=zeros[:n],
        cu_num_logits=torch.arange(n + 1), cu_num_logits_np=np.arange(n + 1),
        has_structured_output_reqs=False, prompt_lens=None,
    )


def _rows(rig: SimpleNamespace, batch: InputBatch) -> dict[str, list[float]]:
    """Per request, the post_block value each of its tokens gets (0 = unsteered)."""
    table = rig.tables.tables[("post_block", 0)][:, 0]
    qsl = batch.query_start_loc_np
    return {
        req_id: [float(table[int(rig.tables.index[t])]) for t in range(qsl[i], qsl[i + 1])]
        for i, req_id in enumerate(batch.req_ids)
    }


def test_index_follows_v2_batch_order_phases_and_chunks(rig: SimpleNamespace) -> None:
    r = rig.runner
    batch = _step(r, {"a": 5, "b": 4, "c": 3},
                  new=[_new("a", 5, "decode", 1.0), _new("b", 6, "prefill", 2.0), _new("c", 3)])
    assert batch.req_ids == ["c", "b", "a"]  # V2 sorts by query length, not arrival
    assert _rows(rig, batch) == {"c": [0.0] * 3, "b": [2.0] * 4, "a": [0.0] * 5}
    # a decodes (position 5 >= its 5-token prompt), b finishes its prompt in a chunk
    batch = _step(r, {"a": 1, "b": 2, "c": 1}, cached={"a": 5, "b": 4, "c": 3})
    assert _rows(rig, batch) == {"a": [1.0], "c": [0.0], "b": [2.0, 2.0]}
    batch = _step(r, {"a": 1, "b": 1, "c": 1}, cached={"a": 6, "b": 6, "c": 4})
    assert _rows(rig, batch) == {"a": [1.0], "b": [0.0], "c": [0.0]}
    assert rig.tables.slots_in_use == 2


def test_finished_requests_release_their_slots(rig: SimpleNamespace) -> None:
    r = rig.runner
    _step(r, {"a": 3, "b": 3}, new=[_new("a", 3, "all", 1.0), _new("b", 3, "all", 1.0)])
    assert rig.tables.slots_in_use == 1 and rig.tables.num_steered_requests == 2
    _step(r, {"b": 1}, cached={"b": 3}, finished={"a"})
    assert rig.tables.num_steered_requests == 1 and rig.tables.slots_in_use == 1
    assert _step(r, {}, finished={"b"}) is None
    assert rig.tables.num_steered_requests == 0 and rig.tables.slots_in_use == 0
    assert not rig.states.req_id_to_index  # vLLM's own bookkeeping ran too


def test_a_preempted_request_resumes_with_its_generated_tokens_as_decode(
    rig: SimpleNamespace,
) -> None:
    """V2 drops a preempted request and re-adds it with prompt + generated tokens as
    one prefill; those generated positions are still decode positions."""
    r = rig.runner
    _step(r, {"a": 4}, new=[_new("a", 4, "decode", 3.0)])
    _step(r, {"a": 1}, cached={"a": 4})
    _step(r, {}, preempted={"a"})
    assert rig.tables.num_steered_requests == 0
    batch = _step(r, {"a": 6}, new=[_new("a", 4, "decode", 3.0, generated=2)])
    assert _rows(rig, batch) == {"a": [0.0] * 4 + [3.0] * 2}


def test_a_payload_of_the_wrong_width_is_served_unsteered_not_raised(
    rig: SimpleNamespace,
) -> None:
    """The V2 hook checks a payload against the tables' hidden size, as V1's does: a
    vector of another length raised inside the step's table fill (the engine core)."""
    r = rig.runner
    bad = _new("a", 3)
    wrong = encode_payload("all", {("post_block", 0): np.ones(H + 1, np.float32)})[0]
    bad.sampling_params.extra_args = {XARGS_KEY: wrong}
    batch = _step(r, {"a": 3, "b": 3}, new=[bad, _new("b", 3, "all", 2.0)])
    assert _rows(rig, batch) == {"a": [0.0] * 3, "b": [2.0] * 3}
    assert rig.tables.num_steered_requests == 1


def test_unsteered_batches_leave_the_index_zero(rig: SimpleNamespace) -> None:
    r = rig.runner
    _step(r, {"a": 3}, new=[_new("a", 3, "all", 1.0)])
    _step(r, {"c": 2}, new=[_new("c", 2)], finished={"a"})
    assert not rig.tables.index_dirty and int(rig.tables.index.abs().sum()) == 0


def test_features_v2_builds_at_kv_cache_init_refuse_to_start(v2: type) -> None:
    r = object.__new__(v2)
    r.__dict__.update(adaptive_verification=object(), pcp_manager=None, ubatch_runner=None,
                      _steergate=object())
    init = runner_v2._after_kv_init(lambda self, *a: None)
    with pytest.raises(ContractError, match="adaptive_verification is active"):
        init(r, None)
    del r.pcp_manager
    assert "the V2 model runner has no pcp_manager" in contract.off_after_kv_init_problems(r)
