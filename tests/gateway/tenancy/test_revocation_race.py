"""Issue 9 item 7, as the attack: a key revoked on one replica while another replica is
between its Redis read and its cache write must not live on in that replica's cache
(before the fix: accepted for the cache's whole 30 s, 1 in 40-60 tries). The contract
is revocation everywhere within 1 s, always."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

import httpx

from steergate.gateway.store import key_names as keys
from steergate.gateway.tenancy import api_keys as apikeys
from steergate.gateway.tenancy.tenants import TenantStore
from tests.gateway.conftest import ADMIN_KEY, PEPPER
from tests.gateway.servers import ServerThread

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROBE = "/v1/steering/latches"  # cheap, and needs a tenant key


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def new_tenant(gw: ServerThread, tenant_id: str) -> None:
    r = httpx.post(
        gw.url + "/admin/tenants",
        headers=ADMIN,
        json={"id": tenant_id, "limits": {"rpm": 10**9, "tpm": 10**9, "max_concurrency": 1000},
              "allow_overcommit": True},
    )
    assert r.status_code == 201, r.text


def new_key(gw: ServerThread, tenant_id: str) -> tuple[str, str]:
    r = httpx.post(gw.url + f"/admin/tenants/{tenant_id}/keys", headers=ADMIN, json={})
    assert r.status_code == 201, r.text
    return r.json()["key_id"], r.json()["key"]


def test_revocation_between_read_and_cache_write_is_not_cached(
    start_gateway: Callable[..., ServerThread],
) -> None:
    """Deterministic: replica B reads the key from Redis, then (before B caches it)
    the admin revokes it on replica A and B's listener applies the drop; then B's
    cache write happens. The in-flight request was read before the revocation, so it
    may pass; the next one must be 401."""
    a, b = start_gateway(), start_gateway()
    new_tenant(a, "acme")
    key_id, key = new_key(a, "acme")
    tenants: TenantStore = b.app.state.tenants
    lookup = keys.key_lookup(apikeys.hash_key(PEPPER, key))
    real_get = tenants.redis.get
    injected: list[str] = []

    async def get_then_revoke(name: Any, *args: Any, **kw: Any) -> Any:
        value = await real_get(name, *args, **kw)
        if name == lookup and not injected:
            injected.append(value)
            before = tenants.cache.generation
            async with httpx.AsyncClient() as client:
                r = await client.delete(a.url + f"/admin/keys/{key_id}", headers=ADMIN)
            assert r.status_code == 204
            deadline = time.monotonic() + 2
            while tenants.cache.generation == before and time.monotonic() < deadline:
                await asyncio.sleep(0.005)  # B's listener applies the revocation
            assert tenants.cache.generation != before, "B never saw the revocation"
        return value

    tenants.redis.get = get_then_revoke  # type: ignore[method-assign]
    try:
        first = httpx.get(b.url + PROBE, headers=bearer(key), timeout=10)
    finally:
        tenants.redis.get = real_get  # type: ignore[method-assign]
    assert injected and injected[0], "the hook did not run on B's key lookup"
    assert first.status_code == 200  # read before the revocation: linearizable
    assert len(tenants.cache) == 0
    again = httpx.get(b.url + PROBE, headers=bearer(key), timeout=10)
    assert again.status_code == 401 and again.json()["error"]["code"] == "invalid_api_key"


def test_no_replica_accepts_a_key_1s_after_its_revocation_under_load(
    start_gateway: Callable[..., ServerThread],
) -> None:
    """Two replicas on real Redis pub/sub. Each round, B sees a fresh key for the
    first time (a cache miss: Redis read, then cache write) while A revokes it at a
    random moment around that read. Then every key is used on B again, 1 s after the
    last revocation: every answer must be 401. (Before the fix, a few rounds in 100
    left the revoked key in B's cache for 30 s.)"""
    a, b = start_gateway(), start_gateway()
    new_tenant(a, "acme")
    rounds = 100
    creds = [new_key(a, "acme") for _ in range(rounds)]
    late: list[tuple[int, float, int]] = []
    revoked_at: dict[int, float] = {}

    async def hit(client: httpx.AsyncClient, i: int, key: str, delay: float) -> None:
        await asyncio.sleep(delay)
        started = time.monotonic()
        r = await client.get(b.url + PROBE, headers=bearer(key))
        assert r.status_code in (200, 401), r.text
        if r.status_code == 200 and i in revoked_at and started > revoked_at[i] + 1.0:
            late.append((i, started - revoked_at[i], r.status_code))

    async def revoke(client: httpx.AsyncClient, i: int, key_id: str, delay: float) -> None:
        await asyncio.sleep(delay)
        r = await client.delete(a.url + f"/admin/keys/{key_id}", headers=ADMIN)
        assert r.status_code == 204
        revoked_at[i] = time.monotonic()

    async def hammer() -> None:
        rng = random.Random(9)
        async with httpx.AsyncClient(timeout=10) as client:
            for i, (key_id, key) in enumerate(creds):
                delays = [rng.uniform(0, 0.004) for _ in range(4)]
                await asyncio.gather(
                    revoke(client, i, key_id, rng.uniform(0, 0.004)),
                    *(hit(client, i, key, d) for d in delays),
                )
            # Every key, once more, at least 1 s after its revocation.
            wait = max(revoked_at.values()) + 1.05 - time.monotonic()
            await asyncio.sleep(max(0.0, wait))
            for i, (_, key) in enumerate(creds):
                await hit(client, i, key, 0)

    asyncio.run(hammer())
    assert len(revoked_at) == rounds
    assert not late, f"accepted more than 1 s after revocation: {late[:5]}"
