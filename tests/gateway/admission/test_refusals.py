"""The refusal-cause table (steergate/gateway/admission/refusals.py): each cause renders
the same error code in the 429 body, in /v1/usage's rejections and in the metrics label,
and the limiter script names the same causes by status."""

from __future__ import annotations

import re
from typing import Any

import pytest

from steergate.gateway.admission import refusals, usage
from steergate.gateway.admission.limits import _rejection
from steergate.gateway.admission.refusals import REFUSALS, Refusal, Refused
from steergate.gateway.edge.metrics import Metrics
from steergate.gateway.edge.metrics_middleware import MetricsMiddleware
from steergate.gateway.store.scripts import lua_source
from steergate.gateway.tenancy.records import Tenant
from steergate.shared.errors import REGISTRY


def test_admit_request_lua_names_the_tables_causes_by_status() -> None:
    line = re.search(r"local CAUSES = \{([^}]*)\}", lua_source("admit_request"))
    assert line is not None
    lua = [c.strip().strip('"') for c in line.group(1).split(",")]
    by_status = {i + 1: cause for i, cause in enumerate(lua) if cause}
    assert by_status == {s: r.cause for s, r in refusals.BY_STATUS.items()}


def test_causes_are_unique_and_codes_registered_as_429() -> None:
    assert len(refusals.BY_CAUSE) == len(REFUSALS)
    for r in REFUSALS:
        assert REGISTRY[r.code].status == 429, r


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda r: r.cause)
def test_the_429_body_carries_the_causes_code(refusal: Refusal) -> None:
    exc = Refused(refusal, limit=7, retry="1s", period="day", bytes=9, retry_after_ms=1000)
    assert exc.status == 429
    assert exc.body()["error"]["code"] == refusal.code
    assert exc.refusal is refusal


@pytest.mark.parametrize("refusal", list(refusals.BY_STATUS.values()), ids=lambda r: r.cause)
def test_the_limiter_429_names_its_limit_and_says_when_only_if_known(refusal: Refusal) -> None:
    tenant = Tenant(
        id="t",
        limits={"rpm": 11, "tpm": 22, "max_concurrency": 33, "token_budget": {"tokens": 44,
                "period": "month"}},
    )  # fmt: skip
    exc = _rejection(refusal.status, tenant, 2500, {}, key_rpm=55, key_conc=66)
    assert exc.refusal is refusal and exc.code == refusal.code
    expected = {"rpm": 11, "tpm": 22, "max_concurrency": 33, "token_budget": 44,
                "key_rpm": 55, "key_max_concurrency": 66}  # fmt: skip
    if refusal.limit:
        assert f"{expected[refusal.limit]}" in exc.message
    assert ("retry-after" in exc.headers) == refusal.says_when


def test_only_rate_limits_and_the_budget_say_when_they_lift() -> None:
    """A GCRA knows its exact time, a budget its next period; concurrency and the latch
    quota do not (the client backs off, or waiting cannot help)."""
    says = {r.cause for r in REFUSALS if r.says_when}
    assert says == {"rpm", "tpm", "key_rpm", "budget"}


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda r: r.cause)
def test_usage_counts_the_cause_under_its_code(refusal: Refusal) -> None:
    row = {refusal.field: "2", "429": "2"}
    rejections = usage._rejections(row)
    assert rejections[refusal.code] == 2
    assert "unattributed" not in rejections
    assert sum(rejections.values()) == 2


def test_usage_reads_the_older_code_naming_with_the_new_one() -> None:
    row = {"429:rate_limit_exceeded": "1", "429:rpm": "2", "429:tpm": "1", "429": "5"}
    rejections = usage._rejections(row)
    assert rejections["rate_limit_exceeded"] == 4
    assert rejections["unattributed"] == 1
    assert usage._rejections({"429:someday_new": "1", "429": "1"})["someday_new"] == 1


def _answer_429(refusal: Refusal | None) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        scope.setdefault("state", {})["tenant_id"] = "t"
        if refusal is not None:
            scope["state"][refusals.STATE_KEY] = refusal
        await send({"type": "http.response.start", "status": 429, "headers": []})
        await send({"type": "http.response.body", "body": b'{"error": {"code": "x"}}'})

    return app


async def _call(app: Any) -> None:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        return None

    await app({"type": "http", "path": "/v1/x", "headers": []}, receive, send)


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda r: r.cause)
async def test_metrics_label_and_usage_record_come_from_the_request_state(
    refusal: Refusal,
) -> None:
    metrics = Metrics()
    recorded: list[Refusal] = []

    async def sink(scope: Any, tenant_id: str, r: Refusal) -> None:
        recorded.append(r)

    await _call(MetricsMiddleware(_answer_429(refusal), metrics, on_rejection=sink))
    labels = {"tenant": "t", "cause": refusal.code}
    assert metrics.registry.get_sample_value("steergate_rejections_total", labels) == 1
    assert recorded == [refusal]


async def test_a_429_without_a_refusal_is_unknown_and_not_recorded() -> None:
    metrics = Metrics()
    recorded: list[Refusal] = []

    async def sink(scope: Any, tenant_id: str, r: Refusal) -> None:
        recorded.append(r)

    await _call(MetricsMiddleware(_answer_429(None), metrics, on_rejection=sink))
    labels = {"tenant": "t", "cause": "unknown"}
    assert metrics.registry.get_sample_value("steergate_rejections_total", labels) == 1
    assert recorded == []
