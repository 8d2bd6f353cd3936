"""Decode throughput with 16 differently steered requests vs. the same batch unsteered.

Generates a random Llama (hidden 1024, 8 layers, 16 heads of 64) into a temp dir,
runs vLLM offline (``vllm.LLM``, default compile mode, steergate plugin loaded)
and times ``generate`` for one batch of ``--batch`` requests, alternating
unsteered and steered runs so that machine noise hits both alike; prints medians.

Steered: every request has its own configuration (distinct vectors) on every
layer, at ``post_block`` (``--hooks post_block``) or at all three hooks
(``--hooks all``), so every step gathers from ``batch`` different slots. With
``--clamps K`` every steered request also clamps K directions (one ablation, the
rest two-sided clamps) at every layer's ``post_block`` (issue 20).

    VLLM_CPU_KVCACHE_SPACE=2 .venv/bin/python bench/steering_overhead.py --repeats 5
    VLLM_CPU_KVCACHE_SPACE=2 .venv/bin/python bench/steering_overhead.py --clamps 4
    .venv/bin/python bench/steering_overhead.py --micro-only --hidden 576 --layers 30 --clamps 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _payloads(n: int, hidden: int, layers: int, hooks: list[str], clamps: int = 0) -> list[str]:
    import numpy as np

    from steergate.engine.payload import encode_payload
    from steergate.shared.clamp import Bounds, Resolved, unit

    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        sites = {(h, layer): (rng.normal(size=hidden) * 0.05).astype(np.float32)
                 for h in hooks for layer in range(layers)}
        cl = tuple(
            Resolved(("post_block", layer), unit(rng.normal(size=hidden), "bench"),
                     Bounds(0.0, 0.0) if k == 0 else Bounds(-0.5, 0.5, 0.5))
            for layer in range(layers) for k in range(clamps)
        )
        out.append(encode_payload("all", sites, cl)[0])
    return out


def _micro(hidden: int, sites: int, tokens: int, iters: int = 2000) -> None:
    """The op alone, per forward (all sites), for one decode step of ``tokens`` tokens:
    idle (no live table: the CPU early exit) and active (every token its own slot)."""
    import torch

    from steergate.engine.worker import op

    tables = [torch.zeros(tokens + 1, hidden, dtype=torch.bfloat16) for _ in range(sites)]
    index = torch.arange(1, tokens + 1)
    hidden_states = torch.zeros(tokens, hidden, dtype=torch.bfloat16)

    def per_forward() -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            for t in tables:
                torch.ops.steergate.steer(hidden_states, t, index)
        return (time.perf_counter() - t0) / iters * 1e6

    idle = min(per_forward() for _ in range(3))
    for t in tables:
        op.mark_live(t, True)
    active = min(per_forward() for _ in range(3))
    print(f"op alone, {sites} sites x {tokens} tokens x {hidden}: idle {idle:.0f} us/forward, "
          f"active {active:.0f} us/forward")


def _micro_clamp(hidden: int, points: int, tokens: int, k: int, iters: int = 500) -> None:
    """The clamp op alone per forward (``points`` points, K entries each, every token its
    own slot): idle (the CPU early exit) and active."""
    import torch

    from steergate.engine.worker import clamp, op

    tables = [clamp.ClampTable(tokens + 1, k, hidden, torch.device("cpu")) for _ in range(points)]
    index = torch.arange(1, tokens + 1)
    hidden_states = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
    residual = torch.zeros(tokens, hidden, dtype=torch.bfloat16)

    def per_forward() -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            for t in tables:
                torch.ops.steergate.clamp(hidden_states, residual, t.dirs, t.bounds, index)
        return (time.perf_counter() - t0) / iters * 1e6

    idle = min(per_forward() for _ in range(3))
    for t in tables:
        op.mark_live(t.dirs, True)
    active = min(per_forward() for _ in range(3))
    print(f"clamp op alone, {points} points x K={k} x {tokens} tokens x {hidden}: "
          f"idle {idle:.0f} us/forward, active {active:.0f} us/forward")


def _micro_point(hidden: int, points: int, tokens: int, k: int, iters: int = 500,
                 repeats: int = 7) -> None:
    """An idle step's points with clamp tables (no live table: what every unsteered
    step pays once the plugin is loaded): the add and the clamps as two ops per point
    (before) against one ``steer_and_clamp`` per point (now). Interleaved repeats."""
    import torch

    from steergate.engine.worker import clamp

    tables = [(torch.zeros(tokens + 1, hidden, dtype=torch.bfloat16),
               clamp.ClampTable(tokens + 1, k, hidden, torch.device("cpu")))
              for _ in range(points)]
    index = torch.zeros(tokens, dtype=torch.int64)
    hidden_states = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
    residual = torch.zeros(tokens, hidden, dtype=torch.bfloat16)

    def two() -> None:
        for add, c in tables:
            torch.ops.steergate.steer(hidden_states, add, index)
            torch.ops.steergate.clamp(hidden_states, residual, c.dirs, c.bounds, index)

    def one() -> None:
        for add, c in tables:
            torch.ops.steergate.steer_and_clamp(hidden_states, residual, add, c.dirs,
                                                c.bounds, index)

    def per_forward(fn) -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters * 1e6

    got: dict[str, list[float]] = {"two": [], "one": []}
    per_forward(two), per_forward(one)  # warm-up
    for i in range(repeats):
        order = [("two", two), ("one", one)]
        for name, fn in (order if i % 2 == 0 else order[::-1]):
            got[name].append(per_forward(fn))

    def fmt(xs: list[float]) -> str:
        return f"{statistics.median(xs):.0f} us/forward ({min(xs):.0f}-{max(xs):.0f})"

    print(f"idle points with clamp tables, {points} points x K={k} x {tokens} tokens x {hidden}, "
          f"median of {repeats} (min-max): add + clamp as two ops {fmt(got['two'])}; "
          f"steer_and_clamp {fmt(got['one'])}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hooks", choices=["post_block", "all"], default="post_block")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", help="use this model folder instead of generating one")
    ap.add_argument("--clamps", type=int, default=0,
                    help="clamp directions per steered request at every post_block (<= 4)")
    ap.add_argument("--micro-only", action="store_true",
                    help="only the ops alone at --hidden/--layers/--batch (no vLLM run)")
    args = ap.parse_args(argv)
    if args.micro_only:
        sys.path.insert(0, str(ROOT))
        _micro(args.hidden, 2 * args.layers + 1, args.batch)
        _micro_clamp(args.hidden, 2 * args.layers + 1, args.batch, max(args.clamps, 1))
        _micro_point(args.hidden, 2 * args.layers + 1, args.batch, max(args.clamps, 1))
        return 0

    sys.path.insert(0, str(ROOT))
    from bench.offline import offline_llm, shape, token_prompts

    llm, tmp = offline_llm(args.model, args.hidden, args.layers, args.batch, args.dtype)
    from vllm import SamplingParams

    cfg = llm.llm_engine.vllm_config.model_config
    hidden, layers = shape(llm)
    hooks = ["pre_attn", "post_attn", "post_block"] if args.hooks == "all" else ["post_block"]
    payloads = _payloads(args.batch, hidden, layers, hooks, args.clamps)
    prompts = token_prompts(args.batch, args.prompt_tokens)

    def params(payload: str | None) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                              extra_args={"steergate": payload} if payload else None)

    plain = [params(None) for _ in range(args.batch)]
    steered = [params(p) for p in payloads]

    def run(sp: list[SamplingParams]) -> float:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        assert sum(len(o.outputs[0].token_ids) for o in outs) == args.batch * args.max_tokens
        return args.batch * args.max_tokens / dt

    # Sanity: steering really reaches the model (otherwise the numbers mean nothing).
    a = llm.generate(prompts[:1], plain[:1], use_tqdm=False)[0].outputs[0].token_ids
    strong = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            extra_args={"steergate": _payloads(1, hidden, layers, hooks,
                                                               args.clamps)[0]})
    b = llm.generate(prompts[:1], [strong], use_tqdm=False)[0].outputs[0].token_ids
    print(f"steering changes the output: {list(a) != list(b)}")

    run(plain), run(steered)  # warm-up (compiles remaining shapes, fills caches)
    tp_plain: list[float] = []
    tp_steered: list[float] = []
    for i in range(args.repeats):
        order = [(tp_plain, plain), (tp_steered, steered)]
        for bucket, sp in (order if i % 2 == 0 else order[::-1]):
            bucket.append(run(sp))
    mp, ms = statistics.median(tp_plain), statistics.median(tp_steered)
    bp, bs = max(tp_plain), max(tp_steered)
    print(f"model: hidden {hidden}, {layers} layers, dtype {cfg.dtype}; batch {args.batch}, "
          f"prompt {args.prompt_tokens} tokens, {args.max_tokens} new tokens, hooks {args.hooks} "
          f"({len(hooks) * layers} sites per request, {args.clamps} clamps per post_block, "
          f"{args.batch} distinct configs)")
    print("unsteered tok/s: " + ", ".join(f"{x:.1f}" for x in tp_plain))
    print("steered   tok/s: " + ", ".join(f"{x:.1f}" for x in tp_steered))
    print(f"median unsteered {mp:.1f} tok/s, steered {ms:.1f} tok/s, ratio {ms / mp:.3f}")
    print(f"best   unsteered {bp:.1f} tok/s, steered {bs:.1f} tok/s, ratio {bs / bp:.3f}")
    _micro(hidden, len(hooks) * layers, args.batch)
    _micro_clamp(hidden, 2 * layers + 1, args.batch, max(args.clamps, 1))
    _micro_point(hidden, 2 * layers + 1, args.batch, max(args.clamps, 1))
    # Offline vLLM sometimes hangs at interpreter exit with its engine-core process
    # still up; shut it down explicitly, then leave without running atexit hooks.
    llm.llm_engine.engine_core.shutdown()
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
