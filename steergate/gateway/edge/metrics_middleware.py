"""The ASGI edge of the metrics: observe each tenant request as the client saw it.

Plain ASGI middleware (not ``BaseHTTPMiddleware``), so streamed responses pass
through chunk by chunk and the duration ends at the last chunk actually sent. The
request path needs no metrics calls of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from steergate.gateway.admission import usage
from steergate.gateway.admission.refusals import STATE_KEY, Refusal
from steergate.gateway.edge.metrics import Metrics

log = logging.getLogger("steergate.gateway.metrics")


Scope = dict[str, Any]
Message = dict[str, Any]
RejectionSink = Callable[[Scope, str, Refusal], Awaitable[None]]
#: The ``cause`` label of a 429 that carries no refusal (not one the gateway made).
UNKNOWN_CAUSE = "unknown"


class MetricsMiddleware:
    """Plain ASGI middleware (streams pass through untouched) that observes every
    request an authenticated tenant made, after its last byte was sent.

    The tenant id comes from ``request.state.tenant_id`` (set by ``auth.get_tenant``),
    the route from the matched route's template. For a 429 the cause is the
    ``Refusal`` the request state carries (``admission/refusals.py``; set by the app's
    error handler): its error code labels the metric, and it is handed to
    ``on_rejection`` (it records the cause in Redis for ``/v1/usage``). A 429 without
    one (not the gateway's own refusal) is labelled ``unknown``."""

    def __init__(
        self, app: Any, metrics: Metrics, on_rejection: RejectionSink | None = None
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.on_rejection = on_rejection

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0
        latch_state: str | None = None
        finished = False
        stream = False  # an SSE answer: its first event's time is the TTFT

        async def observing_send(message: Message) -> None:
            nonlocal status, latch_state, finished, stream
            if message["type"] == "http.response.start":
                status = int(message["status"])
                for name, value in message.get("headers", []):
                    low = name.lower()
                    if low == b"x-steering-latch":
                        latch_state = value.decode("latin-1")
                    elif low == b"content-type" and value.startswith(b"text/event-stream"):
                        stream = True
            elif message["type"] == "http.response.body":
                if stream and message.get("body"):
                    stream = False  # only the first event
                    tenant_id = (scope.get("state") or {}).get("tenant_id")
                    if tenant_id:
                        route = getattr(scope.get("route"), "path", None) or "unmatched"
                        self.metrics.observe_first_token(
                            str(tenant_id), route, time.perf_counter() - started
                        )
                finished = not message.get("more_body", False)
            await send(message)

        try:
            await self.app(scope, receive, observing_send)
        except Exception:
            # Unhandled: the server-error middleware outside this one answers 500.
            status = status or 500
            raise
        finally:
            tenant_id = (scope.get("state") or {}).get("tenant_id")
            if tenant_id and status:
                await self._observe(
                    scope,
                    str(tenant_id),
                    status,
                    latch_state,
                    time.perf_counter() - started if finished else None,
                )

    async def _observe(
        self,
        scope: Scope,
        tenant_id: str,
        status: int,
        latch_state: str | None,
        seconds: float | None,
    ) -> None:
        route = getattr(scope.get("route"), "path", None) or "unmatched"
        self.metrics.observe_request(tenant_id, route, status, seconds)
        if latch_state and latch_state != "none":
            self.metrics.observe_latch(tenant_id, latch_state)
        if status == 429:
            refusal = (scope.get("state") or {}).get(STATE_KEY)
            if not isinstance(refusal, Refusal):
                self.metrics.observe_rejection(tenant_id, UNKNOWN_CAUSE)
                return
            self.metrics.observe_rejection(tenant_id, refusal.code)
            if self.on_rejection is not None:
                try:
                    await self.on_rejection(scope, tenant_id, refusal)
                except Exception as exc:  # noqa: BLE001 - counting must never fail a request
                    log.warning("could not record a 429 cause: %s", type(exc).__name__)


async def record_rejection(scope: Scope, tenant_id: str, refusal: Refusal) -> None:
    services = getattr(scope["app"].state, "services", None)
    if services is not None:
        await usage.record_rejection(services.redis, tenant_id, refusal, usage.now_ms())
