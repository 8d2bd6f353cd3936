"""Issue 9, item 3, as the attack: a tenant floods the gateway with invalid 6 MB steering
bodies, and the other tenant's requests keep being answered while the flood runs.

Since issue 23 a body over 256 KiB is parsed and its steering validated in a worker
process, one at a time per tenant, *before* admission (docs/gateway.md, "Large bodies"):
an invalid one is a 400 that spends none of the tenant's limits, and the parses of one
tenant queue behind each other, not in front of another tenant's requests."""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson
import pytest

from steergate.gateway.store import key_names as keys
from tests.gateway.conftest import make_tenant
from tests.gateway.servers import ServerThread
from tests.harness import redis_client

CHAT = "/v1/chat/completions"


def poison(n_values: int = 1_200_000) -> bytes:
    """~6 MB: one inline term whose vector has the wrong length (a 400 once parsed)."""
    return orjson.dumps(
        {
            "model": "stub",
            "messages": [{"role": "user", "content": "hi"}],
            "steering": {"vectors": [{"hook": "post_block", "layers": {"1": [0.25] * n_values}}]},
        }
    )


@pytest.mark.timed
def test_invalid_big_bodies_are_refused_before_admission_and_do_not_stall_others(
    gateway: ServerThread, redis_url: str
) -> None:
    attacker = make_tenant(redis_url, "attacker", rpm=4)
    victim = make_tenant(redis_url, "victim", rpm=100_000, max_concurrency=64)
    body = poison()
    assert len(body) > 5_000_000

    async def attack() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as c:
            out = []
            for _ in range(12):
                r = await c.post(
                    gateway.url + CHAT,
                    content=body,
                    headers={
                        "Authorization": f"Bearer {attacker}",
                        "content-type": "application/json",
                    },
                )
                out.append(r.status_code)
            return out

    async def observe(stop: asyncio.Event) -> list[float]:
        latencies = []
        async with httpx.AsyncClient(timeout=60) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                r = await c.post(
                    gateway.url + CHAT,
                    json={"model": "stub", "messages": [{"role": "user", "content": "hi"}]},
                    headers={"Authorization": f"Bearer {victim}"},
                )
                assert r.status_code == 200
                latencies.append(time.perf_counter() - t0)
        return latencies

    async def both() -> tuple[list[int], list[float]]:
        stop = asyncio.Event()
        watcher = asyncio.create_task(observe(stop))
        codes = await attack()
        stop.set()
        return codes, await watcher

    codes, latencies = asyncio.run(both())
    # every one refused by the worker's validation, none admitted or counted
    assert codes == [400] * 12, codes
    store = redis_client(redis_url)
    usage = store.hgetall(keys.usage_total("attacker"))
    assert int(usage.get("requests", 0)) == 0 and int(usage.get("429", 0)) == 0
    # the victim was served throughout; no request of its waited behind a parse
    # (before the fix, each poison body held the event loop for seconds)
    assert len(latencies) >= 5
    print(f"victim: {len(latencies)} requests, max {max(latencies) * 1000:.0f} ms")
    assert max(latencies) < 1.0
