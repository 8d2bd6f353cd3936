"""``GET /v1/usage`` through a live gateway: the caller's own tenant only, numbers
that move with traffic, 429s by cause, latches and vectors against quota."""

# ruff: noqa: F811 - pytest fixtures are imported, then named as parameters
from __future__ import annotations

import httpx

from steergate.gateway.edge.metrics import QUOTA_NAMES
from tests.gateway.ops_env import ADMIN, Ops, bearer, ops  # noqa: F401 - fixture

INLINE_LATCH = {"vectors": [{"hook": "post_block", "layers": {"1": [0.5] * 8}}], "latch": True}


def _usage(ops: Ops, key: str) -> dict:
    r = ops.get(key, "/v1/usage")
    assert r.status_code == 200, r.text
    return r.json()


def test_usage_has_limits_every_quota_counts_and_60_minutes(ops: Ops) -> None:
    key = ops.tenant(
        "acme",
        rpm=50,
        tpm=5000,
        max_concurrency=3,
        latch_count=4,
        latch_bytes=4096,
        vector_count=2,
        vector_bytes=1024,
    )
    doc = _usage(ops, key)
    assert doc["tenant_id"] == "acme"
    assert doc["limits"]["rpm"] == 50 and doc["limits"]["latch_policy"] == "evict_oldest"
    assert set(doc["quotas"]) == set(QUOTA_NAMES)
    assert doc["quotas"]["latch_bytes"] == {"used": 0, "limit": 4096}
    assert doc["quotas"]["vector_count"] == {"used": 0, "limit": 2}
    assert set(doc["responses"]) == {"2xx", "4xx", "429", "5xx"}
    assert len(doc["history"]) == 60
    minutes = [h["minute"] for h in doc["history"]]
    assert minutes == sorted(minutes) and minutes[-1] - minutes[0] == 59 * 60


def test_numbers_move_after_requests(ops: Ops) -> None:
    key = ops.tenant("acme", rpm=50)
    for _ in range(3):
        assert ops.chat(key).status_code == 200
    assert ops.chat(key, conversation_id="bad id!").status_code == 400  # refused before admission
    doc = _usage(ops, key)
    assert doc["quotas"]["requests_per_minute"]["used"] == 3
    ops.wait_for(lambda: _usage(ops, key)["responses"]["2xx"] == 3)
    doc = _usage(ops, key)
    assert doc["history"][-1]["requests"] == 3
    assert doc["history"][-1]["tokens"] == 3 * 8  # the fake engine reports 8 tokens each
    assert doc["tokens_total"] == 24 and doc["responses_total"]["2xx"] == 3


def test_429s_are_counted_by_cause(ops: Ops) -> None:
    key = ops.tenant("acme", rpm=1, latch_count=1, latch_bytes=4096, latch_policy="reject")
    assert ops.chat(key, conversation_id="c1", steering=INLINE_LATCH).status_code == 200
    r = ops.chat(key)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    ops.admin("PATCH", "/admin/tenants/acme", json={"limits": {"rpm": 1000}})

    def latch_refused() -> bool:
        # Until the gateway sees the raised rpm (pub/sub invalidation; slower on a
        # cluster) this request is still a rate_limit 429: wait for the latch cause.
        r = ops.chat(key, conversation_id="c2", steering=INLINE_LATCH)
        return r.status_code == 429 and r.json()["error"]["code"] == "latch_quota_exceeded"

    ops.wait_for(latch_refused)
    ops.wait_for(lambda: _usage(ops, key)["rejections"]["latch_quota_exceeded"] >= 1)
    doc = _usage(ops, key)
    assert doc["rejections"]["rate_limit_exceeded"] >= 1
    assert doc["responses"]["429"] == sum(
        v for k, v in doc["rejections"].items() if k != "vector_quota_exceeded"
    )
    assert "unattributed" not in doc["rejections"]


def test_latches_and_vectors_are_shown_against_quota(ops: Ops) -> None:
    key = ops.tenant("acme", latch_count=2, latch_bytes=4096)
    assert ops.chat(key, conversation_id="c1", steering=INLINE_LATCH).status_code == 200
    r = httpx.put(
        ops.url + "/v1/steering/vectors/calm",
        headers=bearer(key),
        json={"hook": "post_block", "layers": {"1": [0.1] * 8}},
    )
    assert r.status_code == 201
    ops.wait_for(lambda: _usage(ops, key)["quotas"]["latch_count"]["used"] == 1)
    q = _usage(ops, key)["quotas"]
    assert q["latch_bytes"]["used"] == 4 * 8  # one float32 vector of hidden size 8
    assert q["vector_count"]["used"] == 1 and q["vector_bytes"]["used"] > 0


def test_a_tenant_sees_only_its_own_usage(ops: Ops) -> None:
    a = ops.tenant("a")
    b = ops.tenant("b")
    for _ in range(4):
        ops.chat(a, conversation_id="x", steering=INLINE_LATCH)
    ops.wait_for(lambda: _usage(ops, a)["responses"]["2xx"] == 4)
    doc = _usage(ops, b)
    assert doc["tenant_id"] == "b"
    assert doc["quotas"]["requests_per_minute"]["used"] == 0
    assert doc["quotas"]["latch_count"]["used"] == 0
    assert doc["responses"]["2xx"] == 0 and sum(h["requests"] for h in doc["history"]) == 0
    assert '"a"' not in ops.get(b, "/v1/usage").text


def test_usage_needs_a_tenant_key(ops: Ops) -> None:
    ops.tenant("acme")
    assert httpx.get(ops.url + "/v1/usage").status_code == 401
    r = httpx.get(ops.url + "/v1/usage", headers=ADMIN)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_usage_admin_usage_and_metrics_work_on_the_embedded_store(start_gateway, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    """``steergate up`` without REDIS_URL runs on the in-process store (fakeredis)."""
    gw = start_gateway(redis_url=None, engine_urls=ops.engine_url)
    embedded = Ops(gw, ops.engine, ops.engine_url)
    key = embedded.tenant("solo", rpm=1)
    assert embedded.chat(key).status_code == 200
    assert embedded.chat(key).status_code == 429
    embedded.wait_for(lambda: _usage(embedded, key)["rejections"]["rate_limit_exceeded"] == 1)
    doc = _usage(embedded, key)
    assert doc["quotas"]["requests_per_minute"] == {"used": 1, "limit": 1}
    assert embedded.admin("GET", "/admin/usage").json()["tenants"][0]["tenant_id"] == "solo"
    assert (
        'steergate_quota_used{quota="requests_per_minute",tenant="solo"} 1.0'
        in httpx.get(gw.url + "/metrics", headers=ADMIN).text
    )


def test_vector_quota_429s_are_counted_by_cause_too(ops: Ops) -> None:
    key = ops.tenant("acme", vector_count=1)
    body = {"hook": "post_block", "layers": {"1": [0.1] * 8}}
    put = [
        httpx.put(ops.url + f"/v1/steering/vectors/{n}", headers=bearer(key), json=body)
        for n in ("one", "two")
    ]
    assert [r.status_code for r in put] == [201, 429]
    assert put[1].json()["error"]["code"] == "vector_quota_exceeded"
    doc = _usage(ops, key)
    assert doc["rejections"]["vector_quota_exceeded"] == 1
    assert doc["quotas"]["vector_count"] == {"used": 1, "limit": 1}
    assert "unattributed" not in doc["rejections"]
