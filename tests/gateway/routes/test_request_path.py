"""The gateway's request path against a fake engine and a real Redis: auth, scoping
and isolation, rate limits, latch quotas, failures, bad input."""

from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Any

import httpx
import orjson
import pytest

from tests.gateway.conftest import DEFAULT_REDIS_TIMEOUT_S, FakeEngine, make_tenant
from tests.gateway.servers import ServerThread
from tests.harness import CLUSTER, aredis_client, redis_client

CHAT = "/v1/chat/completions"


def chat_body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "fake",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **extra,
    }


def post(gw: ServerThread, key: str, body: Any, path: str = CHAT, **kw: Any) -> httpx.Response:
    return httpx.post(
        gw.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30, **kw
    )


def inline(latch: bool = False) -> dict[str, Any]:
    return {"vectors": [{"hook": "post_block", "layers": {"1": [0.5] * 8}}], "latch": latch}


# -- auth -------------------------------------------------------------------------


def test_missing_malformed_unknown_and_revoked_keys_get_401(
    gateway: ServerThread, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme")
    for header in [None, "Bearer", "Bearer nope", "Basic abc", "Bearer sk-sg-" + "x" * 43]:
        headers = {"Authorization": header} if header else {}
        r = httpx.post(gateway.url + CHAT, json=chat_body(), headers=headers)
        assert r.status_code == 401, header
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert post(gateway, key, chat_body()).status_code == 200
    assert httpx.get(gateway.url + "/readyz").status_code == 200
    assert httpx.get(gateway.url + "/healthz").status_code == 200


def test_reset_durations_use_openai_format() -> None:
    from steergate.gateway.admission.limits import duration

    assert [duration(ms) for ms in (0, 20, 1000, 1500, 59_999, 360_000, 3_723_000)] == [
        "0ms",
        "20ms",
        "1s",
        "1.5s",
        "59.999s",
        "6m0s",
        "1h2m3s",
    ]


def test_revoked_key_is_refused_by_a_replica_that_cached_it_within_1s(
    start_gateway: Any, redis_url: str
) -> None:
    import asyncio

    from steergate.gateway.tenancy.tenants import TenantStore
    from tests.gateway.conftest import PEPPER

    b = start_gateway()
    key = make_tenant(redis_url, "acme")
    assert post(b, key, chat_body()).status_code == 200  # b caches the key

    async def revoke() -> None:
        client = aredis_client(redis_url)
        store = TenantStore(client, PEPPER)
        (info,) = await store.list_keys("acme")
        await store.revoke_key(info.key_id)
        await client.aclose()

    asyncio.run(revoke())
    t0 = time.monotonic()
    while post(b, key, chat_body()).status_code != 401:
        assert time.monotonic() - t0 < 1.0, "revocation not seen within 1 s"
        time.sleep(0.02)


# -- scoping and isolation ----------------------------------------------------------


def test_engine_sees_scoped_ids_and_client_never_does(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str, captured_logs: Any
) -> None:
    key = make_tenant(redis_url, "acme")
    put = httpx.put(
        gateway.url + "/v1/steering/vectors/calm",
        headers={"Authorization": f"Bearer {key}"},
        json={"hook": "post_block", "layers": {"0": [0.1] * 8}},
    )
    assert put.status_code == 201, put.text
    assert put.json()["name"] == "calm" and put.json()["bytes"] == 32
    r = post(
        gateway,
        key,
        chat_body(conversation_id="c1", steering={"vectors": [{"name": "calm"}], "latch": True}),
    )
    assert r.status_code == 200, r.text
    sent = fake_engine.state.requests[-1]
    assert sent["conversation_id"] == "acme~c1"
    assert sent["steering"]["vectors"][0]["name"] == "acme~calm"
    assert "acme~calm" in fake_engine.state.vectors
    assert "~" not in r.text and not any("~" in v for v in r.headers.values())
    assert r.headers["x-steering-latch"] == "latched"
    assert r.json()["steering"] == {"applied": True, "latch": "latched"}
    # unknown name: named by its term, neither form echoed (docs/latches.md)
    r = post(gateway, key, chat_body(steering={"vectors": [{"name": "nope"}]}))
    assert r.status_code == 400 and "acme~" not in r.text and "nope" not in r.text
    assert r.json()["error"]["param"] == "steering.vectors[0].name"
    logs = captured_logs.text
    assert key not in logs and key[12:] not in logs


def test_two_tenants_same_ids_never_interfere(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    ka, kb = make_tenant(redis_url, "a"), make_tenant(redis_url, "b")
    auth = lambda k: {"Authorization": f"Bearer {k}"}  # noqa: E731
    for k, v in [(ka, 0.1), (kb, 0.9)]:
        r = httpx.put(
            gateway.url + "/v1/steering/vectors/calm",
            headers=auth(k),
            json={"hook": "post_block", "layers": {"0": [v] * 8}},
        )
        assert r.status_code == 201
    da = httpx.get(gateway.url + "/v1/steering/vectors/calm", headers=auth(ka)).json()
    db = httpx.get(gateway.url + "/v1/steering/vectors/calm", headers=auth(kb)).json()
    assert da["digest"] != db["digest"]
    assert (
        post(gateway, ka, chat_body(conversation_id="c", steering=inline(True))).status_code == 200
    )
    # b's same conversation id is not latched: b sees no latch, a does
    r = post(gateway, kb, chat_body(conversation_id="c"))
    assert r.headers["x-steering-latch"] == "none"
    assert (
        post(gateway, ka, chat_body(conversation_id="c")).headers["x-steering-latch"] == "bridged"
    )
    lb = httpx.get(gateway.url + "/v1/steering/latches", headers=auth(kb)).json()
    la = httpx.get(gateway.url + "/v1/steering/latches", headers=auth(ka)).json()
    assert lb == [] and [x["conversation_id"] for x in la] == ["c"]
    # b cannot delete a's latch or vector, and cannot name a's scoped forms
    assert httpx.delete(gateway.url + "/v1/steering/latches/c", headers=auth(kb)).status_code == 404
    assert "a~c" in fake_engine.state.latches
    r = httpx.delete(gateway.url + "/v1/steering/latches/a~c", headers=auth(kb))
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_conversation_id"
    r = post(gateway, kb, chat_body(conversation_id="a~c"))
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_conversation_id"
    r = post(gateway, kb, chat_body(steering={"vectors": [{"name": "a~calm"}]}))
    assert r.status_code == 400
    assert (
        httpx.delete(gateway.url + "/v1/steering/vectors/calm", headers=auth(kb)).status_code == 204
    )
    assert "a~calm" in fake_engine.state.vectors and "b~calm" not in fake_engine.state.vectors
    assert httpx.delete(gateway.url + "/v1/steering/latches/c", headers=auth(ka)).status_code == 204
    assert "a~c" not in fake_engine.state.latches


def test_tenant_cache_salt_is_always_applied_and_client_salt_only_adds(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    ka, kb = make_tenant(redis_url, "a"), make_tenant(redis_url, "b")
    post(gateway, ka, chat_body(cache_salt="same"))
    post(gateway, kb, chat_body(cache_salt="same"))
    post(gateway, ka, chat_body())
    sa, sb, sa0 = (r["cache_salt"] for r in fake_engine.state.requests[-3:])
    assert len({sa, sb, sa0, "same"}) == 4


# -- limits ---------------------------------------------------------------------------


def test_rpm_burst_over_two_gateways_admits_n(start_gateway: Any, redis_url: str) -> None:
    g1, g2 = start_gateway(), start_gateway()
    key = make_tenant(redis_url, "acme", rpm=20, max_concurrency=100)
    with cf.ThreadPoolExecutor(16) as ex:
        codes = list(
            ex.map(lambda i: post(g1 if i % 2 else g2, key, chat_body()).status_code, range(40))
        )
    assert codes.count(200) in (19, 20, 21) and codes.count(429) == 40 - codes.count(200)


def test_429_carries_retry_after_and_ratelimit_headers(
    gateway: ServerThread, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme", rpm=2)
    ok = post(gateway, key, chat_body())
    assert ok.headers["x-ratelimit-limit-requests"] == "2"
    assert ok.headers["x-ratelimit-remaining-requests"] == "1"
    assert ok.headers["x-ratelimit-reset-requests"].endswith("s")
    for h in ("limit", "remaining", "reset"):
        assert f"x-ratelimit-{h}-tokens" in ok.headers
    post(gateway, key, chat_body())
    r = post(gateway, key, chat_body())
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(r.headers["retry-after"]) >= 1 and 0 < int(r.headers["retry-after-ms"]) <= 30_000
    assert r.headers["x-ratelimit-remaining-requests"] == "0"


def test_tokens_per_minute_reserve_then_settle_to_actual_usage(
    gateway: ServerThread, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme", tpm=1000)
    r = post(gateway, key, chat_body(max_tokens=600))  # reserves ~601, settles to 8
    assert r.status_code == 200
    assert int(r.headers["x-ratelimit-remaining-tokens"]) < 400
    time.sleep(0.1)  # settlement is batched off the hot path
    with cf.ThreadPoolExecutor(1) as ex:  # 900 reserved while this one is in flight
        slow = ex.submit(post, gateway, key, chat_body(max_tokens=900, fake_delay=0.5))
        time.sleep(0.2)
        r = post(gateway, key, chat_body(max_tokens=900))
        assert r.status_code == 429 and "tokens per minute" in r.json()["error"]["message"]
        assert slow.result().status_code == 200, "the first reservation was not corrected"


def test_concurrency_limit_and_lease_release(gateway: ServerThread, redis_url: str) -> None:
    key = make_tenant(redis_url, "acme", max_concurrency=2)
    with cf.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(post, gateway, key, chat_body(fake_delay=0.5)) for _ in range(4)]
        codes = sorted(f.result().status_code for f in futs)
    assert codes == [200, 200, 429, 429]
    time.sleep(0.1)
    assert post(gateway, key, chat_body()).status_code == 200  # leases were released


# -- latch quotas ---------------------------------------------------------------------------


def test_200_concurrent_latches_with_quota_10_leave_at_most_10(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:

    key = make_tenant(
        redis_url, "acme", latch_count=10, rpm=10_000, max_concurrency=500, tpm=10_000_000
    )
    with cf.ThreadPoolExecutor(32) as ex:
        rs = list(
            ex.map(
                lambda i: post(
                    gateway, key, chat_body(conversation_id=f"c{i}", steering=inline(True))
                ),
                range(200),
            )
        )
    assert all(r.status_code == 200 for r in rs)
    states = {r.headers["x-steering-latch"] for r in rs}
    assert "evicted_quota" in states
    client = redis_client(redis_url)
    svc = gateway.app.state.services
    gateway.call(svc.settler.drain())
    # A latch the engine stored after the quota evicted it is never bridged (Redis does
    # not expect it); the engine sync deletes it (periodically; here, at once).
    (engine,) = svc.engines.engines
    assert gateway.call(svc.sync.sync(engine)) is True
    in_redis = client.zcard("sg:{t:acme}:latches")
    on_engine = [c for c in fake_engine.state.latches if c.startswith("acme~")]
    assert in_redis <= 10 and len(on_engine) <= 10, (in_redis, len(on_engine))
    assert set(on_engine) <= {f"acme~{c}" for c in client.zrange("sg:{t:acme}:latches", 0, -1)}
    assert int(client.get("sg:{t:acme}:latch:bytes")) == 32 * in_redis


def test_reject_policy_answers_429_latch_quota_exceeded(
    gateway: ServerThread, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme", latch_count=1, latch_policy="reject")
    assert (
        post(gateway, key, chat_body(conversation_id="a", steering=inline(True))).status_code == 200
    )
    r = post(gateway, key, chat_body(conversation_id="b", steering=inline(True)))
    assert r.status_code == 429 and r.json()["error"]["code"] == "latch_quota_exceeded"
    # Waiting cannot help: no Retry-After, and the SDKs are told not to retry.
    assert "retry-after" not in r.headers and r.headers["x-should-retry"] == "false"
    # replacing its own latch does not count twice
    assert (
        post(gateway, key, chat_body(conversation_id="a", steering=inline(True))).status_code == 200
    )


def test_vector_quota(gateway: ServerThread, redis_url: str) -> None:
    key = make_tenant(redis_url, "acme", vector_count=1)
    h = {"Authorization": f"Bearer {key}"}
    body = {"hook": "post_block", "layers": {"0": [0.1] * 8}}
    assert (
        httpx.put(gateway.url + "/v1/steering/vectors/v1", headers=h, json=body).status_code == 201
    )
    assert (
        httpx.put(gateway.url + "/v1/steering/vectors/v1", headers=h, json=body).status_code == 200
    )
    r = httpx.put(gateway.url + "/v1/steering/vectors/v2", headers=h, json=body)
    assert r.status_code == 429 and r.json()["error"]["code"] == "vector_quota_exceeded"


def test_gguf_upload_is_decoded_and_forwarded_as_packed_float32(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    import numpy as np

    from steergate.shared.gguf import encode_gguf_control_vector

    key = make_tenant(redis_url, "acme")
    raw = encode_gguf_control_vector({1: np.ones(8, np.float32), 2: np.zeros(8, np.float32)})
    r = httpx.put(
        gateway.url + "/v1/steering/vectors/g",
        content=raw,
        headers={"Authorization": f"Bearer {key}", "content-type": "application/octet-stream"},
    )
    assert r.status_code == 201, r.text
    assert (
        r.json()["layers"] == [1, 2]
        and r.json()["hook"] == "post_block"
        and r.json()["bytes"] == 64
    )
    installed = fake_engine.state.runtime.registry.get("acme~g")
    assert installed is not None and sorted(installed.layers) == [1, 2]
    assert installed.layers[1].dtype == np.float32 and float(installed.layers[1][0]) == 1.0
    auth = {"Authorization": f"Bearer {key}"}
    listed = httpx.get(gateway.url + "/v1/steering/vectors", headers=auth).json()["data"]
    assert [v["name"] for v in listed] == ["g"] and "packed" not in listed[0]
    full = httpx.get(gateway.url + "/v1/steering/vectors/g?include=data", headers=auth).json()
    assert full["name"] == "g" and full["packed"]["layer_indices"] == [1, 2]
    assert httpx.get(gateway.url + "/v1/steering/vectors/nope", headers=auth).status_code == 404
    # Media types are case-insensitive (RFC 9110 8.3.1): this was read as JSON and refused
    # as "not valid JSON" (found from outside).
    r = httpx.put(
        gateway.url + "/v1/steering/vectors/g2",
        content=raw,
        headers={**auth, "content-type": "Application/Octet-Stream; x=1"},
    )
    assert r.status_code == 201, r.text


# -- failures ----------------------------------------------------------------------------


def test_engine_down_is_502(start_gateway: Any, redis_url: str) -> None:
    from tests.harness import free_port

    gw = start_gateway(engine_urls=f"http://127.0.0.1:{free_port()}")
    key = make_tenant(redis_url, "acme")
    r = post(gw, key, chat_body())
    assert r.status_code == 502 and r.json()["error"]["code"] == "engine_unavailable"
    assert "x-ratelimit-limit-requests" in r.headers
    ready = httpx.get(gw.url + "/readyz")  # its own body, which says what is down
    assert ready.status_code == 503, ready.text
    assert ready.json() == {"status": "unavailable", "redis": True, "engines": 0}


def test_engine_read_timeout_is_504_and_the_next_request_is_served(
    start_gateway: Any, redis_url: str
) -> None:
    gw = start_gateway(engine_read_timeout_s=0.3)
    key = make_tenant(redis_url, "acme")
    r = post(gw, key, chat_body(fake_delay=1.0))
    assert r.status_code == 504 and r.json()["error"]["code"] == "engine_timeout"
    assert "x-ratelimit-limit-requests" in r.headers
    # The timed-out engine connection is closed, never reused for the next request.
    assert post(gw, key, chat_body()).status_code == 200


def test_redis_down_is_503_within_1s_then_recovers(
    start_gateway: Any, redis_server: Any, redis_url: str
) -> None:
    gateway = start_gateway(redis_timeout_s=DEFAULT_REDIS_TIMEOUT_S)
    key = make_tenant(redis_url, "acme", rpm=100_000, max_concurrency=1000)
    assert post(gateway, key, chat_body()).status_code == 200
    redis_server.stop()
    try:
        for _ in range(3):
            t0 = time.monotonic()
            r = post(gateway, key, chat_body())
            assert time.monotonic() - t0 < STORE_BOUND_S + 0.5
            assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
    finally:
        redis_server.start()
    # the tenant and key are gone with the restarted (non-persistent) server: recreate
    key = make_tenant(redis_url, "acme", rpm=100_000)
    deadline = time.monotonic() + 5
    while post(gateway, key, chat_body()).status_code != 200:
        assert time.monotonic() < deadline, "did not resume after Redis came back"
        time.sleep(0.1)


def test_mid_stream_failure_ends_with_error_event(gateway: ServerThread, redis_url: str) -> None:
    key = make_tenant(redis_url, "acme")
    with httpx.stream(
        "POST",
        gateway.url + CHAT,
        json=chat_body(stream=True, fake_break=True),
        headers={"Authorization": f"Bearer {key}"},
    ) as r:
        text = r.read().decode()
    events = [e for e in text.split("\n\n") if e.strip()]
    assert '"error"' in events[-1] and "engine_unavailable" in events[-1]


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body,param",
    [
        (b"{not json", "body"),
        (b"[1,2]", "body"),
        (orjson.dumps(chat_body(stream="yes")), "stream"),
        (orjson.dumps(chat_body(conversation_id="")), "conversation_id"),
        (orjson.dumps(chat_body(conversation_id="x" * 257)), "conversation_id"),
        (orjson.dumps(chat_body(conversation_id="bad id")), "conversation_id"),
        (orjson.dumps(chat_body(conversation_id=5)), "conversation_id"),
        (
            orjson.dumps(
                chat_body(steering={"vectors": [{"hook": "nope", "layers": {"0": [1.0] * 8}}]})
            ),
            "steering.vectors[0].hook",
        ),
        (
            orjson.dumps(
                chat_body(
                    steering={"vectors": [{"hook": "post_block", "layers": {"9": [1.0] * 8}}]}
                )
            ),
            "steering.vectors[0].layers.9",
        ),
        (
            orjson.dumps(
                chat_body(
                    steering={"vectors": [{"hook": "post_block", "layers": {"0": [1.0] * 7}}]}
                )
            ),
            "steering.vectors[0].layers.0",
        ),
        (
            b'{"model":"m","messages":[],"steering":{"vectors":[{"hook":"post_block","layers":{"0":'
            b"[NaN,1,1,1,1,1,1,1]}}]}}",
            "body",
        ),
        (orjson.dumps(chat_body(steering=inline(True))), "steering.latch"),
    ],
)
def test_bad_input_is_400_naming_the_field(
    gateway: ServerThread, redis_url: str, body: bytes, param: str
) -> None:
    key = make_tenant(redis_url, "acme")
    r = httpx.post(
        gateway.url + CHAT,
        content=body,
        headers={"Authorization": f"Bearer {key}", "content-type": "application/json"},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and isinstance(err["code"], str)


def test_oversize_body_is_413(start_gateway: Any, redis_url: str) -> None:
    gw = start_gateway(max_body_bytes=4096)
    key = make_tenant(redis_url, "acme")
    big = chat_body(messages=[{"role": "user", "content": "x" * 5000}])
    r = post(gw, key, big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Any:
        for _ in range(10):
            yield b" " * 1000

    r = httpx.post(gw.url + CHAT, content=chunks(), headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 413


def test_nan_in_packed_vector_is_400(gateway: ServerThread, redis_url: str) -> None:
    import numpy as np

    from steergate.shared.codecs import encode_packed

    key = make_tenant(redis_url, "acme")
    m = np.ones((1, 8), np.float32)
    m[0, 3] = np.nan
    r = httpx.put(
        gateway.url + "/v1/steering/vectors/v",
        headers={"Authorization": f"Bearer {key}"},
        json={"hook": "post_block", "packed": encode_packed(m, [0])},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "packed.data"


#: How long a request may wait on a hung store: the socket timeout on one Redis; on a
#: cluster, the client's per-command bound (steergate/gateway/store/connection.py
#: BoundedRedisCluster).
STORE_BOUND_S = DEFAULT_REDIS_TIMEOUT_S * (1.5 if CLUSTER else 1.0)


def test_hung_redis_is_503_within_1s_then_recovers(
    start_gateway: Any, redis_server: Any, redis_url: str
) -> None:
    """A Redis that accepts connections but never answers (SIGSTOP) must not hang requests."""

    gateway = start_gateway(redis_timeout_s=DEFAULT_REDIS_TIMEOUT_S)

    key = make_tenant(redis_url, "acme", rpm=100_000, max_concurrency=1000)
    assert post(gateway, key, chat_body()).status_code == 200
    redis_server.pause()
    try:
        for _ in range(2):
            t0 = time.monotonic()
            r = post(gateway, key, chat_body())
            assert time.monotonic() - t0 < STORE_BOUND_S + 0.5
            assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
    finally:
        redis_server.resume()
    deadline = time.monotonic() + 5
    while post(gateway, key, chat_body()).status_code != 200:
        assert time.monotonic() < deadline, "did not resume after Redis came back"
        time.sleep(0.1)
