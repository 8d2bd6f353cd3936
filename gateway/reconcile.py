"""Latch reconciliation: make Redis latch accounting match what the engines hold.

Needed when an engine restarts (new epoch: its latches are gone) or accounting has
drifted (e.g. a gateway crashed between admission and settlement). For each tenant,
the engines are asked for ``GET /v1/steering/latches?prefix=<tenant>~``;
sync_latches.lua drops Redis entries no engine holds (unless touched within the
grace period: a request may be storing them right now) and returns engine latches
Redis does not know, which are deleted on the engines since their quota room was
already given away.
"""

from __future__ import annotations

import logging
import time

from gateway import keys
from gateway.scripts import Scripts
from gateway.store import Redis
from gateway.upstream import EnginePool, UpstreamResponse
from shared.scoping import scope, tenant_prefix, unscope

log = logging.getLogger("steergate.gateway.reconcile")

GRACE_MS = 30_000


class Reconciler:
    def __init__(
        self, redis: Redis, scripts: Scripts, pool: EnginePool, *, grace_ms: int = GRACE_MS
    ) -> None:
        self.grace_ms = grace_ms
        self.redis = redis
        self.scripts = scripts
        self.pool = pool

    async def tenant(self, tenant_id: str) -> int:
        """Reconcile one tenant; returns how many orphan engine latches were deleted."""
        held: set[str] = set()
        for r in await self.pool.broadcast(
            "GET", f"/v1/steering/latches?prefix={tenant_prefix(tenant_id)}"
        ):
            if not isinstance(r, UpstreamResponse) or r.status != 200:
                return 0  # an engine we cannot see may hold latches: change nothing
            for row in r.json():
                local = unscope(tenant_id, str(row.get("conversation_id", "")))
                if local is not None:
                    held.add(local)
        cutoff = int(time.time() * 1000) - self.grace_ms
        orphans = await self.scripts.sync_latches(
            keys=[keys.latches(tenant_id), keys.latch_info(tenant_id), keys.latch_bytes(tenant_id)],
            args=[cutoff, *sorted(held)],
        )
        for conv in orphans:
            await self.pool.broadcast(
                "DELETE", f"/v1/steering/latches/{scope(tenant_id, str(conv))}"
            )
        return len(orphans)

    async def all(self) -> None:
        try:
            for tenant_id in sorted(await self.redis.smembers(keys.TENANT_INDEX)):
                await self.tenant(tenant_id)
        except Exception as exc:  # background task: log and let the next trigger retry
            log.warning("latch reconciliation failed: %s", type(exc).__name__)
