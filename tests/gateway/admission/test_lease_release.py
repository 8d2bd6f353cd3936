"""Issue 23, defect 3 (the scripts): a finished request stops counting against
concurrency when its answer ends, not when its batched settlement reaches Redis.

The gateway keeps the ids of its finished, not yet settled leases per tenant; the next
admission of that tenant releases them in the same admit_request.lua call. Against a
real Redis; the settlement queue is left unflushed (its loop is not started) to stand
for a settlement lagging under load. The same on the real engine under load:
tests/gateway/e2e/test_e2e_lease_churn.py."""

from __future__ import annotations

from typing import Any

import pytest

from steergate.gateway.admission.limits import Limiter
from steergate.gateway.admission.settlement import Outcome, Settler
from steergate.gateway.store import key_names as keys
from steergate.gateway.store.connection import connect
from steergate.gateway.store.scripts import Scripts
from steergate.gateway.tenancy.tenants import TenantStore
from steergate.shared.errors import APIError
from tests.harness import redis_client


async def _gateway(redis_url: str, ttl_s: float = 60) -> tuple[Any, Settler, Limiter]:
    client = connect(redis_url, 2.0)
    scripts = Scripts.load(client)
    settler = Settler(client, scripts, lease_ttl_s=ttl_s)
    return client, settler, Limiter(scripts, lease_ttl_s=ttl_s, settler=settler)


def _held(redis_url: str, tenant_id: str) -> int:
    return int(redis_client(redis_url).zcount(keys.leases(tenant_id), "(0", "+inf"))


async def test_a_finished_request_frees_its_slot_for_the_next_admission_before_settlement(
    redis_url: str,
) -> None:
    client, settler, limiter = await _gateway(redis_url)
    try:
        tenant = await TenantStore(client, "p").create("acme", limits={"max_concurrency": 2})
        first = [await limiter.admit_plain(tenant, None) for _ in range(2)]
        with pytest.raises(APIError) as refused:
            await limiter.admit_plain(tenant, None)
        assert refused.value.code == "concurrency_limit_exceeded"

        settler.submit(Outcome(first[0], 200, 0, None))  # answered; not flushed
        assert settler.pending() == 1 and _held(redis_url, "acme") == 2
        third = await limiter.admit_plain(tenant, None)  # releases first[0] in the same call
        assert _held(redis_url, "acme") == 2
        r = redis_client(redis_url)
        assert r.zscore(keys.leases("acme"), first[0].lease_id) is None
        assert r.zscore(keys.leases_done("acme"), first[0].lease_id) is not None
        assert 0 < r.pttl(keys.leases_done("acme")) <= 61_000  # gone with its gateway too

        # The late settlement still charges it, exactly once, and empties the set.
        before = r.hget(keys.usage_total("acme"), "2xx")
        await settler._flush(list(settler._pending))  # noqa: SLF001 - the lagging flush
        settler._pending.clear()  # noqa: SLF001
        assert before is None and r.hget(keys.usage_total("acme"), "2xx") == "1"
        assert r.zcard(keys.leases_done("acme")) == 0
        settler.submit(Outcome(first[0], 200, 0, None))  # a resend: nothing counted twice
        await settler._flush(list(settler._pending))  # noqa: SLF001
        assert r.hget(keys.usage_total("acme"), "2xx") == "1"
        assert {a.lease_id for a in (first[1], third)} == set(
            r.zrangebyscore(keys.leases("acme"), "(0", "+inf")
        )
    finally:
        await client.aclose()


async def test_release_is_per_tenant_and_survives_a_refusal(redis_url: str) -> None:
    """A refused admission still releases (the release precedes the count), and a
    tenant's finished leases are released only by its own admissions."""
    client, settler, limiter = await _gateway(redis_url)
    try:
        store = TenantStore(client, "p")
        acme = await store.create("acme", limits={"max_concurrency": 1, "rpm": 1})
        other = await store.create("other", limits={"max_concurrency": 4})
        held = await limiter.admit_plain(acme, None)
        settler.submit(Outcome(held, 200, 0, None))
        await limiter.admit_plain(other, None)
        assert _held(redis_url, "acme") == 1  # another tenant's call did not touch it
        with pytest.raises(APIError) as refused:  # rpm 1 spent: refused, but released
            await limiter.admit_plain(acme, None)
        assert refused.value.code == "rate_limit_exceeded"
        assert _held(redis_url, "acme") == 0
    finally:
        await client.aclose()


async def test_a_gateway_that_dies_before_settling_leaves_nothing_counted_or_kept(
    redis_url: str,
) -> None:
    """Released but never settled (the gateway died): nothing counts against the
    tenant, and the finished set goes with the lease's TTL."""
    client, settler, limiter = await _gateway(redis_url, ttl_s=2)
    try:
        tenant = await TenantStore(client, "p").create("acme", limits={"max_concurrency": 1})
        a = await limiter.admit_plain(tenant, None)
        settler.submit(Outcome(a, 200, 0, None))
        await limiter.admit_plain(tenant, None)  # releases a; this one is never settled
        r = redis_client(redis_url)
        assert r.zcard(keys.leases_done("acme")) == 1
        assert 0 < r.pttl(keys.leases_done("acme")) <= 3_000
    finally:
        await client.aclose()
