"""Request-body limit as plain ASGI middleware (streams correctly, unlike
BaseHTTPMiddleware): a declared Content-Length over the limit is refused before
the app reads anything; a chunked body is counted as it streams and cut off at the
limit.

A refusal is a *lingering close*, as nginx and Apache do it: the 413 is sent at
once, then what the client is still sending is read and discarded (bounded in bytes
and time) before the response is ended and the server closes the connection.
Closing a socket with unread data in it makes the kernel answer with a reset, and a
client that writes its whole body before reading (urllib, requests) would see
``connection reset`` instead of the 413, which may never reach it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from steergate.shared.asgi import header, send_error
from steergate.shared.errors import APIError

#: Discard at most this much of a refused body (or twice the limit, if more) ...
DRAIN_BYTES = 16 * 1024 * 1024
#: ... for at most this long; then close, whatever the client is doing.
DRAIN_S = 5.0

Scope = dict[str, Any]


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    def __init__(
        self, app: Any, max_bytes: int, *, drain_bytes: int | None = None, drain_s: float = DRAIN_S
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.drain_bytes = max(2 * max_bytes, DRAIN_BYTES) if drain_bytes is None else drain_bytes
        self.drain_s = drain_s

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = -1
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.max_bytes:
                    await self._refuse(scope, receive, send, body_done=False)
                    return
        if declared >= 0:
            # The HTTP server delivers exactly Content-Length bytes, so a declared
            # length within the limit needs no counting (the common, hot case).
            await self.app(scope, receive, send)
            return
        seen = 0
        started = False
        body_done = False

        async def counting_receive() -> Any:
            nonlocal seen, body_done
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if seen > self.max_bytes:
                    raise BodyTooLarge()
            return message

        async def tracking_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(scope, receive, send, body_done=body_done)

    async def _refuse(self, scope: Scope, receive: Any, send: Any, *, body_done: bool) -> None:
        err = APIError("request_too_large", f"Request body exceeds {self.max_bytes} bytes.")
        close = [(b"connection", b"close")]
        # With ``Expect: 100-continue`` the client waits for our answer before sending
        # the body; answering without reading means it never sends it.
        expecting = (header(scope.get("headers", []), b"expect") or b"").lower() == b"100-continue"
        if body_done or expecting:
            await send_error(send, err, close)
            return
        await send_error(send, err, close, more_body=True)
        await _discard(receive, self.drain_bytes, self.drain_s)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _discard(receive: Any, max_bytes: int, max_s: float) -> None:
    """Read and drop request body until it ends, the client leaves, or a bound is hit."""
    seen = 0
    try:
        async with asyncio.timeout(max_s):
            while seen <= max_bytes:
                message = await receive()
                if message["type"] != "http.request":
                    return
                seen += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return
    except TimeoutError:
        return
