"""Tenants, their limits, their API keys (name, expiry, scopes, own limits, rotation)
and the admin keys (roles), stored in Redis; and the local auth cache.

Every gateway replica caches key -> tenant (with the key's record) for speed (an
ordinary request then resolves its key with no Redis call). Revocations, rotations,
limit changes and deletes are published on ``keys.EVENTS_CHANNEL``; every replica
drops the affected entries as the message arrives (well under 1 s), and clears the
whole cache whenever its subscription (re)connects, because messages sent while it
was away are lost. A TTL bounds staleness even if pub/sub were silently broken. An
expiry (a key's ``expires_at``, a rotated secret's grace end) is not an event: it is
checked against the clock on every use of a cached entry.

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
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError
from steergate.gateway import apikeys, keys
from steergate.gateway.audit import AuditLog
from steergate.gateway.keyuse import KeyUse
from steergate.gateway.store import Redis, is_cluster, store_errors
from steergate.shared.errors import APIError, InvalidField
from steergate.shared.scoping import check_tenant_id

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


#: What a tenant key may be used for; a route's scope is decided in ``gateway.auth``.
SCOPES: tuple[str, ...] = ("inference", "vectors", "latches", "usage")
#: Roles of admin keys: ``viewer`` may only read (GET/HEAD) under /admin.
ADMIN_ROLES: tuple[str, ...] = ("admin", "viewer")
#: ``POST /admin/keys/{key_id}/rotate``: how long the old secret keeps working.
DEFAULT_GRACE_S = 3600
MAX_GRACE_S = 7 * 86400
KEY_FIELDS = frozenset({"name", "expires_at", "scopes", "limits"})
MAX_KEY_NAME = 200


class KeyLimits(BaseModel):
    """A key's own limits, each at most the tenant's; None: only the tenant's apply."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rpm: int | None = Field(
        default=None, ge=1, le=_BIG, strict=True, description="Requests per minute of this key."
    )
    max_concurrency: int | None = Field(
        default=None, ge=1, le=100_000, strict=True, description="This key's requests in flight."
    )


@dataclass(frozen=True)
class ApiKey:
    """A tenant key as ``auth.get_tenant`` leaves it on ``request.state.api_key``."""

    key_id: str
    tenant_id: str
    name: str
    prefix: str
    scopes: frozenset[str]
    limits: KeyLimits
    created_at: float
    expires_at: float | None

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


@dataclass(frozen=True)
class KeyMatch:
    """A resolved tenant key. ``valid_until``: set when the secret presented is a rotated
    one in its grace period (it stops working then, with 401 invalid_api_key)."""

    tenant: Tenant
    key: ApiKey
    valid_until: float | None = None


@dataclass(frozen=True)
class AdminKey:
    """An admin key (``POST /admin/keys``); the bootstrap key is ``key_id="bootstrap"``."""

    key_id: str
    role: str
    name: str = ""
    prefix: str = ""
    created_at: float = 0.0
    created_by: str = ""

    def public(self) -> dict[str, Any]:
        return {
            "key_id": self.key_id,
            "name": self.name,
            "role": self.role,
            "prefix": self.prefix,
            "created_at": self.created_at,
            "created_by": self.created_by,
        }


BOOTSTRAP_ADMIN = AdminKey(key_id="bootstrap", role="admin", name="STEERGATE_ADMIN_KEY")


@dataclass(frozen=True)
class KeyInfo:
    key_id: str
    prefix: str
    created_at: float
    tenant_id: str = ""
    name: str = ""
    scopes: tuple[str, ...] = SCOPES
    limits: KeyLimits = KeyLimits()
    expires_at: float | None = None
    last_used_at: float | None = None
    previous_expires_at: float | None = None

    def public(self) -> dict[str, Any]:
        return {
            "key_id": self.key_id,
            "tenant_id": self.tenant_id,
            "name": self.name,
            "prefix": self.prefix,
            "scopes": list(self.scopes),
            "limits": self.limits.model_dump(),
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "last_used_at": self.last_used_at,
            "previous_expires_at": self.previous_expires_at,
        }


def _scopes_of(doc: dict[str, Any]) -> tuple[str, ...]:
    # Keys made before scopes existed have every scope; a stored list is never empty.
    return tuple(doc["scopes"]) if "scopes" in doc else SCOPES


def _api_key(tenant_id: str, key_id: str, doc: dict[str, Any]) -> ApiKey:
    """From a key record or a lookup entry (they share these fields)."""
    return ApiKey(
        key_id=key_id,
        tenant_id=tenant_id,
        name=doc.get("name", ""),
        prefix=doc.get("prefix", ""),
        scopes=frozenset(_scopes_of(doc)),
        limits=KeyLimits.model_validate(doc.get("limits") or {}),
        created_at=doc.get("created_at", 0.0),
        expires_at=doc.get("expires_at"),
    )


#: Fields of a key record copied into its lookup entries (never a secret or a hash).
_LOOKUP_FIELDS = ("name", "prefix", "scopes", "limits", "created_at", "expires_at")


def _lookup_value(
    tenant: Tenant, key_id: str, doc: dict[str, Any], until: float | None = None
) -> bytes:
    """What ``keys.key_lookup(hash)`` holds: everything authentication needs, so a cache
    miss costs two reads (this and the tenant record), as before scopes existed. The
    fields are immutable for a key's life (a rotation writes new entries), so the
    copies cannot drift. ``tc``: the tenant's ``created_at``, so an entry left behind
    by a deleted tenant never authenticates for a new tenant of the same id;
    ``until``: a rotated-out secret's grace end."""
    entry: dict[str, Any] = {"t": tenant.id, "k": key_id, "tc": tenant.created_at}
    entry.update({f: doc[f] for f in _LOOKUP_FIELDS if f in doc})
    if until is not None:
        entry["until"] = until
    return orjson.dumps(entry)


def _parse_lookup(value: str) -> dict[str, Any]:
    if value.startswith("{"):
        return orjson.loads(value)  # type: ignore[no-any-return]
    tenant_id, key_id = value.split(" ", 1)  # a key made before scopes: every scope
    return {"t": tenant_id, "k": key_id}


#: Compare-and-set of one key record (KEYS[1]: the tenant's key hash; ARGV: key id,
#: the record as read, the new record): 1 if replaced, 0 if it changed or is gone.
_CAS_KEY_LUA = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""
#: Take a key record out (KEYS[1]: the tenant's key hash, KEYS[2]: its last-used
#: hash; ARGV[1]: key id), atomically against a rotation: the record as it was, or nil.
_TAKE_KEY_LUA = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return false end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return cur
"""


def _key_info(
    tenant_id: str, key_id: str, doc: dict[str, Any], last_used: Any, now: float
) -> KeyInfo:
    prev_until: float | None = doc.get("prev_expires_at")
    in_grace = bool(doc.get("prev_hash")) and prev_until is not None and prev_until > now
    return KeyInfo(
        key_id=key_id,
        tenant_id=tenant_id,
        prefix=doc["prefix"],
        created_at=doc["created_at"],
        name=doc.get("name", ""),
        scopes=_scopes_of(doc),
        limits=KeyLimits.model_validate(doc.get("limits") or {}),
        expires_at=doc.get("expires_at"),
        last_used_at=float(last_used) if last_used else None,
        previous_expires_at=prev_until if in_grace else None,
    )


def _check_key_options(
    tenant: Tenant, name: Any, expires_at: Any, scopes: Any, limits: Any, now: float
) -> tuple[str, float | None, tuple[str, ...], KeyLimits]:
    """Validate ``POST /admin/tenants/{id}/keys`` options; every 400 names its field."""
    if name is None:
        name = ""
    if not isinstance(name, str) or len(name) > MAX_KEY_NAME:
        raise InvalidField("name", f"'name' must be a string of at most {MAX_KEY_NAME} characters")
    if expires_at is not None:
        if (
            isinstance(expires_at, bool)
            or not isinstance(expires_at, (int, float))
            or not math.isfinite(expires_at)
        ):
            raise InvalidField("expires_at", "'expires_at' must be a number (unix seconds)")
        if expires_at <= now:
            raise InvalidField("expires_at", "'expires_at' must be in the future (unix seconds)")
        if expires_at >= 1e11:
            raise InvalidField("expires_at", "'expires_at' is unix seconds, not milliseconds")
        expires_at = float(expires_at)
    if scopes is None:
        chosen = SCOPES
    else:
        if not isinstance(scopes, list) or not scopes:
            raise InvalidField(
                "scopes", f"'scopes' must be a non-empty list of {', '.join(SCOPES)}"
            )
        for i, scope in enumerate(scopes):
            if scope not in SCOPES:
                raise InvalidField(
                    f"scopes[{i}]", f"unknown scope {scope!r}: use {', '.join(SCOPES)}"
                )
        chosen = tuple(s for s in SCOPES if s in scopes)
    if limits is None:
        limits = {}
    if not isinstance(limits, dict):
        raise InvalidField("limits", "'limits' must be an object")
    try:
        key_limits = KeyLimits.model_validate(limits)
    except ValidationError as exc:
        raise _invalid(exc, "limits") from exc
    for field in ("rpm", "max_concurrency"):
        mine, theirs = getattr(key_limits, field), getattr(tenant.limits, field)
        if mine is not None and mine > theirs:
            raise InvalidField(
                f"limits.{field}",
                f"'limits.{field}' ({mine}) is above the tenant's {field} ({theirs})",
            )
    return name, expires_at, chosen, key_limits


EngineCaps = Callable[[], "tuple[int, int] | None"]
OnTenantDeleted = Callable[[str, list[str], list[str]], Awaitable[None]]


class AuthCache:
    """Replica-local key-hash -> resolved key cache with TTL and targeted drops.

    An entry is a tenant key (:class:`KeyMatch`: the tenant, the key's scopes, limits
    and expiry) or an admin key (:class:`AdminKey`). Expiry (``expires_at``, a rotated
    secret's grace end) is not an invalidation event: it is checked against the clock
    on every use of a cached entry, so it holds on every replica to the second.

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
        # key hash -> (KeyMatch | AdminKey, key_id, tenant_id ("" for admin keys), deadline)
        self._by_hash: dict[str, tuple[Any, str, str, float]] = {}

    def get(self, key_hash: str) -> Any:
        hit = self._by_hash.get(key_hash)
        if hit is None:
            return None
        if hit[3] < time.monotonic():
            self._by_hash.pop(key_hash, None)
            return None
        return hit[0]

    def put(self, key_hash: str, value: Any, key_id: str, tenant_id: str, generation: int) -> bool:
        """Store the entry unless an invalidation arrived since ``generation`` was
        read (before the lookup that produced it). Returns whether it was stored."""
        if generation != self.generation:
            return False
        self._by_hash[key_hash] = (value, key_id, tenant_id, time.monotonic() + self.ttl_s)
        return True

    def drop_key(self, key_id: str) -> None:
        self.generation += 1
        for h in [h for h, entry in self._by_hash.items() if entry[1] == key_id]:
            self._by_hash.pop(h, None)

    def drop_tenant(self, tenant_id: str) -> None:
        self.generation += 1
        for h in [h for h, entry in self._by_hash.items() if entry[2] == tenant_id]:
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
        self.key_use = KeyUse(redis)
        self.audit = AuditLog(redis)

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
                if doc.get("prev_hash"):
                    await self.redis.delete(keys.key_lookup(doc["prev_hash"]))
            for key_id in key_rows:
                await self.redis.delete(keys.key_owner(key_id))
            # One slot: every per-tenant key carries the same hash tag.
            await self.redis.delete(
                *keys.all_tenant_keys(tenant_id, int(time.time()) // 60),
                keys.key_last_used(tenant_id),
            )
            await self.redis.srem(keys.TENANT_INDEX, tenant_id)
            await self._publish(f"tenant:{tenant_id}")
        self.cache.drop_tenant(tenant_id)
        if self.on_deleted is not None:
            await self.on_deleted(tenant_id, latch_ids, vector_names)
        return True

    # -- keys ------------------------------------------------------------------
    #
    # Per key: ``keys.key_lookup(hash)`` (global) -> the lookup entry (``_lookup_value``)
    # for each live secret; ``keys.key_owner(key_id)`` (global) -> "<tenant> <hash>";
    # ``keys.tenant_keys(tenant)`` key_id -> the record {prefix, created_at, hash, name,
    # scopes, limits, expires_at[, prev_hash, prev_expires_at, rotated_at]}, which is
    # what lists show and what revoke and rotate change (atomically, by script: a
    # revoke racing a rotation removes every secret either produced).

    async def create_key(self, tenant_id: str, **options: Any) -> tuple[str, str, str]:
        """(key_id, key, prefix). The raw key exists only in this return value.
        ``options``: as :meth:`create_key_info`."""
        info, key = await self.create_key_info(tenant_id, **options)
        return info.key_id, key, info.prefix

    async def create_key_info(
        self,
        tenant_id: str,
        *,
        name: Any = None,
        expires_at: Any = None,
        scopes: Any = None,
        limits: Any = None,
    ) -> tuple[KeyInfo, str]:
        """Validate the options (400 naming the field), store the key's HMAC and
        record; return the key's public record and the raw key (shown once)."""
        tenant = await self.require(tenant_id)
        now = time.time()
        name, expires_at, chosen, key_limits = _check_key_options(
            tenant, name, expires_at, scopes, limits, now
        )
        key = apikeys.generate_key()
        key_id = apikeys.generate_key_id()
        prefix = apikeys.display_prefix(key)
        key_hash = apikeys.hash_key(self._pepper, key)
        doc: dict[str, Any] = {
            "prefix": prefix,
            "created_at": now,
            "hash": key_hash,
            "name": name,
            "scopes": list(chosen),
            "limits": key_limits.model_dump(exclude_none=True),
            "expires_at": expires_at,
        }
        async with store_errors():
            await self.redis.set(keys.key_lookup(key_hash), _lookup_value(tenant, key_id, doc))
            await self.redis.set(keys.key_owner(key_id), f"{tenant_id} {key_hash}")
            await self.redis.hset(keys.tenant_keys(tenant_id), key_id, orjson.dumps(doc))
        return _key_info(tenant_id, key_id, doc, None, now), key

    async def list_keys(self, tenant_id: str) -> builtins.list[KeyInfo]:
        await self.require(tenant_id)
        async with store_errors():
            rows = await self.redis.hgetall(keys.tenant_keys(tenant_id))
            used = await self.redis.hgetall(keys.key_last_used(tenant_id)) if rows else {}
        now = time.time()
        out = [
            _key_info(tenant_id, key_id, orjson.loads(raw), used.get(key_id), now)
            for key_id, raw in rows.items()
        ]
        return sorted(out, key=lambda k: (k.created_at, k.key_id))

    async def revoke_key(self, key_id: str) -> str | None:
        """Revoke a tenant key (every secret it has, a rotated one in its grace period
        too); returns its tenant id, or None if there is no such key."""
        async with store_errors():
            owner = await self.redis.get(keys.key_owner(key_id))
            if not owner:
                return None
            tenant_id, key_hash = owner.split(" ", 1)
            raw = await self.redis.eval(
                _TAKE_KEY_LUA,
                2,
                keys.tenant_keys(tenant_id),
                keys.key_last_used(tenant_id),
                key_id,
            )
            doc = orjson.loads(raw) if raw else {}
            for h in {key_hash, doc.get("hash"), doc.get("prev_hash")} - {None}:
                await self.redis.delete(keys.key_lookup(h))
            await self.redis.delete(keys.key_owner(key_id))
            await self._publish(f"key:{key_id}")
        self.cache.drop_key(key_id)
        return tenant_id if raw else None

    async def rotate_key(
        self, key_id: str, grace_s: int = DEFAULT_GRACE_S
    ) -> tuple[KeyInfo, str] | None:
        """Give the key a new secret (same key id, name, scopes, limits, expiry). The
        current secret keeps working for ``grace_s`` seconds, then answers 401; a secret
        still in the grace of an earlier rotation stops at once (one previous secret at
        a time). Returns the updated record and the new raw key, or None (no such key).
        The record is replaced by compare-and-set, so a concurrent rotation or revoke
        of the same key never leaves a secret behind that the record does not name."""
        async with store_errors():
            for _ in range(5):
                owner = await self.redis.get(keys.key_owner(key_id))
                if not owner:
                    return None
                tenant_id = owner.split(" ", 1)[0]
                tenant = await self.get(tenant_id)
                raw = await self.redis.hget(keys.tenant_keys(tenant_id), key_id)
                if tenant is None or not raw:
                    return None
                rotated = await self._rotate_once(tenant, key_id, raw, grace_s)
                if rotated is not None:
                    break
            else:
                return None
            self.cache.drop_key(key_id)
            return rotated

    async def _rotate_once(
        self, tenant: Tenant, key_id: str, raw: str, grace_s: int
    ) -> tuple[KeyInfo, str] | None:
        doc = orjson.loads(raw)
        now = time.time()
        current, older = doc["hash"], doc.get("prev_hash")
        key = apikeys.generate_key()
        new_hash = apikeys.hash_key(self._pepper, key)
        doc.update(prefix=apikeys.display_prefix(key), hash=new_hash, rotated_at=now)
        until = now + grace_s
        if grace_s > 0:
            doc.update(prev_hash=current, prev_expires_at=until)
        else:
            doc.pop("prev_hash", None)
            doc.pop("prev_expires_at", None)
        new_lookup = keys.key_lookup(new_hash)
        await self.redis.set(new_lookup, _lookup_value(tenant, key_id, doc))
        swapped = await self.redis.eval(
            _CAS_KEY_LUA, 1, keys.tenant_keys(tenant.id), key_id, raw, orjson.dumps(doc)
        )
        if not swapped:  # revoked or rotated meanwhile; the new secret was never shown
            await self.redis.delete(new_lookup)
            return None
        old_lookup = keys.key_lookup(current)
        if grace_s > 0:
            # xx: a revoke that ran meanwhile stays a revoke. Redis forgets the entry a
            # little after the grace ends; the grace itself is enforced from ``until``,
            # to the second, on every replica (cached or not).
            await self.redis.set(
                old_lookup,
                _lookup_value(tenant, key_id, doc, until),
                xx=True,
                exat=math.ceil(until) + 5,
            )
        else:
            await self.redis.delete(old_lookup)
        if older and older != current:
            await self.redis.delete(keys.key_lookup(older))
        await self.redis.set(keys.key_owner(key_id), f"{tenant.id} {new_hash}", xx=True)
        # Replicas holding the old secret drop it and re-read it (learning its grace end).
        await self._publish(f"key:{key_id}")
        used = await self.redis.hget(keys.key_last_used(tenant.id), key_id)
        return _key_info(tenant.id, key_id, doc, used, now), key

    async def resolve(self, raw_key: str) -> KeyMatch | None:
        """The key's tenant and record, or None (unknown, malformed, revoked, or a
        rotated secret past its grace). An *expired* key is returned: the caller
        answers 401 expired_api_key. Hot path: a cache hit costs no Redis call."""
        if not apikeys.looks_like_key(raw_key):
            return None
        key_hash = apikeys.hash_key(self._pepper, raw_key)
        cached = self.cache.get(key_hash)
        if cached is None:
            cached = await self._load(key_hash)
            if cached is None:
                return None
        if cached.valid_until is not None and time.time() >= cached.valid_until:
            return None
        return cached  # type: ignore[no-any-return]

    async def _load(self, key_hash: str) -> KeyMatch | None:
        generation = self.cache.generation  # before the read: see AuthCache
        async with store_errors():
            owner = await self.redis.get(keys.key_lookup(key_hash))
            if not owner:
                return None
            entry = _parse_lookup(owner)
            raw = await self.redis.get(keys.tenant_record(entry["t"]))
        if not raw:
            return None
        tenant = Tenant.from_record(raw)
        if "tc" in entry and entry["tc"] != tenant.created_at:
            return None  # left behind by an earlier tenant of the same id
        match = KeyMatch(tenant, _api_key(tenant.id, entry["k"], entry), entry.get("until"))
        self.cache.put(key_hash, match, entry["k"], tenant.id, generation)
        return match

    async def resolve_key(self, raw_key: str) -> Tenant | None:
        """The key's tenant if the key may be used now (not expired), else None."""
        match = await self.resolve(raw_key)
        if match is None or match.key.expired(time.time()):
            return None
        return match.tenant

    # -- admin keys --------------------------------------------------------------

    async def create_admin_key(
        self, role: str, *, name: str = "", created_by: str = ""
    ) -> tuple[AdminKey, str]:
        """(record, raw key): the key is shown once; only its HMAC is stored."""
        if role not in ADMIN_ROLES:
            raise InvalidField("role", f"'role' must be one of {', '.join(ADMIN_ROLES)}")
        key = apikeys.generate_admin_key()
        admin = AdminKey(
            key_id=apikeys.generate_admin_key_id(),
            role=role,
            name=name,
            prefix=apikeys.display_prefix(key),
            created_at=time.time(),
            created_by=created_by,
        )
        key_hash = apikeys.hash_key(self._pepper, key)
        doc = {**admin.public(), "hash": key_hash}
        doc.pop("key_id")
        async with store_errors():
            await self.redis.hset(keys.ADMIN_KEYS, admin.key_id, orjson.dumps(doc))
            await self.redis.set(keys.admin_key_lookup(key_hash), admin.key_id)
        return admin, key

    async def list_admin_keys(self) -> builtins.list[AdminKey]:
        async with store_errors():
            rows = await self.redis.hgetall(keys.ADMIN_KEYS)
        out = [_admin_key(key_id, orjson.loads(raw)) for key_id, raw in rows.items()]
        return sorted(out, key=lambda k: (k.created_at, k.key_id))

    async def revoke_admin_key(self, key_id: str) -> AdminKey | None:
        """Revoke an admin key on every replica (pub/sub, like tenant keys)."""
        async with store_errors():
            row = await self.redis.hget(keys.ADMIN_KEYS, key_id)
            if not row:
                return None
            doc = orjson.loads(row)
            await self.redis.delete(keys.admin_key_lookup(doc["hash"]))
            await self.redis.hdel(keys.ADMIN_KEYS, key_id)
            await self._publish(f"key:{key_id}")
        self.cache.drop_key(key_id)
        return _admin_key(key_id, doc)

    async def resolve_admin(self, raw_key: str) -> AdminKey | None:
        """An admin key's record, or None. Cached like tenant keys (same invalidation)."""
        if not apikeys.looks_like_admin_key(raw_key):
            return None
        key_hash = apikeys.hash_key(self._pepper, raw_key)
        cached = self.cache.get(key_hash)
        if isinstance(cached, AdminKey):
            return cached
        generation = self.cache.generation  # before the read: see AuthCache
        async with store_errors():
            key_id = await self.redis.get(keys.admin_key_lookup(key_hash))
            if not key_id:
                return None
            row = await self.redis.hget(keys.ADMIN_KEYS, key_id)
        if not row:
            return None
        doc = orjson.loads(row)
        if not apikeys.same_secret(doc["hash"], key_hash):
            return None
        admin = _admin_key(key_id, doc)
        self.cache.put(key_hash, admin, key_id, "", generation)
        return admin

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


def _admin_key(key_id: str, doc: dict[str, Any]) -> AdminKey:
    return AdminKey(
        key_id=key_id,
        role=doc["role"],
        name=doc.get("name", ""),
        prefix=doc.get("prefix", ""),
        created_at=doc.get("created_at", 0.0),
        created_by=doc.get("created_by", ""),
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
