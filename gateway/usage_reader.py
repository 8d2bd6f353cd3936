"""Read-side of usage accounting, for ``/v1/usage``, ``/admin/usage`` and the dashboard.

Everything a tenant's usage page needs in one call per tenant (a pipeline of reads
on that tenant's slot): limits, current rates, concurrency, latches, vectors,
status counts and a per-minute history.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from gateway import keys
from gateway.store import Redis, store_errors
from gateway.tenants import Tenant

FIELDS = ("requests", "tokens", "2xx", "4xx", "429", "5xx")


class UsageReader:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def tenant(self, tenant: Tenant, minutes: int = 60) -> dict[str, Any]:
        now = time.time()
        now_ms = int(now * 1000)
        minute = int(now) // 60
        t = tenant.id
        async with store_errors():
            pipe = self.redis.pipeline(transaction=False)
            pipe.zcount(keys.leases(t), now_ms, "+inf")
            pipe.zcard(keys.latches(t))
            pipe.get(keys.latch_bytes(t))
            pipe.hvals(keys.vectors(t))
            pipe.hgetall(keys.usage_total(t))
            for m in range(minute - minutes + 1, minute + 1):
                pipe.hgetall(keys.usage_minute(t, m))
            res = await pipe.execute()
        inflight, latch_count, latch_bytes, vector_rows, total = res[:5]
        history = [
            {"minute": (minute - minutes + 1 + i) * 60, **{f: int(row.get(f, 0)) for f in FIELDS}}
            for i, row in enumerate(res[5:])
        ]
        current = history[-1]
        vec_bytes = sum(int(orjson.loads(v).get("bytes", 0)) for v in vector_rows)
        lim = tenant.limits
        return {
            "tenant": t,
            "limits": lim.model_dump(),
            "requests_per_min": {"limit": lim.rpm, "used": current["requests"]},
            "tokens_per_min": {"limit": lim.tpm, "used": current["tokens"]},
            "concurrency": {"limit": lim.max_concurrency, "in_flight": int(inflight)},
            "latches": {
                "count": int(latch_count),
                "bytes": int(latch_bytes or 0),
                "limit_count": lim.latch_count,
                "limit_bytes": lim.latch_bytes,
            },
            "vectors": {
                "count": len(vector_rows),
                "bytes": vec_bytes,
                "limit_count": lim.vector_count,
                "limit_bytes": lim.vector_bytes,
            },
            "status_counts": {f: int(total.get(f, 0)) for f in ("2xx", "4xx", "429", "5xx")},
            "totals": {f: int(total.get(f, 0)) for f in FIELDS},
            "history": history,
        }
