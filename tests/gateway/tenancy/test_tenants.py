"""The data layer: tenants, keys, hashing, overcommit, cross-replica invalidation."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from redis import exceptions as redis_exceptions

from steergate.gateway.store import key_names as keys
from steergate.gateway.tenancy import api_keys as apikeys
from steergate.gateway.tenancy.records import Limits
from steergate.gateway.tenancy.tenants import TenantStore
from steergate.shared.errors import APIError
from tests.harness import aredis_client

pytestmark = pytest.mark.asyncio(loop_scope="session")

PEPPER = "test-pepper"


@pytest.fixture()
async def store(redis_url: str):
    client = aredis_client(redis_url)
    yield TenantStore(client, PEPPER)
    await client.aclose()


async def test_key_is_random_256_bit_and_only_its_hmac_is_stored(store: TenantStore) -> None:
    await store.create("acme")
    key_id, key, prefix = await store.create_key("acme")
    assert key.startswith("sk-sg-") and len(key) == 6 + 43 and prefix == key[:12]
    dump = {k: await store.redis.dump(k) async for k in store.redis.scan_iter(match="*")}
    assert all(key.encode() not in (v or b"") for v in dump.values())
    assert await store.redis.exists(keys.key_lookup(apikeys.hash_key(PEPPER, key)))
    assert (await store.resolve_key(key)).id == "acme"  # type: ignore[union-attr]
    listed = await store.list_keys("acme")
    assert [k.public() for k in listed] == [
        {
            "key_id": key_id,
            "tenant_id": "acme",
            "name": "",
            "prefix": prefix,
            "scopes": ["inference", "vectors", "latches", "usage"],
            "limits": {"rpm": None, "max_concurrency": None},
            "created_at": listed[0].created_at,
            "expires_at": None,
            "last_used_at": None,
            "previous_expires_at": None,
        }
    ]


async def _everything_in(redis: Any) -> bytes:
    """Every key and value Redis holds, uncompressed (DUMP's payload is LZF-compressed)."""
    out = []
    # SCAN, not KEYS: a cluster client scans every primary (KEYS asks one node).
    for key in [k async for k in redis.scan_iter(match="*")]:
        kind = await redis.type(key)
        kind = kind.decode() if isinstance(kind, bytes) else kind
        if kind == "string":
            out.append(await redis.get(key))
        elif kind == "hash":
            out += [b for kv in (await redis.hgetall(key)).items() for b in kv]
        elif kind == "zset":
            out += await redis.zrange(key, 0, -1)
        elif kind == "set":
            out += list(await redis.smembers(key))
        elif kind == "list":
            out += await redis.lrange(key, 0, -1)
        elif kind == "stream":
            out += [repr(e).encode() for e in await redis.xrange(key)]
        out.append(key)
    return b"\n".join(v if isinstance(v, bytes) else str(v).encode() for v in out)


async def test_the_prefix_cache_salt_is_not_in_redis_and_needs_the_pepper(
    store: TenantStore,
) -> None:
    """The salt every engine request of a tenant carries (its prefix-cache isolation) was
    stored in the tenant record as it is. Now Redis holds a random value and the salt is
    HMAC(pepper, it), as key hashes are: a Redis dump alone does not give it."""
    from steergate.gateway.admission.request_scoping import combined_salt

    t = await store.create("acme")
    secret = store.salt_secret(t)
    assert secret == store.salt_secret(await store.get("acme"))  # type: ignore[arg-type]
    assert secret != TenantStore(store.redis, "another-pepper").salt_secret(t)
    dump = await _everything_in(store.redis)
    for value in (secret, combined_salt(secret, None)):
        assert value.encode() not in dump
    stored = t.cache_salt.get_secret_value()
    assert stored.encode() in dump and combined_salt(stored, None) != combined_salt(secret, None)


async def test_unknown_malformed_and_revoked_keys_resolve_to_none(store: TenantStore) -> None:
    await store.create("acme")
    key_id, key, _ = await store.create_key("acme")
    assert await store.resolve_key("sk-sg-" + "A" * 43) is None
    assert await store.resolve_key("not-a-key") is None
    assert await store.resolve_key(key) is not None
    assert await store.revoke_key(key_id) == "acme"
    assert await store.resolve_key(key) is None
    assert await store.revoke_key(key_id) is None


async def test_cache_salt_is_never_in_the_public_dump(store: TenantStore) -> None:
    t = await store.create("acme", name="Acme")
    assert "cache_salt" not in t.model_dump() and "cache_salt" not in t.model_dump_json()
    again = await store.get("acme")
    assert (
        again is not None and again.cache_salt.get_secret_value() == t.cache_salt.get_secret_value()
    )


async def test_duplicate_tenant_is_409_and_bad_id_is_400(store: TenantStore) -> None:
    await store.create("acme")
    with pytest.raises(APIError) as e:
        await store.create("acme")
    assert e.value.status == 409
    with pytest.raises(APIError) as e:
        await store.create("Bad_ID")
    assert e.value.status == 400


async def test_overcommit_is_allowed_by_default(redis_url: str) -> None:
    client = aredis_client(redis_url)
    store = TenantStore(client, PEPPER, engine_caps=lambda: (20, 10_000))
    await store.create("a", limits={"latch_count": 100, "latch_bytes": 50_000})
    await store.create("b", limits={"latch_count": 100})
    assert [t.id for t in await store.list()] == ["a", "b"]
    await client.aclose()


async def test_refuse_overcommit_is_409_unless_allowed(redis_url: str) -> None:
    client = aredis_client(redis_url)
    store = TenantStore(
        client, PEPPER, engine_caps=lambda: (20, 10_000), refuse_overcommit=True
    )
    await store.create("a", limits={"latch_count": 10, "latch_bytes": 5000})
    await store.create("b", limits={"latch_count": 10, "latch_bytes": 5000})
    with pytest.raises(APIError) as e:
        await store.create("c", limits={"latch_count": 1, "latch_bytes": 0})
    assert e.value.status == 409
    with pytest.raises(APIError) as e:
        await store.update("b", {"limits": {"latch_bytes": 5001}})
    assert e.value.status == 409
    await store.update("b", {"limits": {"latch_count": 5}})  # lowering is always fine
    await store.create("c", limits={"latch_count": 5, "latch_bytes": 0})
    await store.create("d", limits={"latch_count": 99}, allow_overcommit=True)
    assert [t.id for t in await store.list()] == ["a", "b", "c", "d"]
    await client.aclose()


async def test_update_merges_partial_limits_and_rejects_bad_values(store: TenantStore) -> None:
    await store.create("acme", limits=Limits(rpm=5))
    t = await store.update("acme", {"limits": {"tpm": 77}, "name": "New"})
    assert (t.limits.rpm, t.limits.tpm, t.name) == (5, 77, "New")
    with pytest.raises(APIError) as e:
        await store.update("acme", {"limits": {"rpm": -1}})
    assert e.value.status == 400 and e.value.param == "limits.rpm"


async def test_delete_clears_every_tenant_key_and_calls_engine_cleanup(redis_url: str) -> None:
    client = aredis_client(redis_url)
    seen: list[tuple[str, list[str], list[str]]] = []

    async def cleanup(tid: str, latches: list[str], vectors: list[str]) -> None:
        seen.append((tid, latches, vectors))

    store = TenantStore(client, PEPPER, on_deleted=cleanup)
    await store.create("acme")
    await store.create("other")
    _, key, _ = await store.create_key("acme")
    rotated_id, old, _ = await store.create_key("acme")
    rotated = await store.rotate_key(rotated_id, grace_s=3600)  # old still works for an hour
    assert rotated is not None
    new = rotated[1]
    assert await store.resolve_key(old) is not None
    store.cache.clear()
    await client.zadd(keys.latches("acme"), {"c1": 1})
    await client.hset(keys.vectors("acme"), "calm", "{}")
    await client.hset(keys.usage_minute("acme", int(time.time()) // 60), "requests", 3)
    assert await store.delete("acme") is True
    for secret in (key, old, new):  # a rotated-out secret in its grace too
        assert await store.resolve_key(secret) is None
    left = [k async for k in client.scan_iter(match="*")]
    assert not [k for k in left if "acme" in k], left
    for k in left:  # nor a lookup entry naming it (global keys hold no tenant id)
        assert "acme" not in str(await client.get(k) if await client.type(k) == "string" else "")
    assert seen == [("acme", ["c1"], ["calm"])]
    assert await store.delete("acme") is False
    await client.aclose()


async def test_revocation_reaches_another_replicas_cache_within_1s(redis_url: str) -> None:
    a = TenantStore(aredis_client(redis_url), PEPPER)
    b = TenantStore(aredis_client(redis_url), PEPPER)
    stop = asyncio.Event()
    listener = asyncio.create_task(b.events.listen(stop))
    await a.create("acme")
    key_id, key, _ = await a.create_key("acme")
    await asyncio.sleep(0.3)  # subscription established (it clears the cache once)
    assert (await b.resolve_key(key)) is not None and len(b.cache) == 1
    t0 = time.monotonic()
    await a.revoke_key(key_id)
    while len(b.cache) and time.monotonic() - t0 < 2:
        await asyncio.sleep(0.01)
    elapsed = time.monotonic() - t0
    assert elapsed < 1.0 and await b.resolve_key(key) is None
    stop.set()
    await listener
    await a.redis.aclose()
    await b.redis.aclose()


async def test_the_same_store_works_on_the_embedded_fakeredis() -> None:
    import fakeredis

    store = TenantStore(fakeredis.FakeAsyncRedis(decode_responses=True), PEPPER)
    await store.create("acme")
    _, key, _ = await store.create_key("acme")
    assert (await store.resolve_key(key)).id == "acme"  # type: ignore[union-attr]


class _LosesANode:
    """A real Redis client whose ``nth`` call among ``methods`` fails, as a call to a
    cluster node that was just lost does (the calls before it have happened)."""

    def __init__(self, redis: Any, methods: tuple[str, ...], nth: int = 1) -> None:
        self._redis, self._methods, self._left = redis, methods, nth

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._redis, name)
        if name not in self._methods:
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            self._left -= 1
            if self._left == 0:
                raise redis_exceptions.ConnectionError("node lost")
            return await attr(*args, **kwargs)

        return call


class _ScriptsLost:
    """Scripts whose node was just lost: every call fails."""

    async def run(self, call: Any) -> Any:
        raise redis_exceptions.ConnectionError("node lost")


async def test_a_create_that_fails_between_its_writes_is_completed_by_its_retry(
    store: TenantStore,
) -> None:
    """Found from outside on a cluster failover: the record was written, the index (on
    another node) was not, and the 503's retry was 409. The tenant existed but was never
    listed nor counted in the quota sums. Whichever write comes second fails here."""
    flaky = TenantStore(store.redis, PEPPER)
    flaky.scripts = _ScriptsLost()  # type: ignore[assignment]
    with pytest.raises(APIError) as failed:
        await flaky.create("acme")
    assert failed.value.code == "store_unavailable"
    assert [t.id for t in await store.list()] == []  # half-made: not a tenant to readers
    await store.create("acme")  # the retry: 201, not 409
    assert [t.id for t in await store.list()] == ["acme"]


async def test_a_revoke_that_fails_midway_has_stopped_the_key_and_its_retry_is_204(
    store: TenantStore,
) -> None:
    """Found from outside on a cluster failover: the revoke's last step (telling the
    other replicas) failed, so it answered 503 with the key already gone, and its retry
    answered 404 (the replicas were never told). Now the key stops authenticating at the
    first attempt, and the retry finishes the revoke: 204, and the replicas are told."""
    await store.create("acme")
    key_id, key, _ = await store.create_key("acme")
    rotated, new_key = await store.rotate_key(key_id, grace_s=3600)  # type: ignore[misc]
    flaky = TenantStore(_LosesANode(store.redis, ("publish",)), PEPPER)  # type: ignore[arg-type]
    with pytest.raises(APIError) as failed:
        await flaky.revoke_key(key_id)
    assert failed.value.code == "store_unavailable"
    assert await store.resolve_key(key) is None  # the secret in its grace: stopped
    assert await store.resolve_key(new_key) is None
    told = store.redis.pubsub()
    await told.subscribe(keys.EVENTS_CHANNEL)
    await told.get_message(timeout=1)  # the subscription's confirmation
    assert await store.revoke_key(key_id) == "acme"  # the retry: 204
    message = await told.get_message(timeout=2)
    assert message is not None and message["data"] == f"key:{key_id}"
    await told.aclose()
    assert await store.revoke_key(key_id) is None  # revoked: now it is gone (404)


@pytest.mark.parametrize("step", ["hgetall", "srem", "publish"])
async def test_a_tenant_delete_that_fails_midway_is_finished_by_its_retry(
    redis_url: str, step: str
) -> None:
    """Found from outside: the record went first, so a delete whose later step failed
    (a cluster node lost) answered 503 and its retry 404, with the tenant's keys,
    vectors and latches left in Redis, the replicas never told and the engines never
    cleaned. Now the record is put back and the retry does the whole delete."""
    client = aredis_client(redis_url)
    seen: list[str] = []

    async def cleanup(tid: str, latches: list[str], vectors: list[str]) -> None:
        seen.append(tid)

    store = TenantStore(client, PEPPER, on_deleted=cleanup)
    await store.create("acme")
    _, key, _ = await store.create_key("acme")
    await client.hset(keys.vectors("acme"), "calm", "{}")
    flaky = TenantStore(_LosesANode(client, (step,)), PEPPER, on_deleted=cleanup)  # type: ignore[arg-type]
    with pytest.raises(APIError) as failed:
        await flaky.delete("acme")
    assert failed.value.code == "store_unavailable" and seen == []
    assert await store.delete("acme") is True  # the retry: 204, not 404
    assert seen == ["acme"]
    store.cache.clear()
    assert await store.resolve_key(key) is None
    assert not [k async for k in client.scan_iter(match="*acme*")]
    await client.aclose()


async def test_a_tenant_created_again_over_what_a_failed_delete_left_starts_empty(
    store: TenantStore,
) -> None:
    """Found from outside: a delete that failed midway and was never retried (or could
    not put its record back) left the tenant's keys and vectors, and a tenant created
    again with the id listed them. The create now clears them in the same call."""
    await store.create("acme")
    old_key_id, _, _ = await store.create_key("acme")
    await store.redis.hset(keys.vectors("acme"), "calm", "{}")
    await store.redis.delete(keys.tenant_record("acme"))  # what the failed delete left
    await store.create("acme")
    assert await store.list_keys("acme") == []
    assert await store.redis.hkeys(keys.vectors("acme")) == []
    with pytest.raises(APIError) as taken:  # and the id is still unique
        await store.create("acme")
    assert taken.value.code == "tenant_exists"


async def test_a_create_during_a_delete_of_its_id_survives_it(store: TenantStore) -> None:
    """Found from outside: a create landing between the delete's taking the record and
    its removing the rest answered 201, then the delete removed the new record and its
    index entry, so the tenant was gone."""
    await store.create("acme")
    real_zrange = store.redis.zrange

    async def create_meanwhile(*args: Any, **kwargs: Any) -> Any:
        await store.create("acme", name="new")
        return await real_zrange(*args, **kwargs)

    store.redis.zrange = create_meanwhile  # type: ignore[method-assign]
    try:
        assert await store.delete("acme") is True
    finally:
        del store.redis.zrange
    assert (await store.require("acme")).name == "new"
    assert [t.id for t in await store.list()] == ["acme"]


@pytest.mark.parametrize("step", ["set", "publish", "audit"])
async def test_a_rotation_that_fails_after_its_swap_leaves_the_secret_in_use_working(
    store: TenantStore, step: str
) -> None:
    """Found from outside: a rotation whose step after the swap failed answered 503 with
    the new secret unseen; its retry took that secret for the current one, gave it the
    grace, and stopped the secret every client used at once. Now the key goes back to
    how it was, and the retry rotates from the secret in use. ``audit``: the route's
    audit entry, the rotation's last step, failed."""
    await store.create("acme")
    key_id, key, _ = await store.create_key("acme")

    async def audit_lost(info: Any) -> None:
        raise APIError("store_unavailable", "the audit stream's node was lost")

    # ``set``: the first after the swap is the old secret's grace (the one before it is
    # the new secret's entry, written before the swap).
    methods = () if step == "audit" else (step,)
    flaky = TenantStore(_LosesANode(store.redis, methods, nth=2 if step == "set" else 1), PEPPER)  # type: ignore[arg-type]
    with pytest.raises(APIError) as failed:
        await flaky.rotate_key(key_id, 3600, recorded=audit_lost if step == "audit" else None)
    assert failed.value.code == "store_unavailable"
    store.cache.clear()
    match = await store.resolve(key)
    assert match is not None and match.valid_until is None  # as before: no grace begun
    rotated = await store.rotate_key(key_id, grace_s=3600)  # the retry
    assert rotated is not None
    store.cache.clear()
    match = await store.resolve(key)
    assert match is not None and match.valid_until is not None  # now in its grace
    assert await store.resolve_key(rotated[1]) is not None


async def test_an_admin_key_revoke_that_fails_midway_is_finished_by_its_retry(
    store: TenantStore,
) -> None:
    """Found from outside: the row went first, so a revoke whose telling the replicas
    failed answered 503 and its retry 404; the other replicas kept the key cached."""
    admin, raw = await store.create_admin_key("viewer")
    flaky = TenantStore(_LosesANode(store.redis, ("publish",)), PEPPER)  # type: ignore[arg-type]
    with pytest.raises(APIError) as failed:
        await flaky.revoke_admin_key(admin.key_id)
    assert failed.value.code == "store_unavailable"
    store.cache.clear()
    assert await store.resolve_admin(raw) is None  # stopped at the first attempt
    told = store.redis.pubsub()
    await told.subscribe(keys.EVENTS_CHANNEL)
    await told.get_message(timeout=1)
    assert await store.revoke_admin_key(admin.key_id) is not None  # the retry: 204
    message = await told.get_message(timeout=2)
    assert message is not None and message["data"] == f"key:{admin.key_id}"
    await told.aclose()
    assert await store.revoke_admin_key(admin.key_id) is None


async def test_an_update_names_the_record_it_merged_into_not_one_read_before(
    store: TenantStore, redis_url: str
) -> None:
    """Found from outside: the audit entry of ``PATCH /admin/tenants/{id}`` diffed against
    a record read before the update ran, so a PATCH by another admin that landed in
    between was listed as this one's change. ``update_from`` gives the record the patch
    was merged into, and the route diffs against it."""
    await store.create("acme", limits={"rpm": 10, "tpm": 100})
    other = TenantStore(aredis_client(redis_url), PEPPER)
    real_get = store.redis.get

    async def other_patch_lands_first(*args: Any, **kwargs: Any) -> Any:
        store.redis.get = real_get  # type: ignore[method-assign]
        await other.update("acme", {"limits": {"tpm": 777}})
        return await real_get(*args, **kwargs)

    store.redis.get = other_patch_lands_first  # type: ignore[method-assign]
    try:
        before, after = await store.update_from("acme", {"limits": {"rpm": 5}})
    finally:
        store.redis.get = real_get  # type: ignore[method-assign]
        await other.redis.aclose()
    assert (before.limits.rpm, before.limits.tpm) == (10, 777)
    assert (after.limits.rpm, after.limits.tpm) == (5, 777)
