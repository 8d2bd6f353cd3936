"""Usage exports against everyone else: what a tenant's large exports cost the other
tenants of the same gateway process.

Starts a real redis-server, the fast mock engine of ``gateway_overhead.py`` and the
gateway (``steergate gateway``, its own process). Tenant ``heavy`` has 400 days of
rollups with traffic from 10 API keys each day (the most an export reads: 400 day hashes
of 88 fields, ~35k fields). Then, at concurrency 1, tenant ``bench``'s chat requests:
  * alone,
  * while ``heavy`` runs ``--exporters`` loops of ``GET /v1/usage/export?group_by=key``
    over the whole 400 days (JSON and CSV alternating),
and prints ``bench``'s latency p50 / p99 / max in both phases and the exports' own time.

    .venv/bin/python bench/usage_export.py [--requests 1500] [--exporters 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gateway_overhead import (  # noqa: E402 - the bench directory is put on the path above
    CHAT,
    RawClient,
    pct,
    start_gateway,
    tenant_in_redis,
)

DAYS = 400
KEYS = 10
FIELDS = ("requests", "tokens", "prompt_tokens", "completion_tokens", "2xx", "4xx", "429", "5xx")


def seed_heavy(redis_url: str) -> str:
    """Tenant ``heavy``, a key for it, and ``DAYS`` of rollups with ``KEYS`` keys a day."""
    import redis.asyncio as aioredis

    from steergate.gateway.store import key_names as keys
    from steergate.gateway.tenancy.tenants import TenantStore

    async def go() -> str:
        client = aioredis.Redis.from_url(redis_url, decode_responses=True)
        store = TenantStore(client, "bench-pepper")
        limits = {"rpm": 10**9, "tpm": 10**12, "max_concurrency": 10**4}
        await store.create("heavy", limits=limits, allow_overcommit=True)
        key = (await store.create_key("heavy"))[1]
        today = int(time.time() // 86400)
        pipe = client.pipeline(transaction=False)
        for day in range(today - DAYS + 1, today + 1):
            fields: dict[str, int] = {}
            for f in FIELDS:
                fields[f] = 100
                for k in range(KEYS):
                    fields[f"{keys.ROLLUP_KEY_PREFIX}key_{k:016x}:{f}"] = 10
            pipe.hset(keys.usage_day("heavy", day), mapping=fields)
        await pipe.execute()
        await client.aclose()
        return str(key)

    return asyncio.run(go())


async def victim(port: int, key: str, n: int) -> list[float]:
    c = RawClient(port, CHAT, {"Authorization": f"Bearer {key}"})
    for _ in range(50):
        await c.call()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        assert await c.call() == 200
        out.append((time.perf_counter() - t0) * 1000)
    c.close()
    return out


async def with_exports(
    port: int, key: str, heavy_key: str, n: int, exporters: int
) -> tuple[list[float], list[float]]:
    stop = asyncio.Event()
    took: list[float] = []
    today = time.strftime("%Y-%m-%d", time.gmtime())
    first = time.strftime("%Y-%m-%d", time.gmtime(time.time() - (DAYS - 1) * 86400))

    async def exporter(i: int) -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            j = 0
            while not stop.is_set():
                fmt = "json" if (i + j) % 2 == 0 else "csv"
                t0 = time.perf_counter()
                r = await client.get(
                    f"http://127.0.0.1:{port}/v1/usage/export",
                    params={"start": first, "end": today, "group_by": "key", "format": fmt},
                    headers={"Authorization": f"Bearer {heavy_key}"},
                )
                assert r.status_code == 200, r.text
                took.append((time.perf_counter() - t0) * 1000)
                j += 1

    tasks = [asyncio.create_task(exporter(i)) for i in range(exporters)]
    await asyncio.sleep(1.0)  # the exports are under way
    lat = await victim(port, key, n)
    stop.set()
    await asyncio.gather(*tasks)
    return lat, took


def line(name: str, values: list[float]) -> str:
    return (
        f"{name:<28} p50 {statistics.median(values):8.2f} ms  p99 {pct(values, 99):8.2f} ms  "
        f"max {max(values):8.2f} ms  (n={len(values)})"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--exporters", type=int, default=4)
    args = ap.parse_args()

    from tests.harness import RedisProcess, free_port, wait_port

    mock_port = free_port()
    mock = subprocess.Popen(
        [
            sys.executable, "-m", "uvicorn", "bench.gateway_overhead:mock_app",
            "--port", str(mock_port), "--log-level", "warning", "--no-access-log",
        ],
        cwd=ROOT,
    )  # fmt: skip
    redis_proc = RedisProcess().start()
    gw_port = free_port()
    gw = start_gateway(gw_port, mock_port, redis_proc.url)
    try:
        assert wait_port(mock_port, 20) and wait_port(gw_port, 30), "servers did not start"
        key = tenant_in_redis(redis_proc.url)
        heavy_key = seed_heavy(redis_proc.url)
        alone = asyncio.run(victim(gw_port, key, args.requests))
        during, took = asyncio.run(
            with_exports(gw_port, key, heavy_key, args.requests, args.exporters)
        )
        print(f"tenant 'heavy': {DAYS} days x {KEYS} keys of rollups; "
              f"{args.exporters} export loops (group_by=key, JSON/CSV)")  # fmt: skip
        print(line("bench chat, alone", alone))
        print(line("bench chat, during exports", during))
        print(line("heavy's exports", took))
    finally:
        gw.terminate()
        mock.terminate()
        gw.wait(10)
        mock.wait(10)
        redis_proc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
