"""The steering op, tables and layer wrapping, without vLLM."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from steergate.engine.payload import decode_payload, encode_payload
from steergate.engine.worker import op
from steergate.engine.worker.layers import find_decoder_layers, wrap_layers
from steergate.engine.worker.tables import SteeringTables, StepRequest

H = 8


def _payload(phase: str, **sites: float):
    """sites like post_block_1=2.0 -> vector full of 2.0 at (post_block, 1)."""
    parsed = {}
    for key, value in sites.items():
        hook, layer = key.rsplit("_", 1)
        parsed[(hook, int(layer))] = np.full(H, value, dtype=np.float32)
    return decode_payload(encode_payload(phase, parsed)[0])


def _tables(num_slots: int = 4, layers=(0, 1)) -> SteeringTables:
    return SteeringTables(hidden_size=H, layers=list(layers), num_slots=num_slots, max_tokens=32)


# ---- the op ---------------------------------------------------------------


def test_op_adds_the_indexed_row_per_token_and_row_zero_adds_nothing() -> None:
    table = torch.zeros(3, H)
    table[1] = 1.0
    table[2] = torch.arange(H, dtype=torch.float32)
    index = torch.tensor([0, 1, 2, 1, 0, 0, 0, 0])
    op.mark_live(table, True)
    try:
        hidden = torch.ones(4, H)
        torch.ops.steergate.steer(hidden, table, index)
    finally:
        op.mark_live(table, False)
    assert torch.equal(hidden[0], torch.ones(H))
    assert torch.equal(hidden[1], torch.full((H,), 2.0))
    assert torch.equal(hidden[2], 1 + torch.arange(H, dtype=torch.float32))
    assert torch.equal(hidden[3], torch.full((H,), 2.0))


def test_op_skips_tables_with_no_live_rows_on_cpu() -> None:
    table = torch.ones(2, H)  # deliberately non-zero but not marked live
    hidden = torch.zeros(2, H)
    torch.ops.steergate.steer(hidden, table, torch.tensor([1, 1]))
    assert torch.equal(hidden, torch.zeros(2, H))


def test_traced_body_compiled_by_inductor_reads_the_tables_current_contents() -> None:
    """The ``inductor`` body on CUDA (op.CUDA_COMPILED_BODY) is the torch body traced
    into the graph. Inductor must take the tables and index as inputs, not constants:
    rows written and slots changed after compilation are seen by the next call, and
    clamps likewise (CPU Inductor here; the GPU bench checks CUDA graphs)."""
    from steergate.engine.worker import clamp as clamp_op

    table = torch.zeros(3, H)
    clamps = clamp_op.ClampTable(3, 1, H, torch.device("cpu"))
    index = torch.zeros(16, dtype=torch.int64)

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        op.torch_steer(y, table, index)
        clamp_op.torch_clamp(y, None, clamps.dirs, clamps.bounds, index)
        return y + 1

    compiled = torch.compile(f, backend="inductor", dynamic=True, fullgraph=True)
    x = torch.ones(4, H)
    assert torch.equal(compiled(x), torch.full((4, H), 3.0))
    table[2] = 5.0
    index[1] = 2
    out = compiled(x)
    assert torch.equal(out[1], torch.full((H,), 8.0)) and torch.equal(out[0], torch.full((H,), 3.0))
    clamps.dirs[2, 0, 0] = 1.0  # ablate component 0 at slot 2
    clamps.bounds[2, 0] = torch.tensor([0.0, 0.0, 1.0])
    out = compiled(x)
    assert out[1, 0].item() == 1.0 and torch.equal(out[1, 1:], torch.full((H - 1,), 8.0))
    assert torch.equal(out[0], torch.full((H,), 3.0))


def test_compiled_graph_reads_the_tables_current_contents() -> None:
    """Inductor must keep the op opaque: a table written after compilation (as the
    worker does for every new request) is seen by the next call."""
    table = torch.zeros(3, H)
    index = torch.zeros(16, dtype=torch.int64)
    op.mark_live(table, True)

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        op.apply(y, table, index)
        return y + 1

    compiled = torch.compile(f, backend="inductor", dynamic=True, fullgraph=True)
    try:
        x = torch.ones(4, H)
        assert torch.equal(compiled(x), torch.full((4, H), 3.0))
        table[2] = 5.0
        index[1] = 2
        out = compiled(x)
        assert torch.equal(out[1], torch.full((H,), 8.0))
        assert torch.equal(out[0], torch.full((H,), 3.0))
        out = compiled(torch.ones(6, H))  # another batch size, same graph
        assert torch.equal(out[1], torch.full((H,), 8.0))
    finally:
        op.mark_live(table, False)


# ---- tables: slots ----------------------------------------------------------


def test_requests_with_equal_digest_share_one_slot_until_the_last_finishes() -> None:
    t = _tables()
    p = _payload("all", post_block_1=2.0)
    t.add_request("a", p)
    t.add_request("b", p)
    t.fill([StepRequest("a", 0, 2, 0, 2), StepRequest("b", 2, 4, 0, 2)], 4)
    assert t.slots_in_use == 1
    slot = int(t.index[0])
    assert slot != 0 and int(t.index[2]) == slot
    assert torch.equal(t.tables[("post_block", 1)][slot], torch.full((H,), 2.0))
    t.remove_request("a")
    assert t.slots_in_use == 1  # b still uses it
    t.remove_request("b")
    assert t.slots_in_use == 0
    assert not t.tables[("post_block", 1)].any()  # zeroed on release


def test_different_digests_get_different_slots_and_unsteered_tokens_read_row_zero() -> None:
    t = _tables()
    t.add_request("a", _payload("all", post_block_0=1.0))
    t.add_request("b", _payload("all", pre_attn_1=3.0))
    t.fill([StepRequest("a", 0, 3, 0, 3), StepRequest("b", 5, 7, 0, 2)], 8)
    idx = t.index[:8].tolist()
    assert idx[0] == idx[1] == idx[2] != 0
    assert idx[3] == idx[4] == 0  # an unsteered request between them
    assert idx[5] == idx[6] not in (0, idx[0])
    assert idx[7] == 0


def test_index_is_cleared_when_no_steered_request_is_in_the_batch() -> None:
    t = _tables()
    t.add_request("a", _payload("all", post_block_0=1.0))
    t.fill([StepRequest("a", 0, 4, 0, 4)], 4)
    assert t.index[:4].ne(0).all()
    t.fill([], 4)
    assert not t.index.any()


@pytest.mark.parametrize(
    ("phase", "expected"),
    [
        # request: tokens 0..4 of the batch at positions 3..7; prompt has 5 tokens,
        # so positions 3, 4 are prompt and 5, 6, 7 are generated.
        ("all", [1, 1, 1, 1, 1]),
        ("prefill", [1, 1, 0, 0, 0]),
        ("decode", [0, 0, 1, 1, 1]),
    ],
)
def test_phase_selects_prompt_or_generated_positions(phase: str, expected: list[int]) -> None:
    t = _tables()
    t.add_request("a", _payload(phase, post_block_0=1.0))
    t.fill([StepRequest("a", 0, 5, first_pos=3, num_prompt_tokens=5)], 5)
    assert [int(i != 0) for i in t.index[:5].tolist()] == expected


def test_decode_step_of_prefill_only_steering_is_unsteered() -> None:
    t = _tables()
    t.add_request("a", _payload("prefill", post_block_0=1.0))
    t.fill([StepRequest("a", 0, 1, first_pos=9, num_prompt_tokens=5)], 1)
    assert int(t.index[0]) == 0


def test_full_slots_reclaim_one_whose_requests_are_not_in_the_batch() -> None:
    t = _tables(num_slots=3)  # two usable slots
    for i, req in enumerate("abc"):
        t.add_request(req, _payload("all", post_block_0=float(i + 1)))
    t.fill([StepRequest("a", 0, 1, 0, 1), StepRequest("b", 1, 2, 0, 1)], 2)
    # "a" preempted, "c" scheduled: a's slot is reclaimed, not refused.
    t.fill([StepRequest("b", 0, 1, 0, 1), StepRequest("c", 1, 2, 0, 1)], 2)
    rows = t.tables[("post_block", 0)]
    assert float(rows[int(t.index[0])][0]) == 2.0
    assert float(rows[int(t.index[1])][0]) == 3.0
    # "a" resumes with "c": rows rewritten for it.
    t.fill([StepRequest("a", 0, 1, 0, 1), StepRequest("c", 1, 2, 0, 1)], 2)
    assert float(rows[int(t.index[0])][0]) == 1.0
    assert float(rows[int(t.index[1])][0]) == 3.0


def test_sites_of_other_pipeline_stages_are_ignored() -> None:
    t = _tables(layers=(0, 1))
    t.add_request("a", _payload("all", post_block_1=1.0, post_block_5=2.0))
    t.fill([StepRequest("a", 0, 1, 0, 1)], 1)
    assert t.tables[("post_block", 1)].any()
    assert ("post_block", 5) not in t.tables


def test_live_gate_follows_slot_use() -> None:
    t = _tables()
    table = t.tables[("post_attn", 1)]
    t.add_request("a", _payload("all", post_attn_1=1.0))
    assert table.data_ptr() not in op._LIVE_TABLES
    t.fill([StepRequest("a", 0, 1, 0, 1)], 1)
    assert table.data_ptr() in op._LIVE_TABLES
    assert t.tables[("post_attn", 0)].data_ptr() not in op._LIVE_TABLES
    t.remove_request("a")
    assert table.data_ptr() not in op._LIVE_TABLES


# ---- layer wrapping ---------------------------------------------------------


class _Attn(nn.Module):
    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states * 2


class _AddNorm(nn.Module):
    """vLLM's fused residual add + norm, with the identity for the norm."""

    def forward(self, x, residual):
        s = x + residual
        return s, s


class _Layer(nn.Module):
    """vLLM's (hidden_states, residual) convention, linear so each site is visible:
    stream in s -> attention 2s -> after residual add 3s -> mlp output 3s -> out 6s."""

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _Attn()
        self.post_attention_layernorm = _AddNorm()

    def forward(self, positions, hidden_states, residual):
        stream = hidden_states if residual is None else hidden_states + residual
        attn = self.self_attn(positions=positions, hidden_states=stream)
        _, residual = self.post_attention_layernorm(attn, stream)
        return residual * 1, residual


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, residual = x, None
        for layer in self.layers:
            hidden, residual = layer(None, hidden, residual)
        return hidden + residual


@pytest.mark.parametrize(
    ("site", "expected"),
    [
        (None, 36.0),  # 1 -> 6 -> 36
        (("pre_attn", 0), 72.0),  # 2 -> 12 -> 72
        (("post_attn", 0), 48.0),  # 3 + 1 -> 8 -> 48
        (("post_block", 0), 42.0),  # 6 + 1 -> 42
        (("pre_attn", 1), 42.0),  # the same point of the stream as post_block 0
        (("post_attn", 1), 38.0),  # 6 -> 18 + 1 -> 38
        (("post_block", 1), 37.0),
    ],
)
def test_wrapped_layers_add_at_the_named_point(site, expected: float) -> None:
    model = _Model()
    layers, present = find_decoder_layers(model)
    t = _tables(layers=present)
    wrap_layers(layers, present, t)
    wrap_layers(layers, present, t)  # idempotent: a second wrap must not add twice
    if site is not None:
        t.add_request("a", _payload("all", **{f"{site[0]}_{site[1]}": 1.0}))
    t.fill([StepRequest("a", 0, 1, 0, 1)], 1)
    out = model(torch.ones(1, H))
    t.remove_request("a")
    assert torch.equal(out, torch.full((1, H), expected))


# ---- compile cache tag --------------------------------------------------------


def test_aot_compile_cache_key_carries_the_steergate_factor() -> None:
    """vLLM's AOT cache key does not see our layer wrapping; without the factor a
    graph compiled by plain vLLM (no op in it) could be loaded and never steer."""
    from unittest import mock

    from vllm.compilation import caching

    from steergate.engine.worker import compile_tag

    cfg = mock.Mock()
    cfg.compute_hash.return_value = "cfg-hash"
    with mock.patch.object(caching, "aot_compile_hash_factors", caching.aot_compile_hash_factors):
        plain = caching.aot_compile_hash_factors(cfg)
        compile_tag.install()
        compile_tag.install()  # idempotent: the factor is added once
        tagged = caching.aot_compile_hash_factors(cfg)
    assert tagged == [*plain, compile_tag.steergate_factor()]
    assert compile_tag.steergate_factor().startswith("steergate:")
