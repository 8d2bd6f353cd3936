"""Tenants, their limits and API keys, stored in Redis; and the local auth cache.

Every gateway replica caches key -> tenant for speed (an ordinary request then
resolves its key with no Redis call). Revocations, limit changes and deletes are
published on ``keys.EVENTS_CHANNEL``; every replica drops the affected entries as
the message arrives (well under 1 s), and clears the whole cache whenever its
subscription (re)connects, because messages sent while it was away are lost.
A TTL bounds staleness even if pub/sub were silently broken.

Default limits (``Limits()``) are sized so that 16 default tenants exactly fill an
engine with the contract's default caps (1024 latches, 256 MiB): 64 latches and
16 MiB of latches each. Requests: 600/min, 200k tokens/min, 16 in flight;
vectors: 100 named vectors, 64 MiB.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from gateway import apikeys, keys
from gateway.store import Redis, is_cluster, store_errors
from shared.errors import APIError
from shared.scoping import check_tenant_id

log = logging.getLogger("steergate.gateway.tenants")

DEFAULT_ENGINE_CAPS = (1024, 268435456)
_BIG = 10**15  # keeps every limit an exact integer inside Lua's doubles


class Limits(BaseModel):
    """A tenant's limits. Zero latch/vector quotas disable latching / named vectors."""

    model_config = ConfigDict(extra="forbid")

    rpm: int = Field(default=600, ge=1, le=_BIG, description="Requests per minute (GCRA).")
    tpm: int = Field(default=200_000, ge=1, le=_BIG, description="Tokens per minute (GCRA).")
    max_concurrency: int = Field(default=16, ge=1, le=100_000, description="Requests in flight.")
    latch_count: int = Field(default=64, ge=0, le=_BIG, description="Latched conversations.")
    latch_bytes: int = Field(default=16 * 2**20, ge=0, le=_BIG, description="Bytes of latches.")
    vector_count: int = Field(default=100, ge=0, le=_BIG, description="Named vectors.")
    vector_bytes: int = Field(
        default=64 * 2**20, ge=0, le=_BIG, description="Bytes of named vectors."
    )
    latch_policy: Literal["evict_oldest", "reject"] = Field(
        default="evict_oldest", description="Over the latch quota: evict own LRU latches, or 429."
    )
    token_budget: TokenBudget | None = Field(
        default=None,
        description="Tokens (prompt + completion) per UTC day or month; past it, 429 "
        "budget_exceeded until the period rolls over. None: no budget.",
    )


class TokenBudget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: int = Field(ge=1, le=_BIG, description="Tokens per period.")
    period: Literal["day", "month"] = Field(description="UTC day or UTC calendar month.")


Limits.model_rebuild()


class Tenant(BaseModel):
    """A tenant. ``cache_salt`` is secret: excluded from every dump the API returns."""

    id: str
    name: str = ""
    limits: Limits = Field(default_factory=Limits)
    allow_overcommit: bool = False
    created_at: float = Field(default_factory=time.time)
    cache_salt: SecretStr = Field(
        default_factory=lambda: SecretStr(secrets.token_hex(16)), exclude=True
    )

    def record(self) -> bytes:
        """The stored form (the only one that includes the salt)."""
        doc = self.model_dump()
        doc["cache_salt"] = self.cache_salt.get_secret_value()
        return orjson.dumps(doc)

    @classmethod
    def from_record(cls, raw: str | bytes) -> Tenant:
        return cls.model_validate(orjson.loads(raw))


@dataclass(frozen=True)
class KeyInfo:
    key_id: str
    prefix: str
    created_at: float

    def public(self) -> dict[str, Any]:
        return {"key_id": self.key_id, "prefix": self.prefix, "created_at": self.created_at}


EngineCaps = Callable[[], "tuple[int, int] | None"]
OnTenantDeleted = Callable[[str, list[str], list[str]], Awaitable[None]]


class AuthCache:
    """Replica-local key-hash -> (tenant, key_id) cache with TTL and targeted drops.

    ``generation`` counts invalidations (drops and clears). A resolver reads it
    *before* its Redis lookup and hands it back to ``put``, which stores nothing if
    any invalidation arrived in between: the lookup may have read the key just
    before it was revoked, while the revocation's drop found no entry to remove, and
    storing it then would keep a revoked key alive for the whole TTL. The counter is
    cache-wide rather than per key because invalidations are rare and a skipped
    write costs only one more Redis read."""

    def __init__(self, ttl_s: float = 30.0) -> None:
        self.ttl_s = ttl_s
        self.generation = 0
        self._by_hash: dict[str, tuple[Tenant, str, float]] = {}

    def get(self, key_hash: str) -> Tenant | None:
        hit = self._by_hash.get(key_hash)
        if hit is None:
            return None
        if hit[2] < time.monotonic():
            self._by_hash.pop(key_hash, None)
            return None
        return hit[0]

    def put(self, key_hash: str, tenant: Tenant, key_id: str, generation: int) -> bool:
        """Store the entry unless an invalidation arrived since ``generation`` was
        read (before the lookup that produced it). Returns whether it was stored."""
        if generation != self.generation:
            return False
        self._by_hash[key_hash] = (tenant, key_id, time.monotonic() + self.ttl_s)
        return True

    def drop_key(self, key_id: str) -> None:
        self.generation += 1
        for h in [h for h, (_, kid, _) in self._by_hash.items() if kid == key_id]:
            self._by_hash.pop(h, None)

    def drop_tenant(self, tenant_id: str) -> None:
        self.generation += 1
        for h in [h for h, (t, _, _) in self._by_hash.items() if t.id == tenant_id]:
            self._by_hash.pop(h, None)

    def clear(self) -> None:
        self.generation += 1
        self._by_hash.clear()

    def __len__(self) -> int:
        return len(self._by_hash)


class TenantStore:
    """CRUD for tenants and keys, key resolution, and cache invalidation."""

    def __init__(
        self,
        redis: Redis,
        pepper: str,
        *,
        engine_caps: EngineCaps | None = None,
        on_deleted: OnTenantDeleted | None = None,
        cache_ttl_s: float = 30.0,
        refuse_overcommit: bool = False,
    ) -> None:
        self.redis = redis
        self._pepper = pepper
        self._engine_caps = engine_caps or (lambda: None)
        self.refuse_overcommit = refuse_overcommit
        self.on_deleted = on_deleted
        self.cache = AuthCache(cache_ttl_s)

    # -- tenants ---------------------------------------------------------------

    async def create(
        self,
        tenant_id: str,
        *,
        name: str = "",
        limits: Limits | dict[str, Any] | None = None,
        allow_overcommit: bool = False,
    ) -> Tenant:
        """201-or-409: ids are unique (SET NX); overcommit is checked first."""
        check_tenant_id(tenant_id)
        tenant = Tenant(
            id=tenant_id, name=name, limits=_limits(limits), allow_overcommit=allow_overcommit
        )
        await self._check_overcommit(tenant)
        async with store_errors():
            created = await self.redis.set(keys.tenant_record(tenant_id), tenant.record(), nx=True)
            if not created:
                raise APIError(
                    "tenant_exists", f"tenant '{tenant_id}' already exists", param="id"
                )
            await self.redis.sadd(keys.TENANT_INDEX, tenant_id)
        return tenant

    async def get(self, tenant_id: str) -> Tenant | None:
        async with store_errors():
            raw = await self.redis.get(keys.tenant_record(tenant_id))
        return Tenant.from_record(raw) if raw else None

    async def require(self, tenant_id: str) -> Tenant:
        tenant = await self.get(tenant_id)
        if tenant is None:
            raise APIError("tenant_not_found", f"no tenant '{tenant_id}'", param="id")
        return tenant

    async def list(self) -> list[Tenant]:
        async with store_errors():
            ids = sorted(await self.redis.smembers(keys.TENANT_INDEX))
            pipe = self.redis.pipeline(transaction=False)
            for tid in ids:
                pipe.get(keys.tenant_record(tid))
            raws = await pipe.execute() if ids else []
        return [Tenant.from_record(raw) for raw in raws if raw]

    async def update(self, tenant_id: str, patch: dict[str, Any]) -> Tenant:
        """Apply a partial update: ``name``, ``allow_overcommit``, ``limits`` (partial)."""
        current = await self.require(tenant_id)
        unknown = set(patch) - {"name", "limits", "allow_overcommit"}
        if unknown:
            field = sorted(unknown)[0]
            raise APIError("invalid_request", f"unknown field '{field}'", param=field)
        limits = current.limits.model_dump()
        if patch.get("limits") is not None:
            if not isinstance(patch["limits"], dict):
                raise APIError("invalid_request", "'limits' must be an object", param="limits")
            limits.update(patch["limits"])
        try:
            updated = Tenant(
                id=current.id,
                name=patch["name"] if patch.get("name") is not None else current.name,
                limits=Limits.model_validate(limits),
                allow_overcommit=bool(patch.get("allow_overcommit", current.allow_overcommit)),
                created_at=current.created_at,
                cache_salt=current.cache_salt,
            )
        except ValidationError as exc:
            raise _invalid(exc, "limits") from exc
        await self._check_overcommit(updated)
        async with store_errors():
            await self.redis.set(keys.tenant_record(tenant_id), updated.record(), xx=True)
            await self._publish(f"tenant:{tenant_id}")
        self.cache.drop_tenant(tenant_id)
        return updated

    async def delete(self, tenant_id: str) -> bool:
        """Remove the tenant with its keys, latches, vectors and usage; the engine-side
        latches and vectors go through ``on_deleted`` (wired to the engine pool)."""
        async with store_errors():
            if not await self.redis.exists(keys.tenant_record(tenant_id)):
                return False
            key_rows = await self.redis.hgetall(keys.tenant_keys(tenant_id))
            latch_ids = list(await self.redis.zrange(keys.latches(tenant_id), 0, -1))
            vector_names = list(await self.redis.hkeys(keys.vectors(tenant_id)))
            for row in key_rows.values():
                doc = orjson.loads(row)
                await self.redis.delete(keys.key_lookup(doc["hash"]))
            for key_id in key_rows:
                await self.redis.delete(keys.key_owner(key_id))
            # One slot: every per-tenant key carries the same hash tag.
            await self.redis.delete(*keys.all_tenant_keys(tenant_id, int(time.time()) // 60))
            await self.redis.srem(keys.TENANT_INDEX, tenant_id)
            await self._publish(f"tenant:{tenant_id}")
        self.cache.drop_tenant(tenant_id)
        if self.on_deleted is not None:
            await self.on_deleted(tenant_id, latch_ids, vector_names)
        return True

    # -- keys ------------------------------------------------------------------

    async def create_key(self, tenant_id: str) -> tuple[str, str, str]:
        """(key_id, key, prefix). The raw key exists only in this return value."""
        await self.require(tenant_id)
        key = apikeys.generate_key()
        key_id = apikeys.generate_key_id()
        prefix = apikeys.display_prefix(key)
        key_hash = apikeys.hash_key(self._pepper, key)
        doc = {"prefix": prefix, "created_at": time.time(), "hash": key_hash}
        async with store_errors():
            await self.redis.set(keys.key_lookup(key_hash), f"{tenant_id} {key_id}")
            await self.redis.set(keys.key_owner(key_id), f"{tenant_id} {key_hash}")
            await self.redis.hset(keys.tenant_keys(tenant_id), key_id, orjson.dumps(doc))
        return key_id, key, prefix

    async def list_keys(self, tenant_id: str) -> builtins.list[KeyInfo]:
        await self.require(tenant_id)
        async with store_errors():
            rows = await self.redis.hgetall(keys.tenant_keys(tenant_id))
        out = []
        for key_id, raw in rows.items():
            doc = orjson.loads(raw)
            out.append(KeyInfo(key_id=key_id, prefix=doc["prefix"], created_at=doc["created_at"]))
        return sorted(out, key=lambda k: k.created_at)

    async def revoke_key(self, key_id: str) -> bool:
        async with store_errors():
            owner = await self.redis.get(keys.key_owner(key_id))
            if not owner:
                return False
            tenant_id, key_hash = owner.split(" ", 1)
            await self.redis.delete(keys.key_lookup(key_hash))
            await self.redis.delete(keys.key_owner(key_id))
            await self.redis.hdel(keys.tenant_keys(tenant_id), key_id)
            await self._publish(f"key:{key_id}")
        self.cache.drop_key(key_id)
        return True

    async def resolve_key(self, raw_key: str) -> Tenant | None:
        """The key's tenant, or None. Hot path: a cache hit costs no Redis call."""
        if not apikeys.looks_like_key(raw_key):
            return None
        key_hash = apikeys.hash_key(self._pepper, raw_key)
        cached = self.cache.get(key_hash)
        if cached is not None:
            return cached
        generation = self.cache.generation  # before the read: see AuthCache
        async with store_errors():
            owner = await self.redis.get(keys.key_lookup(key_hash))
            if not owner:
                return None
            tenant_id, key_id = owner.split(" ", 1)
            raw = await self.redis.get(keys.tenant_record(tenant_id))
        if not raw:
            return None
        tenant = Tenant.from_record(raw)
        self.cache.put(key_hash, tenant, key_id, generation)
        return tenant

    # -- invalidation ------------------------------------------------------------

    async def _publish(self, message: str) -> None:
        await self.redis.publish(keys.EVENTS_CHANNEL, message)

    def _on_event(self, message: str) -> None:
        kind, _, ident = message.partition(":")
        if kind == "key":
            self.cache.drop_key(ident)
        elif kind == "tenant":
            self.cache.drop_tenant(ident)

    async def listen_for_invalidations(self, stop: asyncio.Event) -> None:
        """Run until ``stop``: apply invalidation events; on every (re)subscribe clear
        the whole cache, since events published while disconnected are lost."""
        while not stop.is_set():
            pubsub = None
            try:
                if is_cluster(self.redis):
                    # A cluster client routes SUBSCRIBE by the channel's slot, which
                    # needs its slot map (loaded by its first command, or here).
                    await self.redis.initialize()
                pubsub = self.redis.pubsub()
                await pubsub.subscribe(keys.EVENTS_CHANNEL)
                self.cache.clear()
                while not stop.is_set():
                    msg = await pubsub.get_message(timeout=0.2)
                    kind = msg.get("type") if msg else None
                    if kind == "subscribe":
                        # Redis delivers events only from here on; an entry cached from
                        # a read before this point may have missed its revocation.
                        self.cache.clear()
                    elif kind == "message":
                        data = msg["data"]  # type: ignore[index]
                        self._on_event(data.decode() if isinstance(data, bytes) else str(data))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # transport failure: reconnect (clears on resubscribe)
                # Entries stay usable meanwhile: no revocation can happen while Redis is
                # unreachable, and with fail-open set the cached keys keep serving.
                log.warning(
                    "auth invalidation subscription lost (%s); retrying", type(exc).__name__
                )
                if is_cluster(self.redis):  # the node may be gone: reload the slot map
                    with contextlib.suppress(Exception):
                        await self.redis.nodes_manager.initialize()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.25)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        await pubsub.aclose()

    # -- overcommit ----------------------------------------------------------------

    async def _check_overcommit(self, tenant: Tenant) -> None:
        """Only with ``refuse_overcommit`` (STEERGATE_REFUSE_OVERCOMMIT): 409 unless Σ
        latch quotas (this tenant's new limits + every other tenant's) fit the smallest
        engine's caps. Engines are caches of Redis, so overcommit never loses a latch;
        it costs restores (one Redis read and a larger engine request on the turn after
        an engine evicted the latch). Operators who want every latch to stay resident
        refuse it; everyone else sees it as a warning in the capacity view."""
        if tenant.allow_overcommit or not self.refuse_overcommit:
            return
        caps = self._engine_caps() or DEFAULT_ENGINE_CAPS
        others = [t for t in await self.list() if t.id != tenant.id]
        count = tenant.limits.latch_count + sum(t.limits.latch_count for t in others)
        nbytes = tenant.limits.latch_bytes + sum(t.limits.latch_bytes for t in others)
        if count > caps[0] or nbytes > caps[1]:
            raise APIError(
                "engine_overcommitted",
                f"latch quotas would total {count} latches / {nbytes} bytes, above the engine caps "
                f"({caps[0]} latches / {caps[1]} bytes); lower the limits or set allow_overcommit",
                param="limits",
            )


def _limits(value: Limits | dict[str, Any] | None) -> Limits:
    if isinstance(value, Limits):
        return value
    try:
        return Limits.model_validate(value or {})
    except ValidationError as exc:
        raise _invalid(exc, "limits") from exc


def _invalid(exc: ValidationError, root: str) -> APIError:
    first = exc.errors()[0]
    path = ".".join(str(p) for p in (root, *first["loc"]))
    return APIError("invalid_request", f"'{path}': {first['msg']}", param=path)
