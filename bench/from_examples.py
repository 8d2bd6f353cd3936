"""Time and tokens to make a steering vector from 64 example pairs.

Starts a real redis-server, the real-model engine (SmolLM2-135M-Instruct, float32,
the test suite's settings) and a gateway (in this process, under uvicorn), makes a
tenant, then calls ``POST /v1/steering/vectors/{name}/from-examples`` with 64
positive and 64 negative sentences ``--repeats`` times and prints each run's wall
time, the median and spread, and the tokens the engine reported. Run it under the
engine lock:

    flock /tmp/steergate-engine.lock .venv/bin/python bench/from_examples.py \
        [--pairs 64] [--layers all|8-15] [--method mean_difference|pca] [--repeats 3]
        [--engine-url URL --engine-token TOKEN]   # use a running engine instead
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SEA = ["ocean", "sea", "tide", "reef", "harbor", "beach", "lagoon", "shore"]
TOWN = ["city", "downtown", "subway", "avenue", "office", "suburb", "mall", "parking lot"]
SCENES = [
    "In the morning the {} was quiet and grey.",
    "We walked along the {} until the light faded.",
    "Everyone talked about the {} all summer long.",
    "The old photograph showed the {} before the storm.",
    "She painted the {} from her window every day.",
    "A long road led from the farm to the {}.",
    "Tourists crowded the {} on the first warm weekend.",
    "He remembered the sound of the {} at night.",
]


def sentences(places: list[str], n: int) -> list[str]:
    pairs = itertools.cycle(itertools.product(SCENES, places))
    return [scene.format(place) for scene, place in itertools.islice(pairs, n)]


def parse_layers(text: str) -> list[int] | str:
    if text == "all":
        return "all"
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--layers", type=parse_layers, default="all")
    ap.add_argument("--method", default="mean_difference")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine-url")
    ap.add_argument("--engine-token")
    args = ap.parse_args()

    from steergate.gateway.app import create_app
    from tests.gateway.conftest import gateway_settings, make_tenant
    from tests.gateway.servers import ServerThread
    from tests.harness import (
        REAL_ENGINE_ARGS,
        REAL_ENGINE_ENV,
        EngineProcess,
        RedisProcess,
        real_model_dir,
    )

    redis = RedisProcess().start()
    engine = None
    if args.engine_url:
        url, token = args.engine_url, args.engine_token or ""
    else:
        print("starting the real-model engine (minutes on a busy machine)...", flush=True)
        engine = EngineProcess(
            real_model_dir(), env=dict(REAL_ENGINE_ENV), extra_args=list(REAL_ENGINE_ARGS)
        ).start()
        url, token = engine.url, engine.token
    gw = ServerThread(create_app(gateway_settings(redis.url, url, engine_token=token))).start()
    try:
        key = make_tenant(redis.url, "bench", tpm=10_000_000)
        body = {
            "layers": args.layers,
            "method": args.method,
            "positive": sentences(SEA, args.pairs),
            "negative": sentences(TOWN, args.pairs),
        }
        times, tokens = [], 0
        for i in range(args.repeats):
            t0 = time.perf_counter()
            r = httpx.post(
                f"{gw.url}/v1/steering/vectors/bench-{i}/from-examples",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
                timeout=1800,
            )
            times.append(time.perf_counter() - t0)
            if r.status_code != 201:
                print(f"run {i}: {r.status_code} {r.text[:300]}")
                return 1
            report = r.json()["report"]
            tokens = report["usage"]["total_tokens"]
            layers = report["layers"]
            print(
                f"run {i}: {times[-1]:.2f} s, {tokens} tokens "
                f"({report['examples']['positive_tokens']} positive prompt, "
                f"{report['examples']['negative_tokens']} negative prompt), {len(layers)} layers"
            )
        med = statistics.median(times)
        print(
            f"{args.pairs} pairs, layers {args.layers}, {args.method}: median {med:.2f} s "
            f"(min {min(times):.2f}, max {max(times):.2f}, n={len(times)}); "
            f"{tokens} tokens; {tokens / med:.0f} tokens/s"
        )
    finally:
        gw.stop()
        if engine is not None:
            engine.stop()
        redis.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
