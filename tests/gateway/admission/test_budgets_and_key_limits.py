"""Issue 13, enforcement: token budgets and per-key limits decided inside the one
admission script (steergate/gateway/store/lua/admit_request.lua), and the daily/monthly rollups
settlement writes (billing: prompt/completion split, 429s by cause, per key).

Against a real Redis; two Limiter instances on two connections stand for two gateway
replicas (the script is the only place the decision is made)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from steergate.gateway.admission.limits import Limiter, period_left_ms
from steergate.gateway.admission.settlement import Outcome, Settler
from steergate.gateway.store import key_names as keys
from steergate.gateway.store.connection import connect
from steergate.gateway.store.scripts import Scripts
from steergate.gateway.tenancy.tenants import TenantStore
from steergate.shared.errors import APIError
from tests.gateway.conftest import make_tenant
from tests.harness import redis_client


def api_key(key_id: str, rpm: int | None = None, conc: int | None = None) -> Any:
    return SimpleNamespace(key_id=key_id, limits=SimpleNamespace(rpm=rpm, max_concurrency=conc))


async def _replicas(redis_url: str, n: int = 2) -> tuple[list[Any], list[Limiter], TenantStore]:
    clients = [connect(redis_url, 2.0) for _ in range(n)]
    limiters = [Limiter(Scripts.load(c), lease_ttl_s=60) for c in clients]
    return clients, limiters, TenantStore(clients[0], "pepper")


async def _admit(limiter: Limiter, tenant: Any, key: Any) -> int:
    try:
        await limiter.admit_plain(tenant, key)
        return 200
    except APIError as exc:
        return exc.status * 1000 + (1 if exc.code == "rate_limit_exceeded" else 2)


async def test_per_key_rpm_is_exact_across_two_replicas_and_leaves_the_tenant_alone(
    redis_url: str,
) -> None:
    clients, (a, b), store = await _replicas(redis_url)
    try:
        tenant = await store.create("acme", limits={"rpm": 1000, "max_concurrency": 1000})
        limited = api_key("k-limited", rpm=7)
        results = await asyncio.gather(*(_admit((a, b)[i % 2], tenant, limited) for i in range(40)))
        assert results.count(200) == 7 and results.count(429001) == 33, results
        # another key of the same tenant is not held back by that key's limit
        other = await asyncio.gather(*(_admit(a, tenant, api_key("k-other")) for _ in range(10)))
        assert other == [200] * 10
    finally:
        for c in clients:
            await c.aclose()


async def test_the_limit_header_is_the_tighter_of_the_tenants_and_the_keys_rpm(
    redis_url: str,
) -> None:
    """Found from outside: a key with rpm 5 under a tenant with rpm 10 was told
    "limit 10, remaining 0" after its 5th request (the remaining figure was the key's)."""
    clients, (a, _), store = await _replicas(redis_url)
    try:
        tenant = await store.create("acme", limits={"rpm": 10, "max_concurrency": 100})
        seen = []
        for _ in range(5):
            admission = await a.admit_plain(tenant, api_key("k-tight", rpm=5))
            seen.append((admission.headers["x-ratelimit-limit-requests"],
                         admission.headers["x-ratelimit-remaining-requests"]))  # fmt: skip
        assert seen == [("5", str(n)) for n in (4, 3, 2, 1, 0)]
        loose = await a.admit_plain(tenant, api_key("k-loose", rpm=50))
        assert loose.headers["x-ratelimit-limit-requests"] == "10"  # the tenant's is tighter
        plain = await a.admit_plain(tenant, api_key("k-none"))
        assert plain.headers["x-ratelimit-limit-requests"] == "10"
    finally:
        for c in clients:
            await c.aclose()


async def test_per_key_concurrency_is_exact_and_released_by_settlement(redis_url: str) -> None:
    clients, (a, b), store = await _replicas(redis_url)
    settler = Settler(clients[0], Scripts.load(clients[0]))
    try:
        tenant = await store.create("acme", limits={"rpm": 10_000, "max_concurrency": 1000})
        key = api_key("k-conc", conc=3)
        admitted: list[Any] = []

        async def one(limiter: Limiter) -> None:
            try:
                admitted.append(await limiter.admit_plain(tenant, key))
            except APIError as exc:
                assert exc.code == "concurrency_limit_exceeded"
                assert "API key" in exc.message

        await asyncio.gather(*(one((a, b)[i % 2]) for i in range(12)))
        assert len(admitted) == 3
        assert all(x.key_id == "k-conc" for x in admitted)
        # settling one frees exactly one slot for the key
        await settler._settle([Outcome(admitted[0], 200, 5, None, prompt_tokens=2)])
        await asyncio.gather(*(one(a) for _ in range(4)))
        assert len(admitted) == 4
    finally:
        for c in clients:
            await c.aclose()


async def test_a_lost_settlement_does_not_hold_the_keys_slot_past_the_lease(
    redis_url: str,
) -> None:
    client = connect(redis_url, 2.0)
    try:
        store = TenantStore(client, "pepper")
        limiter = Limiter(Scripts.load(client), lease_ttl_s=3)
        tenant = await store.create("acme", limits={"rpm": 10_000, "max_concurrency": 1000})
        key = api_key("k1", conc=1)
        assert await _admit(limiter, tenant, key) == 200
        assert await _admit(limiter, tenant, key) != 200  # held, never settled
        await asyncio.sleep(3.2)  # the tenant lease expired: the key's slot comes back
        assert await _admit(limiter, tenant, key) == 200
    finally:
        await client.aclose()


async def test_token_budget_refuses_until_the_period_rolls_over(redis_url: str) -> None:
    client = connect(redis_url, 2.0)
    try:
        store = TenantStore(client, "pepper")
        limiter = Limiter(Scripts.load(client), lease_ttl_s=60)
        settler = Settler(client, Scripts.load(client))
        tenant = await store.create(
            "acme",
            limits={"rpm": 10_000, "token_budget": {"tokens": 100, "period": "day"}},
        )
        spent = 0
        while spent < 100:
            adm = await limiter.admit_plain(tenant, api_key("k1"))
            await settler._settle([Outcome(adm, 200, 30, None, prompt_tokens=10)])
            spent += 30
        with pytest.raises(APIError) as refused:
            await limiter.admit_plain(tenant, api_key("k1"))
        err = refused.value
        assert err.status == 429 and err.code == "budget_exceeded"
        assert err.headers["x-should-retry"] == "false"
        left_s = period_left_ms(int(time.time() * 1000), "day") / 1000
        assert abs(int(err.headers["retry-after"]) - left_s) <= 2
        # the month rollup is not today's: a month budget of the same size is not spent
        # by yesterday's traffic (here: a fresh tenant's month hash holds only today)
        day = await client.hgetall(keys.usage_day("acme", keys.utc_day(time.time())))
        assert int(day["tokens"]) == spent and int(day["429:budget"]) == 1
        assert int(day["prompt_tokens"]) == 10 * (spent // 30)
        assert int(day["completion_tokens"]) == 20 * (spent // 30)
        assert int(day["k:k1:429:budget"]) == 1
    finally:
        await client.aclose()


async def _admit_tokens(limiter: Limiter, tenant: Any, tokens: int) -> Any:
    """An inference admission reserving ``tokens``: the admission, or the refusal's code."""
    try:
        return await limiter.admit(
            tenant, tokens=tokens, conversation_id=None, latch=False, latch_bytes=0,
            latch_kind="ref", api_key=api_key("k1"),
        )  # fmt: skip
    except APIError as exc:
        return exc.code


async def test_a_burst_cannot_overshoot_the_token_budget_by_the_requests_in_flight(
    redis_url: str,
) -> None:
    """40 admissions at once through two replicas, 30 tokens reserved each, a budget of
    100: the reservations of the running ones count, so 4 pass (0, 30, 60 and 90 held
    before each), not all 40. They used to: only settled tokens were compared."""
    clients, (a, b), store = await _replicas(redis_url)
    settler = Settler(clients[0], Scripts.load(clients[0]))
    try:
        tenant = await store.create(
            "acme",
            limits={
                "rpm": 10_000, "tpm": 100_000, "max_concurrency": 1000,
                "token_budget": {"tokens": 100, "period": "day"},
            },
        )  # fmt: skip
        got = await asyncio.gather(*(_admit_tokens((a, b)[i % 2], tenant, 30) for i in range(40)))
        admitted = [g for g in got if not isinstance(g, str)]
        assert len(admitted) == 4 and got.count("budget_exceeded") == 36, got
        assert int(await clients[0].get(keys.budget_held("acme"))) == 120
        # Settled at what they used (10 each): the budget has 60 left, nothing is held.
        await settler._settle([Outcome(adm, 200, 10, None, prompt_tokens=5) for adm in admitted])
        assert await clients[0].get(keys.budget_held("acme")) is None
        again = await asyncio.gather(*(_admit_tokens(a, tenant, 30) for _ in range(5)))
        assert sum(not isinstance(g, str) for g in again) == 2  # 40 spent: 40 + 0, 40 + 30
        # A tenant without a budget holds nothing.
        free = await store.create("free", limits={"rpm": 10_000, "max_concurrency": 1000})
        assert not isinstance(await _admit_tokens(a, free, 30), str)
        assert await clients[0].exists(keys.budget_held("free")) == 0
    finally:
        for c in clients:
            await c.aclose()


async def test_tokens_held_by_a_request_whose_settlement_is_lost_come_back_when_it_expires(
    redis_url: str,
) -> None:
    """A gateway that dies mid-request never settles: its lease expires after one TTL,
    and the next admission gives its reservation back to the budget."""
    client = connect(redis_url, 2.0)
    try:
        limiter = Limiter(Scripts.load(client), lease_ttl_s=2)  # no settler: no heartbeat
        tenant = await TenantStore(client, "pepper").create(
            "acme",
            limits={"rpm": 10_000, "token_budget": {"tokens": 100, "period": "day"}},
        )
        lost = await _admit_tokens(limiter, tenant, 100)
        assert not isinstance(lost, str)
        assert await _admit_tokens(limiter, tenant, 1) == "budget_exceeded"
        await asyncio.sleep(2.3)
        assert not isinstance(await _admit_tokens(limiter, tenant, 1), str)
        assert int(await client.get(keys.budget_held("acme"))) == 1
        assert 0 < await client.pttl(keys.budget_held("acme")) <= 3_000  # lives with its leases
    finally:
        await client.aclose()


async def test_the_heartbeat_gives_back_tokens_of_a_finished_request_never_settled(
    redis_url: str,
) -> None:
    """A finished request's lease waits in the finished set for its settlement; if that
    is lost, the lease expires there. With no admission coming, the heartbeat of the
    tenant's running requests (renew_leases.lua) sweeps it and gives its tokens back."""
    client = connect(redis_url, 2.0)
    try:
        scripts = Scripts.load(client)
        settler = Settler(client, scripts, lease_ttl_s=2)
        limiter = Limiter(scripts, lease_ttl_s=2, settler=settler)
        tenant = await TenantStore(client, "pepper").create(
            "acme",
            limits={"rpm": 10_000, "token_budget": {"tokens": 100, "period": "day"}},
        )
        lost, running = [await _admit_tokens(limiter, tenant, n) for n in (50, 10)]
        settler.leases.release(lost)  # its answer ended; its settlement never comes
        settler.leases.finish(lost)
        await _admit_tokens(limiter, tenant, 1)  # moves it to the finished set
        assert await client.zscore(keys.leases_done("acme"), lost.lease_id) is not None
        assert int(await client.get(keys.budget_held("acme"))) == 61
        await asyncio.sleep(1.0)
        await settler.leases.renew()  # the running ones stay
        await asyncio.sleep(1.3)  # the lost lease has expired; no admission since
        await settler.leases.renew()
        assert int(await client.get(keys.budget_held("acme"))) == 11
        assert await client.zscore(keys.leases_done("acme"), lost.lease_id) is None
        assert await client.zscore(keys.leases("acme"), running.lease_id) is not None
    finally:
        await client.aclose()


def test_period_left_rolls_at_utc_midnight_and_month_start() -> None:
    # 2026-12-31 23:59:00 UTC
    now = 1798761540 * 1000
    assert period_left_ms(now, "day") == 60_000
    assert period_left_ms(now, "month") == 60_000
    # 2026-02-10 00:00:00 UTC -> March 1st
    feb10 = 1770681600 * 1000
    assert period_left_ms(feb10, "month") == 19 * 86_400_000


def test_rollups_through_the_gateway_split_tokens_count_refusals_by_cause_and_key(
    start_gateway: Any, redis_url: str
) -> None:
    gateway = start_gateway()
    key = make_tenant(redis_url, "bill", rpm=4, max_concurrency=100)
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    got: list[httpx.Response] = []
    for i in range(6):
        stream = i % 2 == 1
        got.append(
            httpx.post(
                gateway.url + "/v1/chat/completions",
                json={**body, "stream": stream, "stream_options": {"include_usage": True}}
                if stream
                else body,
                headers={"Authorization": f"Bearer {key}"},
            )
        )
    codes = [r.status_code for r in got]
    assert codes.count(200) == 4 and codes.count(429) == 2, codes
    prompt = completion = 0
    for r in got:
        if r.status_code != 200:
            continue
        if r.headers["content-type"].startswith("text/event-stream"):
            import orjson

            docs = [
                orjson.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")
            ]
            usage = docs[-1]["usage"]
        else:
            usage = r.json()["usage"]
        prompt += usage["prompt_tokens"]
        completion += usage["completion_tokens"]
    r = redis_client(redis_url)
    day_key = keys.usage_day("bill", keys.utc_day(time.time()))
    deadline = time.monotonic() + 5
    while int(r.hget(day_key, "completion_tokens") or 0) < completion:
        assert time.monotonic() < deadline, r.hgetall(day_key)
        time.sleep(0.05)
    day = r.hgetall(day_key)
    assert int(day["prompt_tokens"]) == prompt and int(day["completion_tokens"]) == completion
    assert int(day["tokens"]) == prompt + completion
    assert int(day["requests"]) == 4 and int(day["2xx"]) == 4 and int(day["429:rpm"]) == 2
    assert r.ttl(day_key) > 399 * 86400
    month = r.hgetall(keys.usage_month("bill", keys.utc_month(time.time())))
    assert int(month["tokens"]) == prompt + completion


async def test_a_cancelled_admission_gives_the_keys_slot_back(redis_url: str) -> None:
    """An admission whose answer never came (the client got 503) is cancelled: its
    tenant lease and its key's lease are both released once Redis answers."""
    client = connect(redis_url, 2.0)
    try:
        store = TenantStore(client, "pepper")
        settler = Settler(client, Scripts.load(client))
        limiter = Limiter(Scripts.load(client), lease_ttl_s=60, settler=settler)
        tenant = await store.create("acme", limits={"rpm": 10_000, "max_concurrency": 1000})
        key = api_key("k1", conc=1)
        adm = await limiter.admit_plain(tenant, key)
        assert await _admit(limiter, tenant, key) != 200  # the key's one slot is held
        stop = asyncio.Event()
        runner = asyncio.create_task(settler.run(stop))
        settler.cancel(adm)
        await settler.drain()
        stop.set()
        await runner
        assert await _admit(limiter, tenant, key) == 200
    finally:
        await client.aclose()


def test_a_burst_of_short_chat_requests_reserves_what_the_chat_template_adds(
    start_gateway: Any, redis_url: str
) -> None:
    """Found from outside: 60 chat requests of "hi" with max_tokens 1 at once, against a
    budget of 60 tokens, each reserved 2 tokens (1 for the prompt, 1 completion) while
    the engine charged several times that: 30 were admitted and 180 tokens used. A chat
    template adds 30 tokens to one message on SmolLM2; the reservation now counts them
    (24 + 6 per message), so the burst stops at two (0 and 32 held before each)."""
    gateway = start_gateway()
    key = make_tenant(redis_url, "burst", rpm=10_000, max_concurrency=1000,
                      token_budget={"tokens": 60, "period": "day"})  # fmt: skip
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "fake_delay": 0.5}  # fmt: skip

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            got = await asyncio.gather(*(
                client.post(gateway.url + "/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"})
                for _ in range(60)
            ))  # fmt: skip
        return [r.status_code for r in got]

    codes = asyncio.run(burst())
    assert codes.count(200) == 2 and codes.count(429) == 58, codes
