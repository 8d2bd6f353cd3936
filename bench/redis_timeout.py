"""How long an admission's Redis call takes on a busy machine: the figures behind
``STEERGATE_REDIS_TIMEOUT_S`` (docs/operations.md, "Recovery bounds").

Starts a real redis-server and N CPU burners (busy loops, one process each, at normal
priority: a load average of about N), then fires bursts of concurrent admissions
(admit_request.lua through the gateway's own client and Limiter) from one event loop,
each coroutine also spending ``--work-us`` of CPU on that loop before and after its
call, as a gateway's request handling does. It prints, per load, the latency
percentiles of the Redis call as the gateway sees it (send to reply, event-loop
delays included) and how many calls a given timeout would have turned into 503s.

    .venv/bin/python bench/redis_timeout.py [--loads 0,4,8,16] [--burst 200] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

THRESHOLDS_S = (0.25, 0.5, 1.0, 2.0)


def _burn() -> None:
    while True:
        pass


def _spin(us: int) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


async def _measure(url: str, burst: int, seconds: float, work_us: int) -> list[float]:
    from steergate.gateway.admission.limits import Limiter
    from steergate.gateway.store.connection import connect
    from steergate.gateway.store.scripts import Scripts
    from steergate.gateway.tenancy.records import Limits, Tenant

    redis = connect(url, timeout_s=30.0)  # measure, never time out
    limiter = Limiter(Scripts.load(redis))
    tenant = Tenant(
        id="bench", name="bench", limits=Limits(rpm=10**9, tpm=10**12, max_concurrency=100_000)
    )
    samples: list[float] = []

    async def one() -> None:
        _spin(work_us)
        t0 = time.perf_counter()
        await limiter.admit(
            tenant, tokens=10, conversation_id=None, latch=False, latch_bytes=0, latch_kind="ref"
        )
        samples.append(time.perf_counter() - t0)
        _spin(work_us)

    await one()  # load the script
    samples.clear()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        await asyncio.gather(*(one() for _ in range(burst)))
    await redis.aclose()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loads", default="0,4,8,16")
    parser.add_argument("--burst", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--work-us", type=int, default=300)
    args = parser.parse_args()

    from tests.harness import RedisProcess

    server = RedisProcess().start()
    print(f"cpus={os.cpu_count()} burst={args.burst} work_us={args.work_us}")
    head = " ".join(f">{t:g}s" for t in THRESHOLDS_S)
    print(
        f"{'burners':>7} {'calls':>6} {'p50ms':>7} {'p99ms':>7} {'p999ms':>7} {'maxms':>7}  {head}"
    )
    try:
        for n in (int(x) for x in args.loads.split(",")):
            burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(n)]
            for b in burners:
                b.start()
            try:
                lat = sorted(
                    asyncio.run(_measure(server.url, args.burst, args.seconds, args.work_us))
                )
            finally:
                for b in burners:
                    b.kill()
                    b.join()
            q = statistics.quantiles(lat, n=1000)
            over = " ".join(
                f"{sum(1 for x in lat if x > t):>{len(f'>{t:g}s')}}" for t in THRESHOLDS_S
            )
            print(
                f"{n:>7} {len(lat):>6} {q[499] * 1e3:>7.1f} {q[989] * 1e3:>7.1f} "
                f"{q[998] * 1e3:>7.1f} {lat[-1] * 1e3:>7.1f}  {over}"
            )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
