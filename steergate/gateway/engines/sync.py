"""Engine sync: make an engine's cache a subset of what Redis holds.

Redis is the system of record for vectors and latches; an engine holding *less*
is normal (a cache: the next turn that needs something installs it). An engine
holding *more*, or other content under a name, is repaired here: whatever it holds
that Redis does not (a deleted tenant's state, an evicted latch, a vector that
changed while the engine was away) is deleted on the engine.

Runs for each dirty engine after every poll (restart, recovery, a missed write;
the engine is routed around meanwhile) and for every engine periodically, so the
two converge by construction within ``full_sync_interval_s`` even if a delete was
lost. Entries of single-tenant callers (ids without a tenant scope) are left alone.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

import orjson

from steergate.gateway.engines.client import EngineClient
from steergate.gateway.engines.upstream import Engine
from steergate.gateway.store import key_names as keys
from steergate.gateway.store.connection import Redis, store_errors
from steergate.shared.errors import APIError
from steergate.shared.scoping import SEPARATOR

log = logging.getLogger("steergate.gateway.engine_sync")


def _split(scoped: str) -> tuple[str, str] | None:
    tenant, sep, local = scoped.partition(SEPARATOR)
    return (tenant, local) if sep and tenant and local else None


class EngineSync:
    def __init__(
        self, redis: Redis, engines: EngineClient, *, full_sync_interval_s: float = 30.0
    ) -> None:
        self.redis = redis
        self.engines = engines
        self.full_sync_interval_s = full_sync_interval_s
        self._last_full = 0.0
        #: Figures of the last sync per engine URL (admin view, tests).
        self.last: dict[str, dict[str, int]] = {}

    async def sync(self, engine: Engine, tenant_id: str | None = None) -> bool:
        """One pass over ``engine`` (only ``tenant_id``'s entries if given). A full pass
        that repaired everything clears ``engine.dirty``; a failed one sets it, so the
        engine is synced again once it answers."""
        try:
            vectors = await self.engines.list_vectors(engine, tenant_id)
            latches = await self.engines.list_latches(engine, tenant_id)
        except APIError:
            engine.dirty = True
            return False
        by_tenant: dict[str, dict[str, list[tuple[str, str, str]]]] = defaultdict(
            lambda: {"vector": [], "latch": []}
        )
        for row in vectors:
            parts = _split(str(row.get("name", "")))
            if parts:
                by_tenant[parts[0]]["vector"].append(
                    (parts[1], str(row.get("digest", "")), row["name"])
                )
        for row in latches:
            parts = _split(str(row.get("conversation_id", "")))
            if parts:
                by_tenant[parts[0]]["latch"].append(
                    (parts[1], str(row.get("digest", "")), row["conversation_id"])
                )
        deleted = failed = 0
        for owner, held in by_tenant.items():
            for kind, scoped in await self._extra(owner, held):
                if await self.engines.delete_engine_entry(engine, kind, scoped):
                    deleted += 1
                else:
                    failed += 1
        self.last[engine.shown] = {
            "vectors": len(vectors),
            "latches": len(latches),
            "deleted": deleted,
            "failed": failed,
        }
        if deleted:
            log.info("engine %s synced: %d stale entries deleted", engine.shown, deleted)
        if failed:
            engine.dirty = True
        elif tenant_id is None:
            engine.dirty = False
        return failed == 0

    async def sync_tenant(self, tenant_id: str) -> None:
        """After a tenant is deleted: remove its state from every engine now; an engine
        that is down is dirty and loses the rest in its sync when it is back (it is not
        waited for)."""
        for engine in self.engines.engines:
            if engine.healthy:
                await self.sync(engine, tenant_id)
            else:
                engine.dirty = True

    async def offer_vector(self, tenant_id: str, name: str, body: bytes | None) -> None:
        """Put a vector just written to Redis (``body``: its data; None: deleted) on
        every engine, then read Redis again. Another write to the name (a concurrent
        request, another gateway) may have reached an engine before this one's did,
        leaving the engine with content Redis no longer holds: the write Redis holds now
        is then offered again, until the two agree. At most three rounds: an engine left
        with other content is still never steered by it (every turn tells it the digest
        Redis holds, ``steergate_expect``), only a cache miss later. Never fails: the
        vector is stored whatever the engines do."""
        for _ in range(3):
            if body is None:
                await self.engines.delete_vector_everywhere(tenant_id, name)
            else:
                await self.engines.put_vector_everywhere(tenant_id, name, body)
            try:
                async with store_errors():
                    now = await self.redis.hget(keys.vector_data(tenant_id), name)
            except APIError:
                return  # the engines' copies are checked on every use regardless
            held = now.encode() if isinstance(now, str) else now
            if held == body:
                return
            body = held

    async def _extra(
        self, tenant_id: str, held: dict[str, list[tuple[str, str, str]]]
    ) -> list[tuple[str, str]]:
        """(kind, engine-side id) of what the engine holds for ``tenant_id`` and Redis
        does not hold with the same content."""
        vec_names = [n for n, _, _ in held["vector"]]
        convs = [c for c, _, _ in held["latch"]]
        pipe = self.redis.pipeline(transaction=False)
        pipe.exists(keys.tenant_record(tenant_id))
        pipe.hmget(keys.vectors(tenant_id), vec_names or ["-"])
        pipe.hmget(keys.latch_info(tenant_id), convs or ["-"])
        exists, metas, infos = await pipe.execute()
        extra: list[tuple[str, str]] = []
        for (_, digest, scoped), meta in zip(held["vector"], metas, strict=False):
            current = orjson.loads(meta).get("digest") if (exists and meta) else None
            if current != digest:
                extra.append(("vector", scoped))
        for (_, digest, scoped), info in zip(held["latch"], infos, strict=False):
            if not exists or info is None:
                extra.append(("latch", scoped))
                continue
            recorded = keys.LatchEntry.parse(info).digest
            # No digest yet: the turn storing it has not recorded it; leave it be.
            if recorded and recorded != digest:
                extra.append(("latch", scoped))
        return extra

    async def periodic(self) -> None:
        """Every ``full_sync_interval_s``, sync every healthy engine (called by the poller)."""
        now = time.monotonic()
        if now - self._last_full < self.full_sync_interval_s:
            return
        self._last_full = now
        for engine in self.engines.engines:
            if engine.healthy:
                try:
                    await self.sync(engine)
                except Exception as exc:  # background: the next round retries
                    log.warning("engine sync of %s failed: %s", engine.shown, type(exc).__name__)
