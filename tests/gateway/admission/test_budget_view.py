"""The ``budget`` object of ``GET /v1/usage``: a tenant's ``limits.token_budget`` with
the tokens used in the current UTC day or month (the rollup hash the budget reads),
what remains and when the period rolls over."""

from __future__ import annotations

import calendar
import time
from typing import Any

import httpx
import pytest

from steergate.gateway.admission import usage
from steergate.gateway.store import key_names as keys
from steergate.gateway.tenancy.tenants import TenantStore
from tests.gateway.conftest import make_tenant
from tests.gateway.ops_env import bearer, chat_body
from tests.gateway.servers import ServerThread
from tests.harness import aredis_client, redis_client, wait_for


def ms(y: int, mo: int, d: int, h: int = 0, mi: int = 0, s: int = 0) -> int:
    return calendar.timegm((y, mo, d, h, mi, s)) * 1000


def test_budget_period_keys_and_reset_times() -> None:
    now = ms(2026, 12, 3, 6, 57, 15)
    day = keys.utc_day(now / 1000)
    assert usage.budget_period("acme", "day", now) == (
        keys.usage_day("acme", day),
        ms(2026, 12, 4) // 1000,
    )
    assert day == (ms(2026, 12, 3) // 1000) // 86400
    # December rolls over into January of the next year.
    assert usage.budget_period("acme", "month", now) == (
        keys.usage_month("acme", 2026 * 12 + 11),
        ms(2027, 1, 1) // 1000,
    )
    assert usage.budget_period("acme", "month", ms(2028, 2, 29, 23, 59, 59)) == (
        keys.usage_month("acme", 2028 * 12 + 1),
        ms(2028, 3, 1) // 1000,
    )
    # The last millisecond of a day is still that day; the next one is the next day.
    assert usage.budget_period("acme", "day", ms(2026, 12, 4) - 1)[1] == ms(2026, 12, 4) // 1000
    assert usage.budget_period("acme", "day", ms(2026, 12, 4))[1] == ms(2026, 12, 5) // 1000


@pytest.mark.asyncio(loop_scope="session")
async def test_read_usage_reads_the_day_or_month_rollup(redis_url: str) -> None:
    client = aredis_client(redis_url)
    try:
        store = TenantStore(client, "pepper")
        now = usage.now_ms()
        daily = await store.create(
            "daily", limits={"token_budget": {"tokens": 1000, "period": "day"}}
        )
        monthly = await store.create(
            "monthly", limits={"token_budget": {"tokens": 500, "period": "month"}}
        )
        plain = await store.create("plain")
        day_key, day_reset = usage.budget_period("daily", "day", now)
        month_key, month_reset = usage.budget_period("monthly", "month", now)
        await client.hset(day_key, mapping={"tokens": 321, "requests": 4, "k:key_x:tokens": 999})
        await client.hset(month_key, mapping={"tokens": 640})
        # Another period's hash (yesterday, last month) is not this period's use.
        await client.hset(keys.usage_day("daily", keys.utc_day(now / 1000) - 1), "tokens", 50)

        row = await usage.read_usage(client, daily, now)
        assert row.budget == usage.BudgetUse(
            tokens=1000, period="day", used=321, remaining=679, resets_at=day_reset
        )
        row = await usage.read_usage(client, monthly, now, history=False)
        assert row.budget == usage.BudgetUse(
            tokens=500, period="month", used=640, remaining=0, resets_at=month_reset
        )  # overspent (the last request's tokens are known only after it ran): 0 left
        assert (await usage.read_usage(client, plain, now)).budget is None
        # The rest of the answer is unchanged by the extra read.
        assert row.history is None
        assert len((await usage.read_usage(client, daily, now)).history or []) == 60
    finally:
        await client.aclose()



def my_usage(url: str, key: str) -> dict[str, Any]:
    r = httpx.get(url + "/v1/usage", headers=bearer(key), timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_v1_usage_shows_the_budget_or_null(gateway: ServerThread, redis_url: str) -> None:
    key = make_tenant(redis_url, "acme", token_budget={"tokens": 50_000, "period": "month"})
    other = make_tenant(redis_url, "beta")
    month_key, reset = usage.budget_period("acme", "month", usage.now_ms())
    client = redis_client(redis_url)
    try:
        client.hset(month_key, "tokens", 1234)
    finally:
        client.close()
    doc = my_usage(gateway.url, key)
    assert doc["budget"] == {
        "tokens": 50_000,
        "period": "month",
        "used": 1234,
        "remaining": 48_766,
        "resets_at": reset,
    }
    assert reset > time.time() and doc["limits"]["token_budget"] == {
        "tokens": 50_000,
        "period": "month",
    }
    assert "history" in doc and len(doc["history"]) == 60  # the rest is as it was
    beta = my_usage(gateway.url, other)
    assert "budget" in beta and beta["budget"] is None


def test_the_budget_counts_what_real_requests_were_charged(
    gateway: ServerThread, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme", token_budget={"tokens": 100, "period": "day"})
    charged = 0
    for _ in range(3):
        r = httpx.post(
            gateway.url + "/v1/chat/completions", json=chat_body(), headers=bearer(key), timeout=10
        )
        assert r.status_code == 200, r.text
        charged += r.json()["usage"]["total_tokens"]
    # Settlement is asynchronous: the budget shows a request once it is settled.
    wait_for(lambda: my_usage(gateway.url, key)["budget"]["used"] == charged, 10)
    budget = my_usage(gateway.url, key)["budget"]
    assert budget["remaining"] == 100 - charged and budget["period"] == "day"
    assert budget["resets_at"] == (int(time.time()) // 86400 + 1) * 86400 or (
        budget["resets_at"] - time.time() < 5  # the test ran across UTC midnight
    )
