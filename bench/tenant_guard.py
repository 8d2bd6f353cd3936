"""Redis time of the tenant generation guard (``store/lua/prelude/tenant_generation.lua``).

Runs admit_request.lua on a real redis-server (started here) as the gateway loads it,
behind the prelude, and its body alone, N admissions each, and prints Redis's own time
per call (``INFO commandstats``, usec_per_call): what the guard adds to every admission
and settlement, outside any client or network noise.

    .venv/bin/python bench/tenant_guard.py [--calls 3000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis.asyncio as aioredis  # noqa: E402

from steergate.gateway.store import key_names as keys  # noqa: E402
from steergate.gateway.store.scripts import AdmitRequest, lua_source, script_text, wire  # noqa: E402
from steergate.gateway.tenancy.records import Limits, Tenant  # noqa: E402
from tests.harness import RedisProcess  # noqa: E402


def admission(tenant: Tenant, i: int) -> AdmitRequest:
    now = int(time.time() * 1000)
    return AdmitRequest(
        tenant_id=tenant.id, generation=tenant.created_at, now_ms=now,
        limits=Limits(rpm=10**6, tpm=10**6, max_concurrency=100_000), cost=1,
        lease_id=f"lease-{i}", lease_expiry_ms=now + 30_000, conversation_id="",
        store_latch=False, latch_bytes=0, latch_kind="ref", deadline_ms=0,
        pending_horizon_ms=1000, key_id="k", key_rpm=0, key_concurrency=0, budget_left_ms=0,
    )  # fmt: skip


async def usec_per_call(
    r: aioredis.Redis, text: str, tenant: Tenant, calls: int, guard: bool
) -> float:
    script = r.register_script(text)
    await r.delete(keys.leases(tenant.id))
    await script(*wire(admission(tenant, -1)))  # loaded before the count starts
    await r.config_resetstat()
    for i in range(calls):
        ks, args = wire(admission(tenant, i))
        if not guard:
            ks, args = ks[:-1], args[:-1]
        await script(keys=ks, args=args)
    stats = (await r.info("commandstats"))["cmdstat_evalsha"]
    return float(stats["usec_per_call"])


async def main(calls: int, rounds: int) -> None:
    proc = RedisProcess().start()
    try:
        r = aioredis.Redis(port=proc.port, decode_responses=True)
        tenant = Tenant(id="bench", name="a tenant with a name of ordinary length")
        await r.set(keys.tenant_record(tenant.id), tenant.record())
        # The script as loaded, less the tenant generation check.
        unguarded = "\n".join(map(lua_source, (*AdmitRequest.preludes, AdmitRequest.script)))
        for n in range(rounds):
            bare = await usec_per_call(r, unguarded, tenant, calls, False)
            guarded = await usec_per_call(r, script_text(AdmitRequest), tenant, calls, True)
            print(
                f"round {n + 1}: admit_request.lua {bare:.2f} us/call bare, "
                f"{guarded:.2f} us/call behind the prelude (+{guarded - bare:.2f})"
            )
        await r.aclose()
    finally:
        proc.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    asyncio.run(main(a.calls, a.rounds))
