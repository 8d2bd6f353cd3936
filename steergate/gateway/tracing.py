"""Optional OpenTelemetry tracing: a tiny facade the request path calls, off by default.

Turned on by the standard OpenTelemetry environment, nothing of steergate's own:
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` set (and
neither ``OTEL_SDK_DISABLED=true`` nor ``OTEL_TRACES_EXPORTER=none``), with the
``otel`` extra installed (``pip install 'steergate[otel]'``). Spans then go to that
collector over OTLP/HTTP in batches; the exporter reads the rest of ``OTEL_EXPORTER_OTLP_*``
(headers, timeout, certificates), the sampler ``OTEL_TRACES_SAMPLER`` (default:
parent-based, always on) and the service name ``OTEL_SERVICE_NAME`` (default
``steergate-gateway``). Tests call :func:`configure` with an exporter of their own.

The API the request path uses:

* ``with span("admission", tenant_id=..., request_id=...):`` a child span of the
  current one. Keyword attributes become ``steergate.<name>`` (None values are left
  out); ``steergate.request_id`` is added from the request's context when not given.
  Off, it returns one shared no-op object: no span, no allocation, nothing recorded.
* :func:`inject_traceparent` adds W3C ``traceparent`` (and ``tracestate``) to the
  headers of a call to an engine: the current span's when tracing is on; the
  client's own, passed through unchanged, when it is off.
* :class:`TraceMiddleware` (installed by :func:`install`): on, one server span per
  HTTP request, named ``<METHOD> <route template>``, child of the client's
  ``traceparent`` if it sent one, with ``http.request.method``, ``http.route``,
  ``http.response.status_code``, ``steergate.request_id`` and, once the key is
  resolved, ``steergate.tenant_id``. Off, it only keeps a valid client
  ``traceparent`` for :func:`inject_traceparent`. Raw paths are never recorded (they
  hold conversation ids and vector names), only route templates.

The tracer provider is this module's own, never OpenTelemetry's global one, so the
gateway neither takes over nor depends on whatever else in the process uses tracing.
"""

from __future__ import annotations

import contextvars
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from steergate.shared import request_id

log = logging.getLogger("steergate.gateway.tracing")

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
ATTRIBUTE_PREFIX = "steergate."
DEFAULT_SERVICE_NAME = "steergate-gateway"
_TRACEPARENT_B = TRACEPARENT.encode()
_TRACESTATE_B = TRACESTATE.encode()
#: W3C trace-context: version-trace_id-parent_id-flags, lower-case hex; version ff and
#: all-zero ids are invalid. Longer values (a future version) are not passed on.
_VALID_TRACEPARENT = re.compile(
    r"(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}"
)
_MAX_TRACESTATE = 512

#: The client's (traceparent, tracestate) while tracing is off, for pass-through.
_client_context: contextvars.ContextVar[tuple[str, str | None] | None] = contextvars.ContextVar(
    "steergate_client_traceparent", default=None
)


class _NoopSpan:
    """What :func:`span` returns while tracing is off: one shared, stateless object with
    the span methods callers may use."""

    __slots__ = ()

    def __enter__(self) -> _NoopSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        pass

    def record_exception(self, exception: BaseException, **kwargs: Any) -> None:
        pass

    def is_recording(self) -> bool:
        return False


NOOP_SPAN = _NoopSpan()


class _State:
    """The tracer, while tracing is on (module-level: the facade has no app to ask)."""

    tracer: Any = None
    provider: Any = None
    propagator: Any = None
    server_kind: Any = None
    error_status: Any = None


_state = _State()


def enabled() -> bool:
    return _state.tracer is not None


def span(name: str, **attributes: Any) -> Any:
    """A context manager for a span named ``name``, child of the current one; its
    ``__enter__`` gives the span (or the no-op object). A no-op while tracing is off."""
    tracer = _state.tracer
    if tracer is None:
        return NOOP_SPAN
    return tracer.start_as_current_span(name, attributes=_attributes(attributes))


def inject_traceparent(headers: dict[str, str]) -> dict[str, str]:
    """Add ``traceparent`` (and ``tracestate``) for a call to an engine; returns
    ``headers``. On: the current span's context (nothing outside a request). Off: the
    client's own header, if it sent a valid one."""
    propagator = _state.propagator
    if propagator is not None:
        propagator.inject(headers)
        return headers
    client = _client_context.get()
    if client is not None:
        headers[TRACEPARENT] = client[0]
        if client[1]:
            headers[TRACESTATE] = client[1]
    return headers


def _attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in attributes.items():
        if value is None:
            continue
        if not isinstance(value, (str, bool, int, float)):
            value = str(value)
        out[ATTRIBUTE_PREFIX + key] = value
    rid_key = ATTRIBUTE_PREFIX + "request_id"
    if rid_key not in out:
        rid = request_id.current()
        if rid:
            out[rid_key] = rid
    return out


# ---------------------------------------------------------------------------- set-up


def configure(exporter: Any = None) -> bool:
    """Turn tracing on. ``exporter``: an OpenTelemetry ``SpanExporter``, each span handed
    to it as it ends (tests: ``InMemorySpanExporter``); None: OTLP/HTTP from the
    ``OTEL_EXPORTER_OTLP_*`` environment, batched. Returns False (and stays off) when
    the OpenTelemetry SDK is not installed."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace import SpanKind, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        log.warning(
            "tracing requested but OpenTelemetry is not installed: pip install "
            "'steergate[otel]'; tracing stays off"
        )
        return False
    if exporter is None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning(
                "tracing requested but the OTLP exporter is not installed: pip "
                "install 'steergate[otel]'; tracing stays off"
            )
            return False
        processor: Any = BatchSpanProcessor(OTLPSpanExporter())
    else:
        processor = SimpleSpanProcessor(exporter)
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    resource = Resource.create({} if named else {"service.name": DEFAULT_SERVICE_NAME})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(processor)
    shutdown()
    _state.provider = provider
    _state.propagator = TraceContextTextMapPropagator()
    _state.server_kind = SpanKind.SERVER
    _state.error_status = StatusCode.ERROR
    _state.tracer = provider.get_tracer("steergate.gateway")
    return True


def requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the OpenTelemetry environment asks for traces (an OTLP endpoint is set and
    the SDK or the traces exporter is not turned off)."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(
        env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    )


def shutdown() -> None:
    """Turn tracing off, flushing what the exporter still holds (tests; a process that
    exits flushes on its own)."""
    provider = _state.provider
    _state.tracer = _state.provider = _state.propagator = None
    if provider is not None:
        provider.shutdown()


def enable() -> None:
    """``create_app``'s one call: turn tracing on if the environment asks for it (once
    per process). :class:`TraceMiddleware` is in the app's middleware list."""
    if _state.tracer is None and requested():
        if configure():
            log.info("tracing on: OTLP/HTTP export")


# ---------------------------------------------------------------------------- middleware


class TraceMiddleware:
    """Plain ASGI: the request's server span (on), or the client's traceparent (off)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _state.tracer is not None:
            await self._traced(scope, receive, send)
            return
        traceparent = tracestate = None
        for name, value in scope["headers"]:
            if name == _TRACEPARENT_B:
                traceparent = value
            elif name == _TRACESTATE_B:
                tracestate = value
        if traceparent is None:  # the common case: nothing to do
            await self.app(scope, receive, send)
            return
        client = _client_trace(traceparent, tracestate)
        if client is None:
            await self.app(scope, receive, send)
            return
        token = _client_context.set(client)
        try:
            await self.app(scope, receive, send)
        finally:
            _client_context.reset(token)

    async def _traced(self, scope: Any, receive: Any, send: Any) -> None:
        tracer, propagator = _state.tracer, _state.propagator
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope["headers"]
            if name in (_TRACEPARENT_B, _TRACESTATE_B)
        }
        parent = propagator.extract(carrier) if carrier else None
        method = scope.get("method", "")
        attributes: dict[str, Any] = {"http.request.method": method}
        rid = request_id.current()
        if rid:
            attributes[ATTRIBUTE_PREFIX + "request_id"] = rid
        with tracer.start_as_current_span(
            method, context=parent, kind=_state.server_kind, attributes=attributes
        ) as server:
            status = 0

            async def send_status(message: Any) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = int(message.get("status", 0))
                    server.set_attribute("http.response.status_code", status)
                await send(message)

            try:
                await self.app(scope, receive, send_status)
            finally:
                route = getattr(scope.get("route"), "path", None)
                if isinstance(route, str):
                    server.update_name(f"{method} {route}")
                    server.set_attribute("http.route", route)
                tenant_id = (scope.get("state") or {}).get("tenant_id")
                if tenant_id:
                    server.set_attribute(ATTRIBUTE_PREFIX + "tenant_id", str(tenant_id))
                if status >= 500:
                    server.set_status(_state.error_status)


def _client_trace(traceparent: bytes, tracestate: bytes | None) -> tuple[str, str | None] | None:
    try:
        parent = traceparent.decode("ascii").strip()
    except UnicodeDecodeError:
        return None
    if _VALID_TRACEPARENT.fullmatch(parent) is None:
        return None
    state = None
    if tracestate is not None and len(tracestate) <= _MAX_TRACESTATE:
        try:
            text = tracestate.decode("ascii").strip()
        except UnicodeDecodeError:
            text = ""
        # Printable ASCII only (it goes back out in a header).
        state = text if text and all(" " <= c <= "~" for c in text) else None
    return parent, state
