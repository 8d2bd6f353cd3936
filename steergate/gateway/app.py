"""Assembly only: settings -> services (in the lifespan) -> middleware and routers.

The lifespan owns every pool (Redis, the engine client) and background task (auth invalidation,
engine polling, settlement); nothing lives at module level.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect

from steergate.gateway import tracing
from steergate.gateway.admission import refusals
from steergate.gateway.admission.bodies import BodyParser
from steergate.gateway.admission.limits import Limiter
from steergate.gateway.admission.refusals import Refused
from steergate.gateway.admission.request_scoping import InlineBudget
from steergate.gateway.admission.settlement import CLIENT_CLOSED, Settler
from steergate.gateway.deps import Services
from steergate.gateway.edge import openapi
from steergate.gateway.edge.body_limit import BodyLimitMiddleware
from steergate.gateway.edge.head import HeadAsGetMiddleware
from steergate.gateway.edge.metrics import Metrics
from steergate.gateway.edge.metrics_middleware import MetricsMiddleware, record_rejection
from steergate.gateway.engines.client import EngineClient
from steergate.gateway.engines.sync import EngineSync
from steergate.gateway.engines.upstream import EnginePool
from steergate.gateway.routes import (
    admin,
    dashboard,
    from_examples,
    health,
    inference,
    latches,
    models,
    tokenize,
    usage,
    usage_export,
    vectors,
)
from steergate.gateway.routes import metrics as metrics_route
from steergate.gateway.store import key_names as keys
from steergate.gateway.store.connection import Redis, connect
from steergate.gateway.store.scripts import Scripts
from steergate.gateway.tenancy.tenants import TenantStore
from steergate.gateway.vectors.contrast_jobs import ContrastJobs
from steergate.shared import request_id
from steergate.shared.errors import APIError, code_for_status, render
from steergate.shared.openai_errors import OpenAIErrorMiddleware
from steergate.shared.request_id import RequestIdMiddleware
from steergate.shared.settings import GatewaySettings

log = logging.getLogger("steergate.gateway")

#: Every router, in the order the routes are matched.
ROUTERS = (
    inference,
    models,
    tokenize,
    from_examples,
    vectors,
    latches,
    health,
    admin,
    usage,
    usage_export,
    dashboard,
    metrics_route,
)


def build_services(
    settings: GatewaySettings,
    redis: Redis | None = None,
    pool: EnginePool | None = None,
    engine_transport: httpx.AsyncBaseTransport | None = None,
) -> Services:
    if redis is None:
        redis = connect(
            settings.redis_url, settings.redis_timeout_s, settings.redis_health_check_interval_s
        )
    scripts = Scripts.load(redis)
    pool = pool or EnginePool(
        settings.engine_url_list,
        settings.engine_token.get_secret_value() if settings.engine_token else "",
        connect_timeout_s=settings.engine_connect_timeout_s,
        read_timeout_s=settings.engine_read_timeout_s,
        transport=engine_transport,
    )
    engines = EngineClient(pool)
    sync = EngineSync(redis, engines, full_sync_interval_s=settings.engine_sync_interval_s)
    pool.on_dirty = sync.sync

    async def on_tenant_deleted(tenant_id: str, latch_ids: list[str], names: list[str]) -> None:
        # Best effort: an engine that misses one of these is marked dirty, and the sync
        # deletes the rest when it is back (the tenant is gone from Redis by now).
        for conv in latch_ids:
            await engines.delete_latch_everywhere(tenant_id, conv)
        for name in names:
            await engines.delete_vector_everywhere(tenant_id, name)

    tenants = TenantStore(
        redis,
        settings.key_pepper.get_secret_value() if settings.key_pepper else "",
        engine_caps=pool.caps,
        on_deleted=on_tenant_deleted,
        refuse_overcommit=settings.refuse_overcommit,
        scripts=scripts,
    )
    # Settlement is Redis work only: a latch Redis no longer holds is never bridged by an
    # engine (steergate_expect), and the engine sync deletes its copy.
    settler = Settler(
        redis,
        scripts,
        lease_ttl_s=settings.lease_ttl_s,
        flush_interval_s=settings.settle_interval_s,
    )
    return Services(
        settings=settings,
        redis=redis,
        scripts=scripts,
        tenants=tenants,
        engines=engines,
        sync=sync,
        limiter=Limiter(
            scripts,
            lease_ttl_s=settings.lease_ttl_s,
            fail_open=settings.rate_limit_fail_open,
            settler=settler,
            redis_timeout_s=settings.redis_timeout_s,
        ),
        settler=settler,
        bodies=BodyParser(settings.body_parse_workers, InlineBudget.of(settings)),
        contrast=ContrastJobs(memory_bytes=settings.examples_memory_bytes),
    )


def create_app(
    settings: GatewaySettings | None = None,
    *,
    redis: Redis | None = None,
    engine_transport: httpx.AsyncBaseTransport | None = None,
) -> FastAPI:
    """``engine_transport`` (tests only): talk to the engines through this httpx
    transport, e.g. ``httpx.ASGITransport(app=engine_app)``, instead of sockets."""
    settings = settings or GatewaySettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        svc = build_services(settings, redis, engine_transport=engine_transport)
        app.state.services = svc
        svc.settler.on_outcome = app.state.metrics.observe_outcome
        svc.tenants.events.on_tenant_deleted.append(app.state.metrics.forget_tenant)
        # Accessors for the admin / usage / dashboard / metrics routers.
        app.state.settings = settings
        app.state.tenants = svc.tenants
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(svc.tenants.events.listen(stop)),
            asyncio.create_task(svc.tenants.key_use.run(stop)),  # keys' last use, batched
            asyncio.create_task(svc.settler.run(stop)),
            asyncio.create_task(_start_engines(svc, stop)),
        ]
        try:
            yield
        finally:
            stop.set()
            await asyncio.wait(tasks, timeout=2.0)
            for t in tasks:
                t.cancel()
            await svc.engines.pool.aclose()
            svc.bodies.close()
            svc.contrast.close()
            with contextlib.suppress(Exception):
                await svc.redis.aclose()

    # The app's own registry; ``GET /metrics`` (in ``ROUTERS``) serves it.
    metrics = Metrics()
    tracing.enable()  # OTEL_EXPORTER_OTLP_*: steergate/gateway/tracing.py
    request_id.install_log_records()
    # No /docs or /redoc (FastAPI's load Swagger UI / ReDoc from a CDN), and the schema
    # only behind the admin key: see steergate/gateway/edge/openapi.py.
    app = FastAPI(
        title="steergate gateway",
        version="0.1.0",
        lifespan=lifespan,
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
        # Paths are exact (as OpenAI's): Starlette would answer a trailing slash with a
        # redirect to the Host header's origin, wherever the request claimed to go.
        redirect_slashes=False,
        middleware=middleware(settings, metrics),
    )
    app.state.metrics = metrics
    _install_error_handlers(app)
    for router_module in ROUTERS:
        app.include_router(router_module.router)
    openapi.install(app)
    return app


def middleware(settings: GatewaySettings, metrics: Metrics) -> list[Middleware]:
    """The gateway's ASGI stack, outermost first (each sees what the ones after it send)."""
    return [
        # HEAD runs as the GET it stands for; only the body is dropped.
        Middleware(HeadAsGetMiddleware),
        # Every response, and every log line written while serving it, carries the
        # request id.
        Middleware(RequestIdMiddleware),
        # Every error leaves in the one shape: the 413 below, a 500, a 429 the
        # metrics count.
        Middleware(OpenAIErrorMiddleware, passthrough=frozenset({"/readyz"})),
        # The request's server span (or the client's traceparent, passed on).
        Middleware(tracing.TraceMiddleware),
        # Each tenant request as the client saw it, after its last byte.
        Middleware(MetricsMiddleware, metrics=metrics, on_rejection=record_rejection),
        # Innermost: an oversized body is refused before anything reads it.
        Middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes),
    ]


async def _start_engines(svc: Services, stop: asyncio.Event) -> None:
    """Poll the engines: info (shape, caps, epoch, health), a sync of each dirty engine
    right after, and a periodic sync of every engine (``steergate/gateway/engines/sync.py``)."""
    while not stop.is_set():
        try:
            await svc.engines.pool.refresh()
            await svc.sync.periodic()
        except Exception as exc:  # never let the poller die; the next round retries
            log.warning("engine poll failed: %s", type(exc).__name__)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), svc.settings.reconcile_interval_s)


def _respond(request: Request, exc: APIError) -> Response:
    if isinstance(exc, Refused):  # the metrics middleware counts it by its cause
        setattr(request.state, refusals.STATE_KEY, exc.refusal)
    out = render(exc)
    return Response(out.body, status_code=out.status, headers=out.headers)


def _install_error_handlers(app: FastAPI) -> None:
    """Every error the app raises becomes an ``APIError``, answered by ``_respond``."""

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return _respond(request, exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        message = str(exc.detail)
        if status == 404:  # OpenAI's words for a route that does not exist
            message = f"Invalid URL ({request.method} {request.url.path})"
        # Starlette's own headers stay (a 405's Allow, which RFC 9110 requires).
        headers = dict(exc.headers or {})
        return _respond(
            request, APIError(code_for_status(status), message, status=status, headers=headers)
        )

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first: dict[str, Any] = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = f"Invalid request: {first.get('msg', 'bad input')}"
        return _respond(request, APIError("invalid_request", message, param=param))

    async def client_left(request: Request, exc: Exception) -> Response:
        # The client went away while its body was being read (or the body bound closed
        # its connection): nothing ran and nobody is listening. Not a server error.
        log.info("client left before its request body was read on %r", request.url.path)
        return Response(status_code=CLIENT_CLOSED)

    async def unexpected(request: Request, exc: Exception) -> Response:
        # %r: a decoded path may hold a newline (%0A), which must not start a forged log line.
        log.error("unhandled error on %r: %s", request.url.path, type(exc).__name__)
        return _respond(request, APIError("internal_error", "Internal error."))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(ClientDisconnect, client_left)
    app.add_exception_handler(Exception, unexpected)


__all__ = ["create_app", "build_services", "keys"]
