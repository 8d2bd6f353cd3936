"""Small raw-ASGI helpers shared by the engine's and the gateway's middlewares (no
Starlette request objects, so nothing buffers a streamed response)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from steergate.shared.errors import APIError, render

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

RawHeaders = list[tuple[bytes, bytes]]


def header(headers: RawHeaders, name: bytes) -> bytes | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def sole_header(headers: RawHeaders, name: bytes) -> bytes | None:
    """The value of a header that may appear once (``Authorization``, RFC 9110 5.3);
    None when it is absent *or repeated*: a proxy in front that reads the last copy and
    a server that reads the first would otherwise authorise different credentials."""
    values = [value for key, value in headers if key.lower() == name]
    return values[0] if len(values) == 1 else None


def replace_header(headers: RawHeaders, name: bytes, value: bytes | None) -> RawHeaders:
    """Drop every ``name`` header, then append ``value`` unless it is None."""
    out = [(k, v) for k, v in headers if k.lower() != name]
    if value is not None:
        out.append((name, value))
    return out


async def send_error(
    send: Send, exc: APIError, extra_headers: RawHeaders | None = None, *, more_body: bool = False
) -> None:
    """``exc`` as :func:`shared.errors.render` renders it, from raw ASGI."""
    out = render(exc)
    headers = [*out.raw_headers(), *(extra_headers or [])]
    await send({"type": "http.response.start", "status": out.status, "headers": headers})
    await send({"type": "http.response.body", "body": out.body, "more_body": more_body})


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None if the client disconnected first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields ``body`` once, then defers to the real one (so the
    app still sees the client's disconnect)."""
    sent = False

    async def _receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return _receive
