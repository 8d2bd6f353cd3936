"""Bearer-token auth for every engine path (vLLM's own routes included).

A pure ASGI middleware: it decides on the request head alone and never touches the
body, so streams pass through untouched. The token is compared in constant time.
"""

from __future__ import annotations

import hmac

from steergate.shared.asgi import ASGIApp, Receive, Scope, Send, send_error, sole_header
from steergate.shared.errors import APIError


class EngineTokenMiddleware:
    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        # No token configured fails closed: every request is refused.
        self._expected = token.encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if self._authorized(sole_header(scope.get("headers", []), b"authorization")):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send_error(
            send,
            APIError(
                "invalid_api_key", "missing or invalid engine token (Authorization: Bearer)"
            ),
            [(b"www-authenticate", b"Bearer")],
        )

    def _authorized(self, presented: bytes | None) -> bool:
        if self._expected is None or presented is None:
            return False
        scheme, _, credentials = presented.strip().partition(b" ")
        if scheme.lower() != b"bearer":  # the scheme is case-insensitive (RFC 7235)
            return False
        return hmac.compare_digest(credentials.strip(), self._expected)
