"""What activation capture costs: requests without ``capture``, and the capture itself.

Two measurements (issue 19, "capture's cost on an unsteered batch"):

1. **The op alone** (no vLLM): every decoder layer calls ``steergate::capture`` at its
   three sites on every forward, whether or not a request captures. Timed per forward
   for ``--layers`` layers with no capture state, and with a state whose step plan is
   empty (what every step without a capturing request sees), next to the steering op's
   idle cost for scale.
2. **End to end** (``vllm.LLM`` offline, the steergate plugin loaded, a generated Llama
   or ``--model``): decode throughput of ``--batch`` unsteered requests without capture,
   against the same batch where one request also captures every site of its prompt
   (``reduce: mean``), runs interleaved, medians and spread printed.

    VLLM_CPU_KVCACHE_SPACE=2 .venv/bin/python bench/capture_overhead.py --repeats 5
    .venv/bin/python bench/capture_overhead.py --micro-only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOOKS = ("pre_attn", "post_attn", "post_block")


def _micro(hidden: int, layers: int, tokens: int, iters: int = 2000) -> None:
    import torch

    from steergate.engine.worker import capture, op

    sites = 3 * layers
    hidden_states = torch.zeros(tokens, hidden)
    residual = torch.zeros(tokens, hidden)
    table = torch.zeros(tokens + 1, hidden)
    index = torch.zeros(tokens, dtype=torch.int64)

    def per_forward(call: object) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(iters):
                for layer in range(layers):
                    for hook in HOOKS:
                        call(layer, hook)  # type: ignore[operator]
            best = min(best, (time.perf_counter() - t0) / iters * 1e6)
        return best

    capture.install_state(None)
    no_state = per_forward(lambda layer, hook: capture.read(hidden_states, residual, hook, layer))
    capture.install_state(capture.CaptureState(frozenset(range(layers)), hidden, True))
    empty_plan = per_forward(lambda layer, hook: capture.read(hidden_states, residual, hook,
                                                              layer))
    capture.install_state(None)
    steer_idle = per_forward(lambda layer, hook: op.apply(hidden_states, table, index))
    print(f"capture op, {sites} sites per forward ({layers} layers x 3), {tokens} tokens x "
          f"{hidden}: no state {no_state:.0f} us, empty step plan {empty_plan:.0f} us "
          f"(the steering op idle at the same sites: {steer_idle:.0f} us)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--model", help="use this model folder instead of generating one")
    ap.add_argument("--micro-only", action="store_true", help="only the op alone (no vLLM)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.micro_only:
        _micro(args.hidden, args.layers, args.batch)
        return 0

    capture_dir = tempfile.TemporaryDirectory(prefix="sg-capture-bench-")
    os.environ["STEERGATE_CAPTURE_DIR"] = capture_dir.name
    from bench.offline import offline_llm, shape, token_prompts
    from steergate.engine import capture_io

    llm, tmp = offline_llm(args.model, args.hidden, args.layers, args.batch)
    from vllm import SamplingParams

    cfg = llm.llm_engine.vllm_config.model_config
    hidden, layers = shape(llm)
    prompts = token_prompts(args.batch, args.prompt_tokens)
    sites = [(hook, layer) for layer in range(layers) for hook in HOOKS]

    def params(extra: dict[str, str] | None) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                              extra_args=extra)

    plain = [params(None) for _ in range(args.batch)]

    def with_capture() -> list[SamplingParams]:
        cid = capture_io.new_capture_id()
        payload = capture_io.encode_payload(cid, sites, "prompt", "mean")
        return [params({capture_io.XARGS_KEY: payload})] + plain[1:]

    def run(sp: list[SamplingParams]) -> float:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        assert sum(len(o.outputs[0].token_ids) for o in outs) == args.batch * args.max_tokens
        return args.batch * args.max_tokens / dt

    # Sanity: the capture really happens (else the figures mean nothing).
    sp = with_capture()
    llm.generate(prompts[:1], sp[:1], use_tqdm=False)
    cid = capture_io.decode_payload(sp[0].extra_args[capture_io.XARGS_KEY]).cid
    got = capture_io.collect(cid, Path(capture_dir.name))
    rows = sum(len(v) for v in got.values())
    print(f"capture reached the workers: {rows} site results for one request")

    run(plain), run(with_capture())  # warm-up
    tp_plain: list[float] = []
    tp_capture: list[float] = []
    for i in range(args.repeats):
        order = [(tp_plain, lambda: plain), (tp_capture, with_capture)]
        for bucket, make in (order if i % 2 == 0 else order[::-1]):
            bucket.append(run(make()))
        for path in Path(capture_dir.name).glob("*"):  # the API server's job, offline ours
            path.unlink()
    mp, mc = statistics.median(tp_plain), statistics.median(tp_capture)
    print(f"model: hidden {hidden}, {layers} layers, dtype {cfg.dtype}; batch {args.batch}, "
          f"prompt {args.prompt_tokens} tokens, {args.max_tokens} new tokens")
    print("no capture          tok/s: " + ", ".join(f"{x:.1f}" for x in tp_plain))
    print("one request captures tok/s: " + ", ".join(f"{x:.1f}" for x in tp_capture))
    print(f"median no capture {mp:.1f} tok/s (spread {min(tp_plain):.1f}-{max(tp_plain):.1f}), "
          f"one capturing {mc:.1f} tok/s (spread {min(tp_capture):.1f}-{max(tp_capture):.1f}), "
          f"ratio {mc / mp:.3f}")
    _micro(hidden, layers, args.batch)
    llm.llm_engine.engine_core.shutdown()
    tmp.cleanup()
    capture_dir.cleanup()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
