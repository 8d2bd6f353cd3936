"""What the steering op costs on a GPU: a Llama-3-8B-shaped decode step in a CUDA graph.

The step is built from torch ops (bf16, 32 layers, hidden 4096, RMSNorm, fused QKV, GQA
``scaled_dot_product_attention`` with 32 query / 8 KV heads of 128 over a 1,024-token KV
cache per sequence, fused gate/up 2 x 14336, SiLU, down), every token of the step is its
own sequence (a decode batch), and the whole step is captured in one CUDA graph. The
steered model is the same step with the project's real ``steergate/engine/worker/layers.py``
wrappers, ``op.py`` (the ``steergate::steer`` custom op, fused Triton kernel on CUDA) and
``tables.py`` (``SteeringTables.fill`` runs before every replay, as vLLM's runner does).

Variants, interleaved in every repeat (the order rotates) so drift hits all alike:

* ``stock``: the step without the plugin;
* ``op unsteered``: with the op, index all 0 (a batch with no steered request);
* ``op steered``: every token its own slot, every site of that slot written;
* ``alt``: the same op with the kernel launched as one program per token row
  (BLOCK 4096, 8 warps) instead of 1024-column programs (``--no-alt`` drops it);
* ``floor``: the same 65 launches of a Triton kernel that does nothing (what a
  launch per site costs at least; dropped with ``--no-alt`` too);
* ``before``: the op body as it was (torch ``index_select`` + ``add_``) at all three
  hooks of every layer (96 sites), for comparison (``--no-before`` drops it).

Printed: per variant the median step time with its interquartile spread, and the
ratio ``stock / variant`` of the medians (1.0 = free) with the range of the per-repeat
paired ratios. Before timing it checks on CUDA that the fused kernel equals the torch
body bit for bit (float32, float16, bfloat16), that a captured graph reads the tables'
current contents, and that the unsteered step equals the stock step bit for bit.

``--compiled`` (or ``--compiled-only``) also times the step compiled by torch.compile
(Inductor, as vLLM compiles a model on CUDA) and captured per token count, with the
engine's clamp tables (``--clamps K`` per point, 0: none): ``stock``, ``kernel`` (the
custom ops, opaque to Inductor: the default) and ``inductor`` (their torch bodies traced
into the graph, ``STEERGATE_CUDA_COMPILED_STEER=inductor``), unsteered, steered, and
steered with K clamps at every ``post_block``; ``--compiled-layers`` (8) keeps compile
time short (the op's cost and the step's both scale with the layer count). With clamp
tables each point is one op, ``steergate::steer_and_clamp`` (one fused launch: the add,
then the clamps), as in the engine. Each variant is compiled as vLLM compiles a model
(``--compile-mode vllm``, the default): once, at the largest token count, with the token
dimension dynamic and Dynamo's guards dropped, so every token count, 1 included, replays
that one graph (``torch.compile(dynamic=True)`` alone specialises size 1, a graph vLLM
never builds: ``--compile-mode per-size`` keeps that older method for comparison). The
run prints how many kernels Inductor generated for each variant (stock == inductor: the
traced body fused into its neighbours).

Where vLLM's CUDA build is installed and ``--vllm-model`` names a model, it also times
``vllm.LLM.generate`` with the plugin off / on unsteered / on steered (skipped otherwise).

    python bench/steering_overhead_gpu.py                      # ~2 min on one H200
    python bench/steering_overhead_gpu.py --tokens 1,16 --repeats 9 --out table.txt

``--rehearse`` runs all of it on CPU at toy sizes (figures meaningless): the check, in
CI, that a run prepared for a lent GPU gets to its tables (``bench/gpu_session.sh
--rehearse``, tests/engine/test_gpu_session_rehearsal.py).

Needs only torch (+ Triton for the fused kernel) and numpy; imports steergate from the
checkout or from ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("steergate") is None:  # run from a checkout, not installed
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from steergate.engine.payload import Payload  # noqa: E402
from steergate.engine.worker import capture as worker_capture  # noqa: E402
from steergate.engine.worker import fused, op  # noqa: E402
from steergate.engine.worker.layers import find_decoder_layers, wrap_layers  # noqa: E402
from steergate.engine.worker.tables import HOOKS, SteeringTables, StepRequest  # noqa: E402
from steergate.shared.clamp import Bounds, Resolved  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 4096, 32, 8, 128, 14336
EPS = 1e-5
DT = torch.bfloat16
DEVICE = "cuda"  # --rehearse sets "cpu" (see _rehearse)
# The fused kernel's launch shape for the "alt" variants: one program per token row.
ALT_BLOCK, ALT_WARPS = 4096, 8


# ---- the model: vLLM's (hidden_states, residual) convention -----------------------


class _Attn(nn.Module):
    def __init__(self, w: dict[str, torch.Tensor], kv: tuple[torch.Tensor, torch.Tensor]):
        super().__init__()
        self.w, self.k_cache, self.v_cache = w, kv[0], kv[1]

    def forward(self, positions: torch.Tensor | None, hidden_states: torch.Tensor) -> torch.Tensor:
        t = hidden_states.shape[0]
        qkv = F.linear(hidden_states, self.w["qkv"])
        q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        k_cache, v_cache = self.k_cache[:t], self.v_cache[:t]
        # The new token's K/V go to the last position of each sequence's cache.
        k_cache[:, :, -1].copy_(k.view(t, KV_HEADS, HEAD_DIM))
        v_cache[:, :, -1].copy_(v.view(t, KV_HEADS, HEAD_DIM))
        out = F.scaled_dot_product_attention(
            q.view(t, HEADS, 1, HEAD_DIM), k_cache, v_cache, enable_gqa=True
        )
        return F.linear(out.reshape(t, HEADS * HEAD_DIM), self.w["o"])


class _RMSNorm(nn.Module):
    """vLLM's RMSNorm convention: ``norm(x)``, or with a residual ``(norm(x + r), x + r)``."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return F.rms_norm(x, (HIDDEN,), self.weight, EPS)
        s = x + residual
        return F.rms_norm(s, (HIDDEN,), self.weight, EPS), s


class _Layer(nn.Module):
    def __init__(self, w: dict[str, torch.Tensor], kv: tuple[torch.Tensor, torch.Tensor]):
        super().__init__()
        self.w = w
        self.self_attn = _Attn(w, kv)
        self.input_layernorm = _RMSNorm(w["ln1"])
        self.post_attention_layernorm = _RMSNorm(w["ln2"])

    def forward(
        self,
        positions: torch.Tensor | None,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            x = self.input_layernorm(hidden_states)
        else:
            x, residual = self.input_layernorm(hidden_states, residual)
        attn = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(attn, residual)
        gate, up = F.linear(x, self.w["gate_up"]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w["down"]), residual


class _Model(nn.Module):
    def __init__(self, weights: list[dict[str, torch.Tensor]], kv: list[tuple[torch.Tensor, ...]]):
        super().__init__()
        self.layers = nn.ModuleList([_Layer(w, c) for w, c in zip(weights, kv, strict=True)])  # type: ignore[arg-type]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(None, hidden, residual)
        assert residual is not None
        return hidden + residual


def _weights(layers: int, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.empty(rows, cols, dtype=DT, device=DEVICE).normal_(
            0, cols**-0.5, generator=gen
        )

    qkv_out = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return [
        {
            "ln1": torch.ones(HIDDEN, dtype=DT, device=DEVICE),
            "ln2": torch.ones(HIDDEN, dtype=DT, device=DEVICE),
            "qkv": mat(qkv_out, HIDDEN),
            "o": mat(HIDDEN, HEADS * HEAD_DIM),
            "gate_up": mat(2 * FFN, HIDDEN),
            "down": mat(HIDDEN, FFN),
        }
        for _ in range(layers)
    ]


def _kv(
    layers: int, max_tokens: int, ctx: int, gen: torch.Generator
) -> list[tuple[torch.Tensor, ...]]:
    shape = (max_tokens, KV_HEADS, ctx, HEAD_DIM)
    return [
        tuple(torch.empty(shape, dtype=DT, device=DEVICE).normal_(generator=gen) for _ in range(2))
        for _ in range(layers)
    ]


def _wrap_before(model: _Model, tables: SteeringTables) -> None:
    """The op as it was: torch gather + add at all three hooks of every layer."""
    index = tables.index

    def site(table: torch.Tensor) -> Callable[[torch.Tensor], None]:
        return lambda h: op.torch_steer(h, table, index)

    for i, layer in enumerate(model.layers):
        pre, post = site(tables.tables[("pre_attn", i)]), site(tables.tables[("post_block", i)])
        mid = site(tables.tables[("post_attn", i)])
        fwd, attn_fwd = layer.forward, layer.self_attn.forward

        def layer_forward(positions, hidden_states, residual, _f=fwd, _pre=pre, _post=post):
            _pre(hidden_states)
            out = _f(positions, hidden_states, residual)
            _post(out[0])
            return out

        def attn_forward(positions, hidden_states, _f=attn_fwd, _mid=mid):
            out = _f(positions, hidden_states)
            _mid(out)
            return out

        layer.forward = layer_forward
        layer.self_attn.forward = attn_forward


@functools.cache
def _empty_kernel() -> Any:
    """A kernel with the op's signature that does nothing: the launch floor."""
    import triton
    import triton.language as tl

    @triton.jit
    def empty(
        hidden_ptr, table_ptr, index_ptr, hidden_stride, table_stride, width, BLOCK: tl.constexpr
    ):
        tl.program_id(0)  # references tl, so Triton resolves the annotation

    return empty


# ---- checks -------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _kernel_dtypes() -> tuple[torch.dtype, ...]:
    """What the kernel checks cover: bfloat16 on CUDA only (Triton's interpreter, which
    runs them in a rehearsal, gives NaNs in bfloat16)."""
    if DEVICE == "cuda":
        return (torch.float32, torch.float16, torch.bfloat16)
    return (torch.float32, torch.float16)


def _kernels_runnable() -> bool:
    return DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def check_kernel() -> list[str]:
    """Fused kernel (and the op's CUDA dispatch) == torch body, bit for bit."""
    lines = []
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for dtype in _kernel_dtypes():
        for width in (4096, 577, 1000):
            slots, tokens = 257, 300
            table = (torch.randn(slots, width, device=DEVICE, generator=gen)).to(dtype)
            table[0] = 0
            op.mark_live(table, True)  # as SteeringTables marks a written table (CPU reads it)
            hidden = (torch.randn(tokens, width, device=DEVICE, generator=gen) * 4).to(dtype)
            index = torch.randint(0, slots, (tokens + 16,), device=DEVICE, generator=gen)
            index[0], index[1], index[2] = 0, slots - 1, 0
            want = hidden.clone()
            op.torch_steer(want, table, index)
            got = hidden.clone()
            fused.gather_add(got, table, index)
            via_op = hidden.clone()
            torch.ops.steergate.steer(via_op, table, index)
            same = torch.equal(_bits(got), _bits(want)) and torch.equal(_bits(via_op), _bits(want))
            untouched = torch.equal(_bits(got[0]), _bits(hidden[0]))
            lines.append(
                f"  kernel == torch op  {str(dtype):15} width {width:5}: "
                f"{'bit-identical' if same and untouched else 'MISMATCH'}"
            )
    return lines


def check_clamp_kernel() -> list[str]:
    """Fused clamp kernel == the torch body to rounding (its dot products sum in
    another order); rows at slot 0 untouched bit for bit."""
    from steergate.engine.worker import clamp as clamp_op

    lines = []
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    tols = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
    for dtype, tol in ((d, tols[d]) for d in _kernel_dtypes()):
        for width in (4096, 577):
            table = clamp_op.ClampTable(9, 4, width, torch.device(DEVICE))
            d = torch.randn(8, 4, width, device=DEVICE, generator=gen)
            table.dirs[1:] = d / d.norm(dim=-1, keepdim=True)
            table.bounds[1:, :, 0], table.bounds[1:, :, 1] = -0.3, 0.4
            table.bounds[1:, :, 2] = 0.5
            hidden = (torch.randn(40, width, device=DEVICE, generator=gen) * 2).to(dtype)
            residual = torch.randn(40, width, device=DEVICE, generator=gen).to(dtype)
            index = torch.randint(0, 9, (48,), device=DEVICE, generator=gen)
            index[0], index[1] = 0, 8
            want = hidden.clone()
            clamp_op.torch_clamp(want, residual, table.dirs, table.bounds, index)
            got = hidden.clone()
            fused.clamp(got, residual, table.dirs, table.bounds, index)
            err = ((got.float() - want.float()).abs() / (1 + want.float().abs())).max().item()
            ok = err <= tol and torch.equal(_bits(got[0]), _bits(hidden[0]))
            lines.append(
                f"  clamp kernel ~ torch  {str(dtype):15} width {width:5}: "
                f"{'ok' if ok else 'MISMATCH'} (max rel {err:.1e})"
            )
            # The point's add and clamps in one launch == the add kernel, then the clamp
            # kernel, bit for bit (bfloat16 included: the interpreter cannot check it).
            add = torch.randn(9, width, device=DEVICE, generator=gen).to(dtype)
            add[0] = 0
            merged, sequence = hidden.clone(), hidden.clone()
            fused.steer_and_clamp(merged, residual, add, table.dirs, table.bounds, index)
            fused.gather_add(sequence, add, index)
            fused.clamp(sequence, residual, table.dirs, table.bounds, index)
            same = torch.equal(_bits(merged), _bits(sequence))
            same = same and torch.equal(_bits(merged[0]), _bits(hidden[0]))
            lines.append(
                f"  add+clamp, one launch == two launches  {str(dtype):15} width {width:5}: "
                f"{'bit-identical' if same else 'MISMATCH'}"
            )
    return lines


def check_graph_reads_tables() -> list[str]:
    """A captured graph sees rows written and index filled after capture."""
    width, tokens = 4096, 8
    t = SteeringTables(
        hidden_size=width,
        layers=[0],
        num_slots=5,
        max_tokens=64,
        dtype=torch.float32,
        device=DEVICE,
        max_clamps=0,
    )
    table = t.tables[("post_block", 0)]
    x = torch.randn(tokens, width, device=DEVICE)
    out = torch.empty_like(x)

    def body() -> None:
        y = x * 2
        op.apply(y, table, t.index)
        out.copy_(y + 1)

    g = _capture(body)
    results = []
    rng = np.random.default_rng(0)
    for round_ in range(3):
        vecs = {f"r{round_}-{i}": rng.normal(size=width).astype(np.float32) for i in range(2)}
        for rid, vec in vecs.items():
            t.add_request(rid, Payload("all", {("post_block", 0): vec}, digest=rid))
        # tokens 0-2 request A, 3 unsteered, 4-6 request B, 7 unsteered
        ids = list(vecs)
        t.fill([StepRequest(ids[0], 0, 3, 0, 3), StepRequest(ids[1], 4, 7, 0, 3)], tokens)
        g.replay()
        _sync()
        want = x * 2
        for lo, hi, rid in ((0, 3, ids[0]), (4, 7, ids[1])):
            want[lo:hi] += torch.from_numpy(vecs[rid]).to(DEVICE)
        want += 1
        results.append(torch.equal(out, want))
        for rid in ids:
            t.remove_request(rid)
    t.fill([], tokens)
    g.replay()
    _sync()
    results.append(torch.equal(out, x * 2 + 1))
    ok = all(results)
    return [
        f"  captured graph reads current tables (3 rounds of new requests, then none): "
        f"{'yes' if ok else 'NO ' + str(results)}"
    ]


# ---- timing -------------------------------------------------------------------


class _HostGraph:
    """``--rehearse``: a captured graph on CPU is the step itself, called on replay."""

    def __init__(self, fn: Callable[[], None]):
        self.replay = fn


Graph = Any  # torch.cuda.CUDAGraph, or a _HostGraph in a rehearsal


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _capture(fn: Callable[[], None]) -> Graph:
    """Capture ``fn`` in its own graph (own memory pool: a pool shared across token
    counts tripped an allocator assert in torch 2.11 once earlier graphs were freed)."""
    if DEVICE != "cuda":
        for _ in range(2):
            fn()
        return _HostGraph(fn)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def _elapsed_ms(run: Callable[[], None]) -> float:
    """Device time of ``run`` (CUDA events; wall time in a rehearsal)."""
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def compile_like_vllm(model: nn.Module, example: torch.Tensor) -> Callable[..., Any]:
    """``model`` compiled as vLLM compiles one (vllm/compilation/wrapper.py and
    decorators.py): Inductor, fullgraph, the token dimension of ``example`` marked
    dynamic, traced once on ``example`` (vLLM traces on its largest dummy batch), and
    every guard dropped, so later calls of any token count, 1 included, run that graph
    instead of a size-specialised one. Each call of this function gets its own code
    object: Dynamo caches compiled frames on the code object, and without guards two
    models sharing one forward would share one graph."""

    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    fresh = types.FunctionType(
        step.__code__.replace(),
        step.__globals__,
        f"step_{id(model):x}",
        None,
        step.__closure__,
    )
    skip = getattr(torch.compiler, "skip_all_guards_unsafe", None) or (
        lambda guards: [False for _ in guards]
    )
    compiled = torch.compile(
        fresh, fullgraph=True, dynamic=False, options={"guard_filter_fn": skip}
    )
    x = example.clone()
    torch._dynamo.mark_dynamic(x, 0)
    compiled(x)
    return compiled


def _q(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]


def bench_tokens(
    n: int,
    models: dict[str, _Model],
    tables: SteeringTables,
    reqs: list[StepRequest],
    args: argparse.Namespace,
) -> tuple[dict[str, list[float]], str, bool]:
    x = torch.empty(n, HIDDEN, dtype=DT, device=DEVICE).normal_()
    outs = {name: torch.empty(n, HIDDEN, dtype=DT, device=DEVICE) for name in models}
    steered = reqs[:n]

    def fill_none() -> None:
        tables.fill([], n)

    def fill_steered() -> None:
        tables.fill(steered, n)

    graphs = {}
    default_shape = fused.BLOCK, fused.NUM_WARPS
    for name, model in models.items():

        def step(model: _Model = model, out: torch.Tensor = outs[name]) -> None:
            out.copy_(model(x.clone()))  # the op adds in place: never into x itself

        fill_none()
        # A graph keeps the launch shape and kernel it was captured with.
        fused.BLOCK, fused.NUM_WARPS = (ALT_BLOCK, ALT_WARPS) if name == "alt" else default_shape
        kernel = fused._kernel
        if name == "floor":
            fused._kernel = _empty_kernel  # type: ignore[assignment]
        try:
            graphs[name] = _capture(step)
        finally:
            fused.BLOCK, fused.NUM_WARPS = default_shape
            fused._kernel = kernel  # type: ignore[method-assign]

    # Same step, index all 0: should equal the stock step bit for bit (if the stock
    # step itself replays bit-identically); steered must differ.
    fill_none()
    graphs["stock"].replay()
    _sync()
    first = outs["stock"].clone()
    graphs["stock"].replay()
    graphs["op"].replay()
    _sync()
    diff = (outs["stock"].float() - outs["op"].float()).abs().max().item()
    unsteered_equal = (
        f"{'yes' if torch.equal(_bits(outs['stock']), _bits(outs['op'])) else 'NO'} "
        f"(max |d| {diff:.3g}; stock replays identical: "
        f"{'yes' if torch.equal(_bits(first), _bits(outs['stock'])) else 'NO'})"
    )
    fill_steered()
    graphs["op"].replay()
    _sync()
    steered_differs = not torch.equal(_bits(outs["stock"]), _bits(outs["op"]))

    variants: list[tuple[str, Graph, Callable[[], None] | None]] = [
        ("stock", graphs["stock"], None),
        ("op unsteered", graphs["op"], fill_none),
        ("op steered", graphs["op"], fill_steered),
    ]
    if "alt" in graphs:
        variants.append(("alt unsteered", graphs["alt"], fill_none))
        variants.append(("alt steered", graphs["alt"], fill_steered))
    if "floor" in graphs:
        variants.append(("floor (empty kernel)", graphs["floor"], fill_none))
    if "before" in graphs:
        variants.append(("before unsteered", graphs["before"], fill_none))
        variants.append(("before steered", graphs["before"], fill_steered))
    times = _time_graphs(variants, args.repeats, args.replays)
    return times, unsteered_equal, steered_differs


def _fmt_ms(xs: list[float]) -> str:
    med = statistics.median(xs)
    iqr = (_q(xs, 0.75) - _q(xs, 0.25)) / med * 100
    return f"{med:7.3f} ±{iqr:.1f}%"


def _fmt_ratio(stock: list[float], var: list[float]) -> str:
    paired = [s / v for s, v in zip(stock, var, strict=True)]
    ratio = statistics.median(stock) / statistics.median(var)
    return f"{ratio:.3f} [{min(paired):.3f}-{max(paired):.3f}]"


def run_synthetic(args: argparse.Namespace, emit: Callable[[str], None]) -> None:
    token_counts = [int(t) for t in args.tokens.split(",")]
    max_t = max(token_counts)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    t0 = time.perf_counter()
    weights = _weights(args.layers, gen)
    kv = _kv(args.layers, max_t, args.ctx, gen)
    models = {"stock": _Model(weights, kv), "op": _Model(weights, kv)}
    tables = SteeringTables(
        hidden_size=HIDDEN,
        layers=list(range(args.layers)),
        num_slots=max_t + 1,
        max_tokens=max_t,
        dtype=DT,
        device=DEVICE,
        max_clamps=0,  # the add alone; clamps are timed in the compiled run
    )
    layers, present = find_decoder_layers(models["op"])
    wrap_layers(layers, present, tables)
    for extra in ("alt", "floor") if args.alt else ():
        models[extra] = _Model(weights, kv)
        extra_layers, _ = find_decoder_layers(models[extra])
        wrap_layers(extra_layers, present, tables)
    if args.before:
        models["before"] = _Model(weights, kv)
        _wrap_before(models["before"], tables)
    # One distinct configuration per token, written at every site.
    rng = np.random.default_rng(0)
    base = {
        (h, layer): (rng.normal(size=HIDDEN) * 0.02).astype(np.float32)
        for h in HOOKS
        for layer in range(args.layers)
    }
    reqs = []
    for i in range(max_t):
        rid = f"req{i}"
        tables.add_request(
            rid, Payload("all", {s: v * (1 + i / max_t) for s, v in base.items()}, rid)
        )
        reqs.append(StepRequest(rid, i, i + 1, first_pos=args.ctx, num_prompt_tokens=16))
    tables.fill(reqs, max_t)  # takes the slots and writes the rows once
    _sync()
    op_sites = sum(1 for i in present if not tables.shares_table_with_previous_layer(i)) + 2 * len(
        present
    )
    emit(
        f"setup {time.perf_counter() - t0:.1f} s: {args.layers} layers, KV cache {args.ctx} tokens "
        f"per sequence, {max_t + 1} slots, op at {op_sites} sites per step (was {3 * args.layers})"
    )

    rows = []
    for n in token_counts:
        t1 = time.perf_counter()
        times, same, differs = bench_tokens(n, models, tables, reqs, args)
        rows.append((n, times))
        emit(
            f"  tokens {n:3}: {time.perf_counter() - t1:.1f} s; unsteered step == stock bit for "
            f"bit: {same}; steered step differs from stock: "
            f"{'yes' if differs else 'NO'}"
        )
    _emit_tables(
        emit,
        rows,
        f"step time, ms (median ±IQR), {args.repeats} interleaved repeats x {args.replays} replays",
        "stock / variant (1.0 = free): ratio of medians [range of per-repeat paired ratios]",
    )


def _emit_tables(
    emit: Callable[[str], None],
    rows: list[tuple[int, dict[str, list[float]]]],
    time_title: str,
    ratio_title: str,
) -> None:
    """The two tables of a run: step times per variant, then stock / variant."""
    names = [k for k in rows[0][1] if k != "stock"]
    emit("")
    emit(time_title)
    emit("| tokens | stock | " + " | ".join(names) + " |")
    emit("|---|---|" + "---|" * len(names))
    for n, times in rows:
        cells = " | ".join(_fmt_ms(times[k]) for k in names)
        emit(f"| {n} | {_fmt_ms(times['stock'])} | {cells} |")
    emit("")
    emit(ratio_title)
    emit("| tokens | " + " | ".join(names) + " |")
    emit("|---|" + "---|" * len(names))
    for n, times in rows:
        emit(f"| {n} | " + " | ".join(_fmt_ratio(times["stock"], times[k]) for k in names) + " |")


# ---- compiled (what vLLM runs on CUDA by default) --------------------------------


def _time_graphs(
    variants: list[tuple[str, Graph, Callable[[], None] | None]],
    repeats: int,
    replays: int,
) -> dict[str, list[float]]:
    """Per-variant step times (ms), variants interleaved with a rotating order."""
    times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    for rep in range(repeats):
        k = rep % len(variants)
        for name, g, fill in variants[k:] + variants[:k]:
            if fill:
                fill()
            g.replay()  # absorbs an index change between variants

            def run(g: Graph = g, fill: Callable[[], None] | None = fill) -> None:
                for _ in range(replays):
                    if fill:
                        fill()
                    g.replay()

            times[name].append(_elapsed_ms(run) / replays)
    return times


def run_compiled(args: argparse.Namespace, emit: Callable[[str], None]) -> None:
    """The step compiled by torch.compile (Inductor), as vLLM compiles a model on CUDA,
    then captured in a CUDA graph per token count. Variants: ``stock`` (compiled without
    the plugin), ``kernel`` (the op as an opaque custom op: one fused launch per site)
    and ``inductor`` (the op's torch body traced into the graph,
    ``STEERGATE_CUDA_COMPILED_STEER=inductor``: Inductor schedules the gather-add with the
    neighbouring kernels). Compiled as ``--compile-mode`` says (:func:`compile_like_vllm`
    by default). Fewer layers than the eager run (``--compiled-layers``) keep compile
    time short: the op's cost and the step's both scale with the layer count, so the
    ratio does not."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 256
    token_counts = [int(t) for t in args.tokens.split(",")]
    max_t, n_layers = max(token_counts), args.compiled_layers
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    t0 = time.perf_counter()
    weights = _weights(n_layers, gen)
    kv = _kv(n_layers, max_t, args.ctx, gen)
    tables = SteeringTables(
        hidden_size=HIDDEN,
        layers=list(range(n_layers)),
        num_slots=3 * max_t + 1,
        max_tokens=max_t,
        dtype=DT,
        device=DEVICE,
        max_clamps=args.clamps,
    )
    eager = _Model(weights, kv)
    models = {
        "stock": _Model(weights, kv),
        "kernel": _Model(weights, kv),
        "inductor": _Model(weights, kv),
    }
    for name in ("kernel", "inductor"):
        layers, present = find_decoder_layers(models[name])
        wrap_layers(layers, present, tables)
    layers, present = find_decoder_layers(eager)
    wrap_layers(layers, present, tables)
    kernels: dict[str, int] = {}
    if args.compile_mode == "vllm":
        from torch._inductor import config as inductor_config
        from torch._inductor import metrics

        t_compile = time.perf_counter()
        example = torch.empty(max_t, HIDDEN, dtype=DT, device=DEVICE).normal_()
        tables.fill([], max_t)
        compiled = {}
        for name, m in models.items():
            op.CUDA_COMPILED_BODY = "inductor" if name == "inductor" else "kernel"
            metrics.reset()
            with inductor_config.patch(fx_graph_cache=False):  # count what it generates
                compiled[name] = compile_like_vllm(m, example)
            kernels[name] = metrics.generated_kernel_count
        op.CUDA_COMPILED_BODY = "inductor"
        emit(
            f"compiled as vLLM does: once per variant at {max_t} tokens, token dimension "
            f"dynamic, guards dropped ({time.perf_counter() - t_compile:.1f} s); kernels "
            "Inductor generated: " + ", ".join(f"{k} {v}" for k, v in kernels.items())
        )
    else:
        compiled = {name: torch.compile(m, dynamic=True) for name, m in models.items()}
    rng = np.random.default_rng(0)

    def unit(v: np.ndarray) -> np.ndarray:
        return (v / np.linalg.norm(v)).astype(np.float32)

    def requests(tag: str, scale: float, count: int, clamps: bool = False) -> list[StepRequest]:
        out = []
        for i in range(count):
            rid = f"{tag}{i}"
            vecs = {
                (h, layer): (rng.normal(size=HIDDEN) * 0.02 * scale).astype(np.float32)
                for h in HOOKS
                for layer in range(n_layers)
            }
            # The cap's worth of clamps at every layer's post_block: one ablation and
            # half-strength two-sided clamps (the CPU benchmark's mix).
            cl = (
                tuple(
                    Resolved(
                        ("post_block", layer),
                        unit(rng.normal(size=HIDDEN)),
                        Bounds(0.0, 0.0) if k == 0 else Bounds(-0.5, 0.5, 0.5),
                    )
                    for layer in range(n_layers)
                    for k in range(args.clamps)
                )
                if clamps
                else ()
            )
            tables.add_request(rid, Payload("all", vecs, rid, clamps=cl))
            out.append(StepRequest(rid, i, i + 1, first_pos=args.ctx, num_prompt_tokens=16))
        return out

    reqs = requests("a", 1.0, max_t)
    creqs = requests("c", 1.0, max_t, clamps=args.clamps > 0) if args.clamps else []
    tables.fill(reqs, max_t)
    _sync()
    emit(f"compiled: setup {time.perf_counter() - t0:.1f} s, {n_layers} layers")
    rows = []
    deadline = time.perf_counter() + args.compiled_budget_s
    for n in token_counts:
        if time.perf_counter() > deadline:
            emit(f"  tokens {n}: skipped (--compiled-budget-s spent)")
            continue
        t1 = time.perf_counter()
        x = torch.empty(n, HIDDEN, dtype=DT, device=DEVICE).normal_()
        outs = {name: torch.empty(n, HIDDEN, dtype=DT, device=DEVICE) for name in compiled}

        def fill_none(n: int = n) -> None:
            tables.fill([], n)

        def fill_steered(n: int = n, r: list[StepRequest] = reqs) -> None:
            tables.fill(r[:n], n)

        def fill_clamped(n: int = n, r: list[StepRequest] = creqs) -> None:
            tables.fill(r[:n], n)

        graphs = {}
        for name, fn in compiled.items():
            op.CUDA_COMPILED_BODY = "kernel" if name == "kernel" else "inductor"

            def step(
                fn: Callable[..., torch.Tensor] = fn,
                out: torch.Tensor = outs[name],
                x: torch.Tensor = x,
            ) -> None:
                out.copy_(fn(x.clone()))

            fill_none()
            graphs[name] = _capture(step)
        op.CUDA_COMPILED_BODY = "inductor"
        compile_s = time.perf_counter() - t1
        # Checks: unsteered == stock; steered == the eager op (bf16 rounding apart:
        # Inductor keeps the sum in float32 where eager rounds after each add); a
        # request registered after capture is read by the captured graph.
        fill_none()
        graphs["stock"].replay()
        graphs["inductor"].replay()
        _sync()
        same = torch.equal(_bits(outs["stock"]), _bits(outs["inductor"]))
        late = requests(f"late{n}-", 3.0, n)
        tables.fill(late, n)
        graphs["inductor"].replay()
        graphs["kernel"].replay()
        want = eager(x.clone())
        _sync()
        scale = want.float().abs().max().item()
        d_ind = (outs["inductor"].float() - want.float()).abs().max().item() / scale
        d_ker = (outs["kernel"].float() - want.float()).abs().max().item() / scale
        d_stock = (outs["stock"].float() - want.float()).abs().max().item() / scale
        for r in late:
            tables.remove_request(r.req_id)
        d_clamp = ""
        if creqs:
            fill_clamped()
            graphs["inductor"].replay()
            ind = outs["inductor"].clone()
            graphs["kernel"].replay()
            want = eager(x.clone())
            _sync()
            scale = want.float().abs().max().item()
            d_i = (ind.float() - want.float()).abs().max().item() / scale
            d_k = (outs["kernel"].float() - want.float()).abs().max().item() / scale
            d_clamp = f"; with clamps: inductor {d_i:.2e}, kernel {d_k:.2e}"
        variants = [
            ("stock", graphs["stock"], None),
            ("kernel unsteered", graphs["kernel"], fill_none),
            ("kernel steered", graphs["kernel"], fill_steered),
            ("inductor unsteered", graphs["inductor"], fill_none),
            ("inductor steered", graphs["inductor"], fill_steered),
        ]
        if creqs:
            variants += [
                ("kernel +clamps", graphs["kernel"], fill_clamped),
                ("inductor +clamps", graphs["inductor"], fill_clamped),
            ]
        times = _time_graphs(variants, args.repeats, args.replays)
        rows.append((n, times))
        emit(
            f"  tokens {n:3}: compile+capture {compile_s:.1f} s, "
            f"total {time.perf_counter() - t1:.1f} s; "
            f"inductor unsteered == stock bit for bit: {'yes' if same else 'NO'}; "
            f"steered by requests added after capture, max |d| / max|ref| vs the eager op: "
            f"inductor {d_ind:.2e}, kernel {d_ker:.2e} (stock, unsteered: {d_stock:.2e})"
            f"{d_clamp}; graph breaks so far: {sum(counters['graph_break'].values())}, "
            f"graphs compiled so far: {counters['stats']['unique_graphs']}"
        )
    if not rows:
        return
    _emit_tables(
        emit,
        rows,
        f"compiled step ({n_layers} layers), ms (median ±IQR), {args.repeats} repeats x "
        f"{args.replays} replays",
        "compiled: stock / variant (1.0 = free): ratio of medians [range of paired ratios]",
    )


# ---- through vLLM (where its CUDA build is installed) ----------------------------

_VLLM_CHILD = r"""
import json, sys, time, numpy as np
from vllm import LLM, SamplingParams
cfg = json.loads(sys.argv[1])
llm = LLM(cfg["model"], max_num_seqs=max(cfg["batches"]), gpu_memory_utilization=0.6)
hf = llm.llm_engine.model_config.hf_config
out = {}
for b in cfg["batches"]:
    extra = [None] * b
    if cfg["mode"] == "steered":
        from steergate.engine.payload import encode_payload
        rng = np.random.default_rng(b)
        def sites():
            return {(h, l): (rng.normal(size=hf.hidden_size) * 0.01).astype(np.float32)
                    for h in ("pre_attn", "post_attn", "post_block")
                    for l in range(hf.num_hidden_layers)}
        extra = [{"steergate": encode_payload("all", sites())[0]} for _ in range(b)]
    params = [SamplingParams(max_tokens=cfg["max_tokens"], ignore_eos=True, extra_args=e)
              for e in extra]
    prompts = [{"prompt_token_ids": [100 + (i + j) % 1000 for j in range(16)]} for i in range(b)]
    llm.generate(prompts, params, use_tqdm=False)
    runs = []
    for _ in range(cfg["repeats"]):
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        runs.append(b * cfg["max_tokens"] / (time.perf_counter() - t0))
    out[b] = runs
print("RESULT " + json.dumps(out))
"""


def run_vllm(args: argparse.Namespace, emit: Callable[[str], None]) -> None:
    if importlib.util.find_spec("vllm") is None:
        emit("vLLM: not installed here; the vllm.LLM comparison is skipped")
        return
    if torch.version.cuda is None:
        emit("vLLM: this torch has no CUDA build; the vllm.LLM comparison is skipped")
        return
    if not args.vllm_model:
        emit("vLLM: no --vllm-model given; the vllm.LLM comparison is skipped")
        return
    batches = [int(t) for t in args.tokens.split(",")]
    results = {}
    for mode in ("stock", "unsteered", "steered"):
        env = dict(os.environ)
        if mode == "stock":
            env["VLLM_PLUGINS"] = ""  # no general plugin: vLLM without steergate
        cfg = {
            "model": args.vllm_model,
            "batches": batches,
            "mode": mode,
            "max_tokens": 64,
            "repeats": max(3, args.repeats // 3),
        }
        proc = subprocess.run(
            [sys.executable, "-c", _VLLM_CHILD, json.dumps(cfg)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            emit(f"vLLM {mode}: failed (rc {proc.returncode}): {proc.stderr.strip()[-400:]}")
            return
        results[mode] = {int(k): v for k, v in json.loads(line[7:]).items()}
    emit("")
    emit(f"vllm.LLM {args.vllm_model}: decode tok/s median; ratio = variant / stock")
    emit("| batch | stock | unsteered | steered | unsteered/stock | steered/stock |")
    emit("|---|---|---|---|---|---|")
    for b in batches:
        s, u, st = (statistics.median(results[m][b]) for m in ("stock", "unsteered", "steered"))
        emit(f"| {b} | {s:.0f} | {u:.0f} | {st:.0f} | {u / s:.3f} | {st / s:.3f} |")


def _rehearse(args: argparse.Namespace) -> None:
    """``--rehearse``: the same run on CPU at toy sizes (hidden 64, at most 2 layers, a
    16-token cache, 3 repeats x 2 replays), graphs replaced by calls and CUDA events
    by wall time. It proves a prepared device run (``bench/gpu_session.sh --rehearse``)
    gets from start to table before a lent GPU's minutes are spent on it; the figures
    mean nothing. With ``TRITON_INTERPRET=1`` the kernel checks run in Triton's
    interpreter (float32 and float16), else they are skipped."""
    global DEVICE, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN
    DEVICE = "cpu"
    HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 2, 1, 32, 128
    args.layers = min(args.layers, 2)
    args.compiled_layers = min(args.compiled_layers, 2)
    args.ctx = min(args.ctx, 16)
    args.repeats = min(args.repeats, 3)
    args.replays = min(args.replays, 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,4,16,64,256")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=1024, help="KV cache tokens per sequence")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--replays", type=int, default=10, help="graph replays per timed run")
    ap.add_argument("--no-before", dest="before", action="store_false")
    ap.add_argument(
        "--no-alt",
        dest="alt",
        action="store_false",
        help="drop the variants with the kernel launched one program per row",
    )
    ap.add_argument("--vllm-model", help="a model folder for the vllm.LLM comparison")
    ap.add_argument(
        "--compiled",
        action="store_true",
        help="also time the step compiled by torch.compile (Inductor)",
    )
    ap.add_argument(
        "--compiled-only",
        action="store_true",
        help="only the compiled comparison (skips the eager-graph table)",
    )
    ap.add_argument("--compiled-layers", type=int, default=8)
    ap.add_argument(
        "--compile-mode",
        choices=("vllm", "per-size"),
        default="vllm",
        help="vllm: one dynamic graph per variant, guards dropped (as vLLM runs it); "
        "per-size: torch.compile(dynamic=True), which specialises 1 token",
    )
    ap.add_argument(
        "--clamps",
        type=int,
        default=4,
        help="clamp entries per point in the compiled run (0: add only)",
    )
    ap.add_argument(
        "--compiled-budget-s",
        type=float,
        default=240,
        help="start no new token count in the compiled run after this",
    )
    ap.add_argument("--out", help="also write the printed report here")
    ap.add_argument(
        "--rehearse",
        action="store_true",
        help="run every step on CPU at toy sizes (figures meaningless): proves the run "
        "works before a device session spends its minutes on it",
    )
    args = ap.parse_args(argv)
    if args.rehearse:
        _rehearse(args)
    elif not torch.cuda.is_available():
        print("steering_overhead_gpu: needs a CUDA device; nothing measured", file=sys.stderr)
        return 2
    # The step replays CUDA graphs, so it is wrapped as such an engine's layers are:
    # without capture calls (capture_io.refusal; capture is refused there).
    worker_capture.call_op(False)
    lines: list[str] = []

    def emit(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    t0 = time.perf_counter()
    device = (
        torch.cuda.get_device_name()
        if DEVICE == "cuda"
        else "CPU REHEARSAL (--rehearse: toy sizes, the figures mean nothing)"
    )
    emit(
        f"device: {device}; torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"Triton {'yes' if fused.available() else 'NO (torch body)'}"
    )
    emit("checks:")
    if _kernels_runnable():
        try:
            for line in check_kernel():
                emit(line)
        except Exception as exc:  # report it, then measure the torch body instead
            emit(f"  fused kernel FAILED ({type(exc).__name__}: {exc}); timing the torch body")
            traceback.print_exc()
            fused.available = lambda: False  # type: ignore[assignment]
        for line in check_clamp_kernel():
            emit(line)
    else:
        emit("  fused kernels: not run (no CUDA, and TRITON_INTERPRET is not 1)")
    for line in check_graph_reads_tables():
        emit(line)
    if not args.compiled_only:
        run_synthetic(args, emit)
    if args.compiled or args.compiled_only:
        run_compiled(args, emit)
    run_vllm(args, emit)
    emit(f"total {time.perf_counter() - t0:.0f} s")
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
