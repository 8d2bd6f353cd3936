"""The tenant store: tenants, their API keys (create, list, rotate, revoke) and the
admin keys, in Redis; resolving a presented key (through the auth cache,
``steergate/gateway/tenancy/auth_cache.py``, kept current by
``steergate/gateway/tenancy/invalidation.py``). What the records are and how they are validated:
``steergate/gateway/tenancy/records.py``.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from pydantic import ValidationError

from steergate.gateway.store import key_names as keys
from steergate.gateway.store.connection import STORE_FAILURES, Redis, store_errors
from steergate.gateway.store.scripts import (
    AddKey,
    CasKey,
    CasTenant,
    CreateTenant,
    Scripts,
    TakeKey,
    TenantGone,
)
from steergate.gateway.tenancy import api_keys as apikeys
from steergate.gateway.tenancy.audit import AuditLog
from steergate.gateway.tenancy.auth_cache import AuthCache
from steergate.gateway.tenancy.invalidation import Invalidations
from steergate.gateway.tenancy.key_last_use import KeyUse
from steergate.gateway.tenancy.records import (
    ADMIN_ROLES,
    DEFAULT_ENGINE_CAPS,
    DEFAULT_GRACE_S,
    AdminKey,
    KeyInfo,
    KeyMatch,
    Limits,
    Tenant,
    admin_key_from,
    api_key_from,
    as_limits,
    check_key_options,
    invalid_field,
    key_info_from,
    lookup_value,
    parse_lookup,
)
from steergate.shared.errors import APIError, InvalidField, reject_unknown
from steergate.shared.scoping import check_tenant_id

log = logging.getLogger("steergate.gateway.tenants")

EngineCaps = Callable[[], "tuple[int, int] | None"]
OnTenantDeleted = Callable[[str, list[str], list[str]], Awaitable[None]]

#: Compare-and-set tries of one key rotation or tenant update before it answers 409
#: (``key_changed``, ``tenant_changed``).
CAS_ATTEMPTS = 5


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
        scripts: Scripts | None = None,
    ) -> None:
        self.redis = redis
        self.scripts = scripts or Scripts.load(redis)
        self._pepper = pepper
        self._engine_caps = engine_caps or (lambda: None)
        self.refuse_overcommit = refuse_overcommit
        self.on_deleted = on_deleted
        self.cache = AuthCache(cache_ttl_s)
        self.events = Invalidations(redis, self.cache)
        self.key_use = KeyUse(self.scripts)
        self.audit = AuditLog(redis)

    def salt_secret(self, tenant: Tenant) -> str:
        """The tenant's prefix-cache secret: HMAC-SHA256(pepper, its stored random
        ``cache_salt``). Redis holds only the random value, so a dump of it without the
        pepper does not give the salt the engines see (as for API keys)."""
        return apikeys.hash_key(self._pepper, "cache-salt\0" + tenant.cache_salt.get_secret_value())

    # -- tenants ---------------------------------------------------------------

    async def create(
        self,
        tenant_id: str,
        *,
        name: str = "",
        limits: Limits | dict[str, Any] | None = None,
        allow_overcommit: bool = False,
    ) -> Tenant:
        """201-or-409: ids are unique (SET NX); overcommit is checked first.

        The index (a global key, on another node of a cluster) is written first: a
        create that fails between the two writes (a node lost) leaves an index entry
        without a record, which every reader skips and the retry completes. The other
        order left a tenant that exists but is never listed or counted in the quota
        sums, and whose retry is 409 (found from outside, on a cluster failover).

        The record is written by one script that also removes whatever an earlier tenant
        of the same id left (:class:`CreateTenant`): a tenant created again starts empty
        even after a delete that failed midway was never retried."""
        check_tenant_id(tenant_id)
        tenant = Tenant(
            id=tenant_id, name=name, limits=as_limits(limits), allow_overcommit=allow_overcommit
        )
        await self._check_overcommit(tenant)
        async with store_errors():
            await self.redis.sadd(keys.TENANT_INDEX, tenant_id)
            created = await self.scripts.run(
                CreateTenant(tenant_id=tenant_id, record=tenant.record(), now=time.time())
            )
            if not created:
                raise APIError("tenant_exists", f"tenant '{tenant_id}' already exists", param="id")
        return tenant

    async def get(self, tenant_id: str) -> Tenant | None:
        async with store_errors():
            raw = await self.redis.get(keys.tenant_record(tenant_id))
        return Tenant.from_record(raw) if raw else None

    async def require(self, tenant_id: str) -> Tenant:
        tenant = await self.get(tenant_id)
        if tenant is None:
            raise _no_tenant(tenant_id)
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
        """Apply a partial update: ``name``, ``allow_overcommit``, ``limits`` (partial).
        The record is replaced by compare-and-set against the one the patch was merged
        into, so updates running at once each keep their change (one that loses the race
        merges again, ``CAS_ATTEMPTS`` times, then 409 ``tenant_changed``), and an
        update never brings back a tenant deleted meanwhile."""
        return (await self.update_from(tenant_id, patch))[1]

    async def update_from(self, tenant_id: str, patch: dict[str, Any]) -> tuple[Tenant, Tenant]:
        """:meth:`update`, with the record the patch was merged into: (before, after).
        What the update changed is their difference; a record read before the call could
        credit this update with another's change (found from outside)."""
        for _ in range(CAS_ATTEMPTS):
            async with store_errors():
                raw = await self.redis.get(keys.tenant_record(tenant_id))
            if not raw:
                raise APIError("tenant_not_found", f"no tenant '{tenant_id}'", param="id")
            reject_unknown(patch, ("name", "limits", "allow_overcommit"))
            if patch.get("limits") is not None and not isinstance(patch["limits"], dict):
                raise APIError("invalid_request", "'limits' must be an object", param="limits")
            before = Tenant.from_record(raw)
            updated = self._patched(before, patch)
            await self._check_overcommit(updated)
            async with store_errors():
                swapped = await self.scripts.run(
                    CasTenant(tenant_id=tenant_id, expected=raw, new=updated.record())
                )
                if swapped:
                    await self.events.publish(f"tenant:{tenant_id}")
                    break
        else:
            raise APIError(
                "tenant_changed",
                f"tenant '{tenant_id}' was changed by other requests while this update ran; "
                "retry it",
                param="id",
            )
        self.cache.drop_tenant(tenant_id)
        return before, updated

    @staticmethod
    def _patched(current: Tenant, patch: dict[str, Any]) -> Tenant:
        limits = current.limits.model_dump()
        if patch.get("limits") is not None:
            limits.update(patch["limits"])
        try:
            return Tenant(
                id=current.id,
                name=patch["name"] if patch.get("name") is not None else current.name,
                limits=Limits.model_validate(limits),
                allow_overcommit=bool(patch.get("allow_overcommit", current.allow_overcommit)),
                created_at=current.created_at,
                cache_salt=current.cache_salt,
            )
        except ValidationError as exc:
            raise invalid_field(exc, "limits") from exc

    async def delete(self, tenant_id: str) -> bool:
        """Remove the tenant with its keys, latches, vectors and usage; the engine-side
        latches and vectors go through ``on_deleted`` (wired to the engine pool). The
        record is taken out first, in one command: of deletes running at once exactly one
        proceeds (and is audited, and cleans the engines); the others find no tenant.

        A delete that fails after that (a cluster node lost: 503) puts the record back
        where it can, so its retry finds the tenant and does the whole delete again. It
        answered 404, with the tenant's keys, vectors and latches left in Redis, the other
        replicas never told and the engines never cleaned (found from outside)."""
        record = keys.tenant_record(tenant_id)
        async with store_errors():
            raw = await self.redis.getdel(record)
            if not raw:
                return False
            try:
                latch_ids, vector_names = await self._remove_tenant_state(tenant_id)
            except STORE_FAILURES:
                with contextlib.suppress(*STORE_FAILURES):
                    await self.redis.set(record, raw, nx=True)
                raise
        self.cache.drop_tenant(tenant_id)
        if self.on_deleted is not None:
            await self.on_deleted(tenant_id, latch_ids, vector_names)
        return True

    async def _remove_tenant_state(self, tenant_id: str) -> tuple[list[str], list[str]]:
        """Every step of a delete after its record is taken, each safe to repeat; the
        latches and vectors it removed (for the engines)."""
        key_rows = await self.redis.hgetall(keys.tenant_keys(tenant_id))
        latch_ids = list(await self.redis.zrange(keys.latches(tenant_id), 0, -1))
        vector_names = list(await self.redis.hkeys(keys.vectors(tenant_id)))
        for row in key_rows.values():
            for secret in _secrets(row):
                await self.redis.delete(keys.key_lookup(secret))
        for key_id in key_rows:
            await self.redis.delete(keys.key_owner(key_id))
        # One slot: every per-tenant key carries the same hash tag. Not the record: it
        # is taken already, and one a create wrote meanwhile is the new tenant's.
        await self.redis.delete(*keys.tenant_state_keys(tenant_id, int(time.time()) // 60))
        await self.redis.srem(keys.TENANT_INDEX, tenant_id)
        if await self.redis.exists(keys.tenant_record(tenant_id)):
            await self.redis.sadd(keys.TENANT_INDEX, tenant_id)  # created again meanwhile
        await self.events.publish(f"tenant:{tenant_id}")
        # Its own event too: "tenant:" also stands for an update, and on a delete
        # every replica forgets the tenant's metric series.
        await self.events.publish(f"deleted:{tenant_id}")
        return latch_ids, vector_names

    # -- keys ------------------------------------------------------------------
    #
    # Per key: ``keys.key_lookup(hash)`` (global) -> the lookup entry (``lookup_value``)
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
        record; return the key's public record and the raw key (shown once). The record
        is added last, behind the tenant generation check: if the tenant is deleted
        meanwhile, the lookup entries just written are taken back and the answer is 404
        (a tenant re-created with the id never lists the key)."""
        tenant = await self.require(tenant_id)
        now = time.time()
        name, expires_at, chosen, key_limits = check_key_options(
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
            await self.redis.set(keys.key_lookup(key_hash), lookup_value(tenant, key_id, doc))
            await self.redis.set(keys.key_owner(key_id), f"{tenant_id} {key_hash}")
            try:
                await self.scripts.run(
                    AddKey(
                        tenant_id=tenant_id,
                        generation=tenant.created_at,
                        key_id=key_id,
                        record=orjson.dumps(doc),
                    )
                )
            except TenantGone:
                await self.redis.delete(keys.key_lookup(key_hash))  # global keys: one each
                await self.redis.delete(keys.key_owner(key_id))
                raise _no_tenant(tenant_id) from None
        return key_info_from(tenant_id, key_id, doc, None, now), key

    async def list_keys(self, tenant_id: str) -> builtins.list[KeyInfo]:
        await self.require(tenant_id)
        async with store_errors():
            rows = await self.redis.hgetall(keys.tenant_keys(tenant_id))
            used = await self.redis.hgetall(keys.key_last_used(tenant_id)) if rows else {}
        now = time.time()
        out = [
            key_info_from(tenant_id, key_id, orjson.loads(raw), used.get(key_id), now)
            for key_id, raw in rows.items()
        ]
        return sorted(out, key=lambda k: (k.created_at, k.key_id))

    async def revoke_key(self, key_id: str) -> str | None:
        """Revoke a tenant key (every secret it has, a rotated one in its grace period
        too); returns its tenant id, or None if there is no such key.

        The steps touch keys on several nodes of a cluster, so each is safe to repeat and
        the owner entry, which says the key exists, goes last: a revoke that fails
        midway (503) has already stopped the secrets it read, and its retry finds the
        key, finishes the work and answers 204, where it answered 404 with the
        replicas never told (found from outside, on a cluster failover). The record is
        taken atomically against a rotation, and the secrets it held are stopped too."""
        async with store_errors():
            owner = await self.redis.get(keys.key_owner(key_id))
            if not owner:
                return None
            tenant_id, key_hash = owner.split(" ", 1)
            read = await self.redis.hget(keys.tenant_keys(tenant_id), key_id)
            stopped = {key_hash, *_secrets(read)}
            for h in stopped:
                await self.redis.delete(keys.key_lookup(h))
            taken = await self.scripts.run(TakeKey(tenant_id=tenant_id, key_id=key_id))
            for h in _secrets(taken) - stopped:  # a rotation ran between the read and here
                await self.redis.delete(keys.key_lookup(h))
            await self.events.publish(f"key:{key_id}")
            await self.redis.delete(keys.key_owner(key_id))
        self.cache.drop_key(key_id)
        return tenant_id

    async def rotate_key(
        self,
        key_id: str,
        grace_s: int = DEFAULT_GRACE_S,
        recorded: Callable[[KeyInfo], Awaitable[None]] | None = None,
    ) -> tuple[KeyInfo, str] | None:
        """Give the key a new secret (same key id, name, scopes, limits, expiry). The
        current secret keeps working for ``grace_s`` seconds, then answers 401; a secret
        still in the grace of an earlier rotation stops at once (one previous secret at
        a time). Returns the updated record and the new raw key, or None (no such key).
        The record is replaced by compare-and-set, so a concurrent rotation or revoke
        of the same key never leaves a secret behind that the record does not name. A
        rotation that loses the compare-and-set ``CAS_ATTEMPTS`` times to other
        changes of the same key is 409 ``key_changed`` (retrying is safe): it is not
        a missing key.

        ``recorded`` (the route's audit entry) is the rotation's last step: if it fails,
        the rotation is undone like one whose own steps failed (below)."""
        async with store_errors():
            for _ in range(CAS_ATTEMPTS):
                owner = await self.redis.get(keys.key_owner(key_id))
                if not owner:
                    return None
                tenant_id = owner.split(" ", 1)[0]
                tenant = await self.get(tenant_id)
                raw = await self.redis.hget(keys.tenant_keys(tenant_id), key_id)
                if tenant is None or not raw:
                    return None
                rotated = await self._rotate_once(tenant, key_id, raw, grace_s, recorded)
                if rotated is not None:
                    break
            else:
                raise APIError(
                    "key_changed",
                    f"key '{key_id}' was changed by other requests while this rotation ran; "
                    "retry it",
                    param="key_id",
                )
            self.cache.drop_key(key_id)
            return rotated

    async def _rotate_once(
        self,
        tenant: Tenant,
        key_id: str,
        raw: str,
        grace_s: int,
        recorded: Callable[[KeyInfo], Awaitable[None]] | None,
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
        # Read before the swap: nothing that can fail may come after the last step.
        used = await self.redis.hget(keys.key_last_used(tenant.id), key_id)
        new_lookup = keys.key_lookup(new_hash)
        await self.redis.set(new_lookup, lookup_value(tenant, key_id, doc))
        rotated = orjson.dumps(doc)
        swapped = await self.scripts.run(
            CasKey(tenant_id=tenant.id, key_id=key_id, expected=raw, new=rotated)
        )
        if not swapped:  # revoked or rotated meanwhile; the new secret was never shown
            await self.redis.delete(new_lookup)
            return None
        info = key_info_from(tenant.id, key_id, doc, used, now)
        try:
            await self._retire(tenant, key_id, doc, current, older, until if grace_s > 0 else None)
            if recorded is not None:
                await recorded(info)
        except BaseException:
            # The caller answers an error (503) and the new secret is never shown: the key
            # goes back to how it was where it can, so the retry rotates from the secret
            # clients use. Else the retry took the unseen secret for the current one, gave
            # it the grace, and stopped the one in use at once (found from outside).
            with contextlib.suppress(Exception):
                if await self.scripts.run(
                    CasKey(tenant_id=tenant.id, key_id=key_id, expected=rotated, new=raw)
                ):
                    await self.redis.set(
                        keys.key_lookup(current),
                        lookup_value(tenant, key_id, orjson.loads(raw)),
                        xx=True,
                    )
                    await self.redis.delete(new_lookup)
                    await self.redis.set(keys.key_owner(key_id), f"{tenant.id} {current}", xx=True)
            raise
        return info, key

    async def _retire(
        self,
        tenant: Tenant,
        key_id: str,
        doc: dict[str, Any],
        current: str,
        older: str | None,
        until: float | None,
    ) -> None:
        """A rotation's steps after its record is swapped: the secret it replaced ends
        at ``until`` (None: now), one still in an earlier grace ends now, the owner
        entry names the new secret, and the replicas are told."""
        old_lookup = keys.key_lookup(current)
        if until is not None:
            # xx: a revoke that ran meanwhile stays a revoke. Redis forgets the entry a
            # little after the grace ends; the grace itself is enforced from ``until``,
            # to the second, on every replica (cached or not).
            await self.redis.set(
                old_lookup,
                lookup_value(tenant, key_id, doc, until),
                xx=True,
                exat=math.ceil(until) + 5,
            )
        else:
            await self.redis.delete(old_lookup)
        if older and older != current:
            await self.redis.delete(keys.key_lookup(older))
        await self.redis.set(keys.key_owner(key_id), f"{tenant.id} {doc['hash']}", xx=True)
        # Replicas holding the old secret drop it and re-read it (learning its grace end).
        await self.events.publish(f"key:{key_id}")

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
            entry = parse_lookup(owner)
            raw = await self.redis.get(keys.tenant_record(entry["t"]))
        if not raw:
            return None
        tenant = Tenant.from_record(raw)
        if "tc" in entry and entry["tc"] != tenant.created_at:
            return None  # left behind by an earlier tenant of the same id
        match = KeyMatch(tenant, api_key_from(tenant.id, entry["k"], entry), entry.get("until"))
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
        out = [admin_key_from(key_id, orjson.loads(raw)) for key_id, raw in rows.items()]
        return sorted(out, key=lambda k: (k.created_at, k.key_id))

    async def revoke_admin_key(self, key_id: str) -> AdminKey | None:
        """Revoke an admin key on every replica (pub/sub, like tenant keys). The row,
        which says the key exists, goes last: a revoke that fails midway (503) has
        already stopped what it could, and its retry finds the key and finishes, where
        it answered 404 with the replicas never told (found from outside)."""
        async with store_errors():
            row = await self.redis.hget(keys.ADMIN_KEYS, key_id)
            if not row:
                return None
            doc = orjson.loads(row)
            await self.redis.delete(keys.admin_key_lookup(doc["hash"]))
            await self.events.publish(f"key:{key_id}")
            # HDEL decides: of revokes running at once, one removes the row; the others
            # find no key (404), as a later revoke would.
            if not await self.redis.hdel(keys.ADMIN_KEYS, key_id):
                return None
        self.cache.drop_key(key_id)
        return admin_key_from(key_id, doc)

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
        admin = admin_key_from(key_id, doc)
        self.cache.put(key_hash, admin, key_id, "", generation)
        return admin

    # -- invalidation ------------------------------------------------------------

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


def _no_tenant(tenant_id: str) -> APIError:
    return APIError("tenant_not_found", f"no tenant '{tenant_id}'", param="id")


def _secrets(raw: str | bytes | None) -> set[str]:
    """The hashes of the secrets a key record names (current and rotated-out)."""
    doc = orjson.loads(raw) if raw else {}
    return {h for h in (doc.get("hash"), doc.get("prev_hash")) if h}
