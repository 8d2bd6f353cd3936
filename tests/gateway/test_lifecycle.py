"""Lifecycle behaviour: the embedded store, client disconnects, engine restarts
(reconciliation), and what reaches the logs."""

from __future__ import annotations

import time
from typing import Any

import httpx

from steergate.gateway.app import create_app
from tests.gateway.conftest import FakeEngine, gateway_settings, make_tenant
from tests.gateway.routes.test_request_path import CHAT, chat_body, inline, post
from tests.gateway.servers import ServerThread
from tests.harness import redis_client


def test_embedded_store_serves_requests_with_the_same_scripts(
    fake_engine: FakeEngine, captured_logs: Any
) -> None:
    app = create_app(gateway_settings(None, fake_engine.url))
    server = ServerThread(app).start()
    try:
        store = app.state.tenants

        async def mk() -> str:
            await store.create("acme", limits={"rpm": 3})
            return (await store.create_key("acme"))[1]

        key = server.call(mk())
        codes = [
            post(server, key, chat_body(conversation_id="c", steering=inline(True))).status_code
            for _ in range(4)
        ]
        assert codes == [200, 200, 200, 429]
        assert "EMBEDDED in-process store" in captured_logs.text
    finally:
        server.stop()


def test_client_disconnect_mid_stream_releases_the_lease(
    gateway: ServerThread, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme", max_concurrency=1)
    with httpx.stream(
        "POST",
        gateway.url + CHAT,
        json=chat_body(stream=True, fake_delay=0),
        headers={"Authorization": f"Bearer {key}"},
    ) as r:
        assert r.status_code == 200
        next(r.iter_raw())  # first chunk arrived; now hang up
    client = redis_client(redis_url)
    deadline = time.monotonic() + 2
    while client.zcard("sg:{t:acme}:leases"):
        assert time.monotonic() < deadline, "lease not released after disconnect"
        time.sleep(0.02)
    assert post(gateway, key, chat_body()).status_code == 200


def test_logs_hold_no_keys_and_no_scoped_ids(
    gateway: ServerThread, redis_url: str, captured_logs: Any
) -> None:
    key = make_tenant(redis_url, "acme")
    post(gateway, key, chat_body(conversation_id="c9", steering=inline(True)))
    post(gateway, key, chat_body(steering={"vectors": [{"name": "missing"}]}))
    post(gateway, key + "x", chat_body())
    text = captured_logs.text
    assert key[6:] not in text and "acme~" not in text


def test_gateway_refuses_to_start_without_its_secrets(monkeypatch: Any, capsys: Any) -> None:
    from steergate.gateway.server import main

    for name in ("STEERGATE_ADMIN_KEY", "STEERGATE_KEY_PEPPER", "STEERGATE_ENGINE_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("STEERGATE_ADMIN_KEY", "set")
    assert main(["--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "STEERGATE_KEY_PEPPER" in err and "STEERGATE_ENGINE_TOKEN" in err
    assert "STEERGATE_ADMIN_KEY" not in err


def test_fail_open_admits_unmetered_when_redis_is_down(
    start_gateway: Any, redis_server: Any, redis_url: str
) -> None:
    gw = start_gateway(rate_limit_fail_open=True)
    key = make_tenant(redis_url, "acme", rpm=1)
    assert post(gw, key, chat_body()).status_code == 200  # caches the key
    assert post(gw, key, chat_body()).status_code == 429  # metered while Redis is up
    redis_server.stop()
    try:
        r = post(gw, key, chat_body())
        assert r.status_code == 200, r.text
    finally:
        redis_server.start()
