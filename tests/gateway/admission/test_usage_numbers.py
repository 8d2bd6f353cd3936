"""steergate/gateway/admission/usage.py against a real Redis and the limiter's own scripts: the
numbers it reports are the ones admission decides on."""

from __future__ import annotations

import time

import pytest

from steergate.gateway.admission import refusals, usage
from steergate.gateway.admission.limits import Limiter
from steergate.gateway.store import key_names as keys
from steergate.gateway.store.scripts import Scripts
from steergate.gateway.tenancy.tenants import TenantStore
from steergate.shared.errors import APIError
from tests.harness import aredis_client

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture()
async def env(redis_url: str):
    client = aredis_client(redis_url)
    store = TenantStore(client, "pepper")
    limiter = Limiter(Scripts.load(client), lease_ttl_s=60)
    yield store, limiter
    await client.aclose()


async def _admit(limiter: Limiter, tenant, **kw):
    args = dict(tokens=10, conversation_id=None, latch=False, latch_bytes=0, latch_kind="value")
    args.update(kw)
    return await limiter.admit(tenant, **args)


async def test_gcra_used_drains_with_time() -> None:
    now = 1_000_000
    assert usage.gcra_used(None, now, 60) == 0
    assert usage.gcra_used(now - 5, now, 60) == 0
    assert usage.gcra_used(now + 3000, now, 60) == 3  # 3 requests at 1 s each
    assert usage.gcra_used(now + 3001, now, 60) == 4
    assert usage.gcra_used(now + 10**9, now, 60) == 60  # never above the limit


async def test_requests_per_minute_used_reaches_the_limit_exactly_when_admission_refuses(
    env,
) -> None:
    store, limiter = env
    tenant = await store.create("acme", limits={"rpm": 3, "max_concurrency": 10})
    for expected in (1, 2, 3):
        await _admit(limiter, tenant)
        row = await usage.read_usage(store.redis, tenant, usage.now_ms())
        assert row.quotas["requests_per_minute"].used == expected
        assert row.quotas["concurrency"].used == expected  # leases are still held
    with pytest.raises(APIError) as refused:
        await _admit(limiter, tenant)
    assert refused.value.status == 429
    row = await usage.read_usage(store.redis, tenant, usage.now_ms())
    assert row.quotas["requests_per_minute"] == usage.QuotaUse(used=3, limit=3)
    assert row.responses["429"] == 1 and row.responses["2xx"] == 0
    assert row.history is not None and row.history[-1].requests == 3
    assert row.history[-1].counts["429"] == 1


async def test_history_is_60_minutes_oldest_first_and_reads_older_minutes(env) -> None:
    store, _ = env
    tenant = await store.create("acme")
    now = usage.now_ms()
    minute = now // 60000
    await store.redis.hset(
        keys.usage_minute("acme", minute - 30),
        mapping={"requests": 7, "tokens": 70, "2xx": 6, "5xx": 1},
    )
    await store.redis.hset(
        keys.usage_minute("acme", minute - 61), mapping={"requests": 99}
    )  # outside
    row = await usage.read_usage(store.redis, tenant, now)
    assert row.history is not None and len(row.history) == 60
    assert [h.minute for h in row.history] == [(minute - 59 + i) * 60 for i in range(60)]
    assert row.history[29].requests == 7 and row.history[29].tokens == 70
    assert row.responses == {"2xx": 6, "4xx": 0, "429": 0, "5xx": 1}
    assert sum(h.requests for h in row.history) == 7


async def test_latches_and_vectors_come_from_the_quota_keys(env) -> None:
    store, limiter = env
    tenant = await store.create("acme", limits={"latch_count": 4, "latch_bytes": 4096})
    await _admit(limiter, tenant, conversation_id="c1", latch=True, latch_bytes=1024)
    await _admit(limiter, tenant, conversation_id="c2", latch=True, latch_bytes=2048)
    await store.redis.hset(
        keys.vectors("acme"),
        mapping={
            "calm": '{"digest":"x","bytes":512,"layers":[1],"hook":"post_block"}',
            "sad": '{"digest":"y","bytes":256,"layers":[2],"hook":"post_block"}',
        },
    )
    row = await usage.read_usage(store.redis, tenant, usage.now_ms(), history=False)
    q = row.quotas
    assert (q["latch_count"].used, q["latch_bytes"].used) == (2, 3072)
    assert (q["vector_count"].used, q["vector_bytes"].used) == (2, 768)
    assert row.history is None


async def test_rejections_by_cause_and_unattributed_remainder(env) -> None:
    store, limiter = env
    tenant = await store.create("acme", limits={"rpm": 1})
    await _admit(limiter, tenant)
    for _ in range(2):
        with pytest.raises(APIError):
            await _admit(limiter, tenant)
    await usage.record_rejection(store.redis, "acme", refusals.BY_CAUSE["rpm"], usage.now_ms())
    row = await usage.read_usage(store.redis, tenant, usage.now_ms())
    assert row.rejections["rate_limit_exceeded"] == 1
    assert row.rejections["unattributed"] == 1  # counted by the limiter, cause not recorded
    assert row.responses["429"] == 2


async def test_usage_of_one_tenant_ignores_another(env) -> None:
    store, limiter = env
    a = await store.create("a", limits={"latch_count": 8, "latch_bytes": 8192})
    b = await store.create("b", limits={"latch_count": 8, "latch_bytes": 8192})
    await _admit(limiter, a, conversation_id="c", latch=True, latch_bytes=4096)
    row = await usage.read_usage(store.redis, b, int(time.time() * 1000))
    assert row.quotas["latch_count"].used == 0 and row.quotas["requests_per_minute"].used == 0
