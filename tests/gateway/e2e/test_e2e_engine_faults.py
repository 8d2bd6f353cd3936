"""Quota races and engine faults proven against the real vLLM CPU engine (the same
behaviour the stub-engine tests check in milliseconds)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from steergate.gateway.app import create_app
from tests.gateway.conftest import gateway_settings, make_tenant
from tests.gateway.servers import ServerThread
from tests.harness import EngineProcess, redis_client, wait_for

pytestmark = pytest.mark.engine


@pytest.fixture()
def real_gateway(engine: EngineProcess, redis_url: str) -> Iterator[ServerThread]:
    settings = gateway_settings(
        redis_url, engine.url, engine_token=engine.token, reconcile_interval_s=1.0
    )
    server = ServerThread(create_app(settings)).start()
    yield server
    server.stop()


def _body(engine: EngineProcess, conversation_id: str, latch: bool) -> dict:
    info = httpx.get(engine.url + "/v1/steering/info", headers=engine.headers).json()
    body: dict = {
        "model": httpx.get(engine.url + "/v1/models", headers=engine.headers).json()["data"][0][
            "id"
        ],
        "prompt": "steer me",
        "max_tokens": 1,
        "conversation_id": conversation_id,
    }
    if latch:
        body["steering"] = {
            "vectors": [{"hook": "post_block", "layers": {"1": [0.01] * info["hidden_size"]}}],
            "latch": True,
        }
    return body


def _engine_latches(engine: EngineProcess, tenant: str) -> set[str]:
    r = httpx.get(
        engine.url + "/v1/steering/latches", params={"prefix": f"{tenant}~"}, headers=engine.headers
    )
    return {x["conversation_id"] for x in r.json()}



def test_200_concurrent_latching_requests_leave_at_most_quota_latches(
    real_gateway: ServerThread, engine: EngineProcess, redis_url: str
) -> None:
    key = make_tenant(
        redis_url, "race", latch_count=10, max_concurrency=500, rpm=100_000, tpm=10_000_000
    )
    template = _body(engine, "x", latch=True)

    async def fire() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        real_gateway.url + "/v1/completions",
                        headers={"Authorization": f"Bearer {key}"},
                        json={**template, "conversation_id": f"c{i}"},
                    )
                    for i in range(200)
                )
            )

    responses = asyncio.run(fire())
    assert [r.status_code for r in responses] == [200] * 200, {r.text for r in responses}
    states = {r.headers["x-steering-latch"] for r in responses}
    assert states <= {"latched", "evicted_quota"} and "evicted_quota" in states
    store = redis_client(redis_url)
    # settlement is asynchronous: wait for it to finish correcting the ledger
    wait_for(lambda: len(_engine_latches(engine, "race")) <= 10, 10, "engine holds > 10 latches")
    in_redis = set(store.zrange("sg:{t:race}:latches", 0, -1))
    on_engine = {c.split("~", 1)[1] for c in _engine_latches(engine, "race")}
    assert 1 <= len(in_redis) <= 10
    assert len(on_engine) <= 10 and on_engine <= in_redis
    for conv in in_redis:  # leave the shared engine clean
        httpx.delete(
            f"{real_gateway.url}/v1/steering/latches/{conv}",
            headers={"Authorization": f"Bearer {key}"},
        )


def test_engine_stop_is_502_and_after_a_restart_the_latch_is_restored(
    real_gateway: ServerThread, engine: EngineProcess, redis_url: str
) -> None:
    key = make_tenant(redis_url, "restart")
    auth = {"Authorization": f"Bearer {key}"}
    url = real_gateway.url + "/v1/completions"
    body = _body(engine, "conv", latch=True)
    r = httpx.post(url, headers=auth, json=body, timeout=120)
    assert r.status_code == 200 and r.headers["x-steering-latch"] == "latched"
    store = redis_client(redis_url)
    wait_for(lambda: store.zcard("sg:{t:restart}:latches") == 1, 5, "latch not recorded")

    engine.stop()
    try:
        r = httpx.post(url, headers=auth, json=body, timeout=30)
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "engine_unavailable"
    finally:
        engine.start()

    # Redis is the system of record: the restarted engine (new epoch, empty cache) does
    # not shrink the ledger; the next plain turn installs the latch again.
    time.sleep(2.0)
    assert store.zcard("sg:{t:restart}:latches") == 1
    plain = {k: v for k, v in body.items() if k != "steering"}
    r = httpx.post(url, headers=auth, json=plain, timeout=120)
    assert r.status_code == 200 and r.headers["x-steering-latch"] == "restored"
    r = httpx.post(url, headers=auth, json=plain, timeout=120)
    assert r.status_code == 200 and r.headers["x-steering-latch"] == "bridged"
