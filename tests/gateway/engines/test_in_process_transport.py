"""The engine pool's test seam (``create_app(engine_transport=...)``, see
steergate/gateway/engines/upstream.py): a gateway whose engine calls go in-process to
the stub engine's ASGI app through ``httpx.ASGITransport``, with no engine server
socket. The engine URL names a host that cannot resolve, so a pool that ignored the
transport would answer 502 engine_unavailable instead."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson

from steergate.gateway.app import create_app
from tests.gateway.conftest import ENGINE_TOKEN, gateway_settings, make_tenant
from tests.gateway.stub_engine import StubEngine

#: Never resolved, never connected to: only the transport can reach this engine.
NO_SOCKET_URL = "http://in-process-engine.invalid:9"
MSG = [{"role": "user", "content": "hi"}]


async def _chat_through_gateway(redis_url: str, key: str) -> tuple[Any, list[bytes]]:
    engine = StubEngine(ENGINE_TOKEN)
    engine_app = engine.app.app  # the FastAPI app inside the request recorder
    app = create_app(
        gateway_settings(redis_url, NO_SOCKET_URL),
        engine_transport=httpx.ASGITransport(app=engine.app),
    )
    auth = {"authorization": f"Bearer {key}"}
    async with (
        engine_app.router.lifespan_context(engine_app),
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as gw,
    ):
        plain = await gw.post(
            "/v1/chat/completions", headers=auth, json={"model": "stub", "messages": MSG}
        )
        streamed = await gw.post(
            "/v1/chat/completions",
            headers=auth,
            json={"model": "stub", "messages": MSG, "stream": True, "fake_chunks": 3},
        )
    assert plain.status_code == 200, plain.text
    assert streamed.status_code == 200, streamed.text
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = [e for e in streamed.content.split(b"\n\n") if e.strip()]
    assert len(engine.requests) == 2  # both reached the in-process engine
    return plain.json(), events


def test_chat_and_stream_reach_an_in_process_engine(redis_url: str) -> None:
    key = make_tenant(redis_url, "in-process")
    body, events = asyncio.run(_chat_through_gateway(redis_url, key))
    assert body["choices"][0]["message"]["content"] == "echo"
    assert all(e.startswith(b"data: ") for e in events)
    assert events[-1] == b"data: [DONE]"
    chunks = [orjson.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]] == ["tok"] * 3
