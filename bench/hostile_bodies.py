"""Hostile steering bodies: what one tenant's maximal invalid bodies cost another tenant.

Starts a real redis-server, the stub engine (the real endpoint plugin in front of a
stub of vLLM, tests/gateway/stub_engine.py) and ``steergate gateway`` in its own
process. Each round: tenant B probes ``GET /v1/usage`` and a small steered chat for
``--seconds`` (quiet), then again while tenant A (max_concurrency 2, its own process,
4 senders) posts 7.8 MB hostile bodies back to back (tests/gateway/hostile_load.py:
inline arrays of 1.3 M numbers and packed base64, each invalid at its very end).
Prints B's p50/p95/max per round and the spread of p95 over rounds, then what the
parsing steps cost in this process (orjson of each body, the element checks).

    .venv/bin/python bench/hostile_bodies.py [--rounds 3] [--seconds 8]
        [--workers 2] [--tree PATH] [--kind chat|vector]

``--workers 0`` parses large bodies on the gateway's event loop (the setting
``STEERGATE_BODY_PARSE_WORKERS``); ``--tree /path/to/other/checkout`` runs that
checkout's gateway (e.g. the code before the fix) against the same load;
``--kind vector`` sends the same bodies as vector uploads instead of chat steering.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def start_gateway(tree: Path, env: dict[str, str], port: int) -> subprocess.Popen[bytes]:
    """``steergate gateway`` run from ``tree`` (``python -m`` imports from its cwd)."""
    return subprocess.Popen(
        [sys.executable, "-m", "steergate.cli", "gateway", "--port", str(port)],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree), **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def parse_costs() -> None:
    """The steps of one hostile body, timed here (median of 5, min–max)."""
    import orjson

    from steergate.shared.steering import inline_vector
    from tests.gateway.hostile_load import inline_body, packed_body

    def timed(f: object, n: int = 5) -> str:
        xs = []
        for _ in range(n):
            t0 = time.perf_counter()
            f()  # type: ignore[operator]
            xs.append((time.perf_counter() - t0) * 1000)
        return f"{statistics.median(xs):.1f} ms ({min(xs):.1f}–{max(xs):.1f})"

    inline, packed = inline_body(), packed_body()
    values = orjson.loads(inline)["steering"]["vectors"][0]["layers"]["1"][:-1]

    def per_element() -> bool:  # the check this issue replaced
        return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)

    print(f"orjson.loads inline body ({len(inline) / 1e6:.1f} MB, {len(values):,} numbers): "
          f"{timed(lambda: orjson.loads(inline))}")  # fmt: skip
    print(f"orjson.loads packed body ({len(packed) / 1e6:.1f} MB): "
          f"{timed(lambda: orjson.loads(packed))}")  # fmt: skip
    print(f"per-element isinstance check (before): {timed(per_element)}")
    print(f"inline_vector (set(map(type)) + numpy, after): "
          f"{timed(lambda: inline_vector(values, 'p'))}")  # fmt: skip
    budget = values[:65536]
    print(f"inline_vector at the default request budget (65,536 numbers): "
          f"{timed(lambda: inline_vector(budget, 'p'))}")  # fmt: skip
    small = orjson.dumps({"steering": {"vectors": [{"layers": {"0": budget}}]}})
    print(f"orjson.loads of that budget as JSON ({len(small) / 1e6:.2f} MB): "
          f"{timed(lambda: orjson.loads(small))}")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--workers", type=int, default=2, help="STEERGATE_BODY_PARSE_WORKERS")
    ap.add_argument("--tree", type=Path, default=ROOT, help="checkout whose gateway runs")
    ap.add_argument(
        "--kind", choices=("chat", "vector"), default="chat", help="chat steering or vector PUTs"
    )
    args = ap.parse_args()

    from tests.gateway.conftest import ADMIN_KEY, ENGINE_TOKEN, PEPPER, start_stub_engine
    from tests.gateway.hostile_load import p95, probe, summary, under_attack
    from tests.harness import RedisProcess, free_port, wait_for

    redis = RedisProcess().start()
    engine = start_stub_engine()
    port = free_port()
    env = {
        "REDIS_URL": redis.url,
        "STEERGATE_ENGINE_URLS": engine.url,
        "STEERGATE_ENGINE_TOKEN": ENGINE_TOKEN,
        "STEERGATE_ADMIN_KEY": ADMIN_KEY,
        "STEERGATE_KEY_PEPPER": PEPPER,
        "STEERGATE_BODY_PARSE_WORKERS": str(args.workers),
    }
    gw = start_gateway(args.tree.resolve(), env, port)
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        def up() -> bool:
            try:
                return httpx.get(url + "/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 60)
        from tests.gateway.conftest import make_tenant

        key_a = make_tenant(redis.url, "attacker", max_concurrency=2)
        key_b = make_tenant(redis.url, "bystander", rpm=100_000)
        print(f"gateway from {args.tree.resolve()}, body parse workers {args.workers}, "
              f"attack: {args.kind}; "
              f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")  # fmt: skip
        quiet95, loud95 = [], []
        for i in range(args.rounds):
            quiet = probe(url, key_b, args.seconds - 1.5)
            loud, codes = under_attack(url, key_a, key_b, args.seconds, args.kind)
            quiet95.append(p95(quiet.all))
            loud95.append(p95(loud.all))
            print(f"round {i + 1}: " + summary("B quiet", quiet.all))
            print("         " + summary("B attacked", loud.all))
            print(f"         A's answers {codes}")
        print(
            f"B p95 quiet: median {statistics.median(quiet95):.1f} ms "
            f"(min {min(quiet95):.1f}, max {max(quiet95):.1f}); attacked: median "
            f"{statistics.median(loud95):.1f} ms (min {min(loud95):.1f}, max {max(loud95):.1f}); "
            f"load now {os.getloadavg()[0]:.2f}"
        )
        parse_costs()
    finally:
        gw.terminate()
        gw.wait(10)
        engine.server.stop()
        redis.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
