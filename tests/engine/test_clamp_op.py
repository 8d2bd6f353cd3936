"""The steergate::clamp op and its per-slot tables, on CPU without vLLM."""

from __future__ import annotations

import math

import numpy as np
import torch

from steergate.engine.payload import decode_payload, encode_payload
from steergate.engine.worker import op
from steergate.engine.worker.clamp import torch_clamp
from steergate.engine.worker.layers import find_decoder_layers, wrap_layers
from steergate.engine.worker.tables import SteeringTables, StepRequest
from steergate.shared.clamp import Bounds, Resolved

from .test_steering_op import H, _Model


def _payload(sites=None, clamps=()):
    return decode_payload(encode_payload("all", sites or {}, tuple(clamps))[0])


def _e(i: int) -> np.ndarray:
    return np.eye(H, dtype=np.float32)[i]


def _numpy_clamp(h: np.ndarray, entries) -> np.ndarray:
    h = h.astype(np.float64).copy()
    for v, lo, hi, s in entries:
        c = h @ v
        h += s * (np.clip(c, lo, hi) - c) * v
    return h


def test_body_matches_the_definition_in_order_with_unused_entries_as_no_ops() -> None:
    rng = np.random.default_rng(0)
    k, slots, n = 3, 3, 5
    dirs = torch.zeros(slots, k, H)
    bounds = torch.tensor([[-math.inf, math.inf, 0.0]]).repeat(slots, k, 1)
    v1 = rng.normal(size=H).astype(np.float32)
    v1 /= np.linalg.norm(v1)
    v2 = rng.normal(size=H).astype(np.float32)
    v2 /= np.linalg.norm(v2)
    dirs[1, 0], bounds[1, 0] = torch.from_numpy(v1), torch.tensor([-0.5, 0.25, 1.0])
    dirs[1, 1], bounds[1, 1] = torch.from_numpy(v2), torch.tensor([1.0, math.inf, 0.5])
    dirs[2, 0], bounds[2, 0] = torch.from_numpy(v2), torch.tensor([0.0, 0.0, 1.0])
    hidden = torch.from_numpy(rng.normal(size=(n, H)).astype(np.float32))
    residual = torch.from_numpy(rng.normal(size=(n, H)).astype(np.float32))
    index = torch.tensor([0, 1, 2, 1, 0, 0, 0])
    stream = (hidden + residual).numpy()
    out = hidden.clone()
    torch_clamp(out, residual, dirs, bounds, index)
    got = (out + residual).numpy()
    want = {0: stream[0], 4: stream[4],
            1: _numpy_clamp(stream[1], [(v1, -0.5, 0.25, 1.0), (v2, 1.0, math.inf, 0.5)]),
            3: _numpy_clamp(stream[3], [(v1, -0.5, 0.25, 1.0), (v2, 1.0, math.inf, 0.5)]),
            2: _numpy_clamp(stream[2], [(v2, 0.0, 0.0, 1.0)])}
    for t, row in want.items():
        np.testing.assert_allclose(got[t], row, rtol=0, atol=1e-5)
    assert torch.equal(out[0], hidden[0]) and torch.equal(out[4], hidden[4])  # untouched bits
    assert abs(float(got[2] @ v2)) < 1e-5  # ablated


def _tables(layers=(0, 1), k=2) -> SteeringTables:
    return SteeringTables(hidden_size=H, layers=list(layers), num_slots=4, max_tokens=8,
                          max_clamps=k)


def test_slot_writes_entries_per_point_in_order_and_release_restores_no_ops() -> None:
    t = _tables()
    clamps = [Resolved(("post_block", 0), _e(0), Bounds(None, 1.0, 0.5)),
              Resolved(("pre_attn", 1), _e(1), Bounds(0.0, 0.0))]  # same point
    t.add_request("r", _payload(clamps=clamps))
    t.fill([StepRequest("r", 0, 1, 0, 1)], 1)
    slot = int(t.index[0])
    table = t.clamps[("pre_attn", 1)]
    assert table is t.clamps[("post_block", 0)]
    assert torch.equal(table.dirs[slot, 0], torch.from_numpy(_e(0)))
    assert torch.equal(table.dirs[slot, 1], torch.from_numpy(_e(1)))
    assert table.bounds[slot].tolist() == [[-math.inf, 1.0, 0.5], [0.0, 0.0, 1.0]]
    assert table.dirs.data_ptr() in op._LIVE_TABLES
    t.remove_request("r")
    assert not table.dirs.any() and table.dirs.data_ptr() not in op._LIVE_TABLES
    assert table.bounds[slot].tolist() == [[-math.inf, math.inf, 0.0]] * 2


def test_no_clamp_tables_when_the_cap_is_zero() -> None:
    t = _tables(k=0)
    assert all(v is None for v in t.clamps.values())


def _run(sites=None, clamps=()) -> torch.Tensor:
    model = _Model()
    layers, present = find_decoder_layers(model)
    t = _tables(layers=present)
    wrap_layers(layers, present, t)
    t.add_request("a", _payload(sites, clamps))
    t.fill([StepRequest("a", 0, 1, 0, 1)], 1)
    x = torch.zeros(1, H)
    x[0, 0], x[0, 1] = 1.0, 2.0
    out = model(x)
    t.remove_request("a")
    return out[0]


def test_wrapped_model_clamps_at_each_named_point_after_the_add() -> None:
    """_Model: stream s -> post_attn 3s -> post_block 6s per layer (linear), so a clamp's
    effect on component 0 is visible in the output; components 1.. are untouched."""
    assert _run().tolist()[:2] == [36.0, 72.0]
    # post_attn 0: component 0 is 3 there; clamped to 1 -> 1 * 2 * 6 = 12.
    assert _run(clamps=[Resolved(("post_attn", 0), _e(0), Bounds(None, 1.0))])[0] == 12.0
    # add 1 then clamp at post_block 0 (6 + 1 = 7 -> max 5): 5 * 6 = 30.
    add = {("post_block", 0): _e(0)}
    assert _run(add, [Resolved(("post_block", 0), _e(0), Bounds(None, 5.0))])[0] == 30.0
    # pre_attn 1 is the same point: the add of post_block 0 comes first, then the clamp.
    assert _run(add, [Resolved(("pre_attn", 1), _e(0), Bounds(None, 5.0))])[0] == 30.0
    # add 1 then clamp at post_attn 0 (3 + 1 = 4 -> max 3.5), both at the point where
    # the fused add-norm receives attention's output: 3.5 * 2 * 6 = 42 (48 unclamped).
    att = {("post_attn", 0): _e(0)}
    assert _run(att)[0] == 48.0
    assert _run(att, [Resolved(("post_attn", 0), _e(0), Bounds(None, 3.5))])[0] == 42.0
    # strength interpolates: 7 + 0.25 * (5 - 7) = 6.5 -> 39.
    assert _run(add, [Resolved(("post_block", 0), _e(0), Bounds(None, 5.0, 0.25))])[0] == 39.0
    # pre_attn 0 ablation zeroes the component for the whole model; the other stays.
    out = _run(clamps=[Resolved(("pre_attn", 0), _e(0), Bounds(0.0, 0.0))])
    assert out.tolist()[:2] == [0.0, 72.0]
    # a lower bound lifts: post_block 1's component 36 -> min 40.
    assert _run(clamps=[Resolved(("post_block", 1), _e(0), Bounds(40.0, None))])[0] == 40.0


def test_fill_selects_positions_exactly_under_chunks_and_cache_hits() -> None:
    """10 prompt tokens, steering the last 3 prompt tokens and the generated tokens
    from the second on (positions 7, 8, 9, 11, 12, 13 of 14). However the positions are
    split into steps (chunked prefill, a prefix-cache hit skipping the first 6, decode
    one by one, a preempted request recomputed), exactly those positions read the slot."""
    from steergate.shared.positions import parse_tokens

    phase = parse_tokens({"prompt": {"last": 3}, "generated": {"from": 1}}, "t")
    want = {7, 8, 9, 11, 12, 13}
    for chunks in ([(0, 10), (10, 11), (11, 12), (12, 13), (13, 14)],
                   [(0, 4), (4, 8), (8, 10), (10, 14)],
                   [(6, 10), (10, 11), (11, 12), (12, 13), (13, 14)]):
        t = SteeringTables(hidden_size=H, layers=[0, 1], num_slots=4, max_tokens=16)
        t.add_request("r", decode_payload(encode_payload(phase, {("post_block", 0): _e(0)})[0]))
        steered = set()
        for first, end in chunks:
            # another request's 2 tokens come first in the flattened batch
            t.fill([StepRequest("r", 2, 2 + end - first, first, 10)], 2 + end - first)
            for i in range(end - first):
                if int(t.index[2 + i]):
                    steered.add(first + i)
            assert not t.index[:2].any()
        assert steered == want, chunks


def test_the_compile_cache_factor_changes_with_the_clamp_cap(monkeypatch) -> None:
    from steergate.engine.worker import compile_tag

    compile_tag.steergate_factor.cache_clear()
    monkeypatch.setenv("STEERGATE_MAX_CLAMPS_PER_SITE", "4")
    four = compile_tag.steergate_factor()
    compile_tag.steergate_factor.cache_clear()
    monkeypatch.setenv("STEERGATE_MAX_CLAMPS_PER_SITE", "0")
    zero = compile_tag.steergate_factor()
    compile_tag.steergate_factor.cache_clear()
    assert four != zero


class _ScaledLayer(torch.nn.Module):
    """Granite's convention in miniature: one stream tensor, the norm after attention
    reads the stream (identity here) and the MLP's residual is that same tensor."""

    residual_multiplier = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = torch.nn.Identity()
        self.post_attention_layernorm = torch.nn.Identity()

    def forward(self, positions, hidden_states):
        residual = hidden_states + self.self_attn(hidden_states) * self.residual_multiplier
        return residual + self.post_attention_layernorm(residual)


class _ScaledModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_ScaledLayer(), _ScaledLayer()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(None, x)
        return x


def test_scaled_residual_convention_clamps_the_stream_in_place() -> None:
    """Stream s -> after attention 2s -> out 4s per layer; a post_attn 0 clamp (max 1)
    on component 0 (2 there) leaves 1 -> 2 -> 8; post_block 1 (16 -> min 20) -> 20."""
    from steergate.engine.worker.conventions import SCALED_RESIDUAL

    def run(clamps) -> torch.Tensor:
        model = _ScaledModel()
        layers, present = find_decoder_layers(model)
        t = _tables(layers=present)
        wrap_layers(layers, present, t, SCALED_RESIDUAL)
        t.add_request("a", _payload(None, clamps))
        t.fill([StepRequest("a", 0, 1, 0, 1)], 1)
        x = torch.zeros(1, H)
        x[0, 0], x[0, 1] = 1.0, 1.0
        return model(x)[0]

    assert run([]).tolist()[:2] == [16.0, 16.0]
    assert run([Resolved(("post_attn", 0), _e(0), Bounds(None, 1.0))]).tolist()[:2] == [8.0, 16.0]
    assert run([Resolved(("post_block", 1), _e(0), Bounds(20.0, None))])[0] == 20.0


def _op_calls(model: torch.nn.Module, x: torch.Tensor) -> dict[str, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x)
    names = [e.name for e in prof.events() if e.name.startswith("steergate::")]
    return {n: names.count(n) for n in set(names)}


def test_each_point_with_an_add_and_clamps_is_one_op() -> None:
    """On CUDA each op is a launch, and inside a graph launches are the cost: a point
    with both tables calls steer_and_clamp once, not steer then clamp. The two layers
    have 5 points (pre_attn 1 is post_block 0's), each called once per forward whether
    anything is steered or not; without clamp tables the same 5 points call steer."""
    model = _Model()
    layers, present = find_decoder_layers(model)
    t = _tables(layers=present)
    wrap_layers(layers, present, t)
    t.fill([], 1)
    calls = _op_calls(model, torch.zeros(1, H))
    assert {k: v for k, v in calls.items() if k != "steergate::capture"} == {
        "steergate::steer_and_clamp": 5
    }
    model = _Model()
    layers, present = find_decoder_layers(model)
    t = _tables(layers=present, k=0)
    wrap_layers(layers, present, t)
    t.fill([], 1)
    calls = _op_calls(model, torch.zeros(1, H))
    assert {k: v for k, v in calls.items() if k != "steergate::capture"} == {"steergate::steer": 5}


def test_steer_and_clamp_is_the_add_then_the_clamps_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(3)
    slots, k, n = 4, 2, 6
    table = torch.randn(slots, H, generator=gen)
    table[0] = 0
    dirs = torch.randn(slots, k, H, generator=gen)
    dirs = dirs / dirs.norm(dim=-1, keepdim=True)
    dirs[0] = 0
    bounds = torch.tensor([[-0.2, 0.3, 1.0], [-math.inf, 0.1, 0.5]]).repeat(slots, 1, 1)
    bounds[0] = torch.tensor([-math.inf, math.inf, 0.0])
    index = torch.tensor([0, 1, 2, 3, 1, 0, 0, 0])
    hidden, residual = torch.randn(n, H, generator=gen), torch.randn(n, H, generator=gen)
    want = hidden.clone()
    op.torch_steer(want, table, index)
    torch_clamp(want, residual, dirs, bounds, index)
    got = hidden.clone()
    op.mark_live(table, True)
    op.mark_live(dirs, True)
    try:
        torch.ops.steergate.steer_and_clamp(got, residual, table, dirs, bounds, index)
    finally:
        op.mark_live(table, False)
        op.mark_live(dirs, False)
    assert torch.equal(got, want) and not torch.equal(got, hidden)
    # dead tables on CPU: nothing runs, nothing changes
    idle = hidden.clone()
    torch.ops.steergate.steer_and_clamp(idle, residual, table, dirs, bounds, index)
    assert torch.equal(idle, hidden)
