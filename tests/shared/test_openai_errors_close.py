"""An unhandled error: the 500 is OpenAI-shaped and says ``connection: close``, because
the error is re-raised for the server's log and the server then closes the connection.
Without the header a keep-alive client (the gateway's engine pool) sent its next request
on that connection and got a reset: an unrelated request failed as "engine unavailable"."""

from __future__ import annotations

import json
from typing import Any

import pytest

from steergate.shared.openai_errors import OpenAIErrorMiddleware


async def broken(scope: Any, receive: Any, send: Any) -> None:
    raise RuntimeError("a bug")


async def test_an_unhandled_error_is_a_shaped_500_that_closes_the_connection() -> None:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    with pytest.raises(RuntimeError):
        await OpenAIErrorMiddleware(broken)(scope, receive, send)
    start = sent[0]
    assert start["status"] == 500
    headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    assert headers["connection"] == "close"
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert body["error"]["code"] == "internal_error"
