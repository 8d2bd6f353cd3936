"""Request-body limit as plain ASGI middleware (streams correctly, unlike
BaseHTTPMiddleware): a declared Content-Length over the limit is refused before
reading; a chunked body is counted as it streams and cut off at the limit."""

from __future__ import annotations

from typing import Any

from shared.asgi import send_error
from shared.errors import APIError

Scope = dict[str, Any]


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

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
                    await _too_large(send, self.max_bytes)
                    return
        if declared >= 0:
            # The HTTP server delivers exactly Content-Length bytes, so a declared
            # length within the limit needs no counting (the common, hot case).
            await self.app(scope, receive, send)
            return
        seen = 0
        started = False

        async def counting_receive() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
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
                await _too_large(send, self.max_bytes)


async def _too_large(send: Any, limit: int) -> None:
    err = APIError(413, "request_too_large", f"Request body exceeds {limit} bytes.")
    await send_error(send, err, [(b"connection", b"close")])
