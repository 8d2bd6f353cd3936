"""``HEAD`` for every ``GET`` route (RFC 9110 §9.3.2): the same status and headers as
the ``GET``, no body.

FastAPI's routes answer only the methods they declare, so ``HEAD /v1/models`` was 405
while ``GET`` was 200; load balancers and uptime probes send ``HEAD``. The request runs
as the ``GET`` it stands for (authenticated, metered and logged like one), so a ``HEAD``
can learn nothing a ``GET`` would not tell; only the body is dropped on the way out
(``content-length`` still says the ``GET``'s length). Outermost, so every middleware
inside sees an ordinary ``GET``.
"""

from __future__ import annotations

from steergate.shared.asgi import ASGIApp, Message, Receive, Scope, Send


class HeadAsGetMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def send_head(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return  # a streamed body: nothing of it, one empty end below
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, send_head)
