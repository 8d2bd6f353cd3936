"""``GET /metrics``: read the state series fresh (Redis, engines), then serialise.

A scrape never fails because Redis or an engine is down: that is exactly what it
must report (``steergate_store_up 0``, ``steergate_engine_up{...} 0``).

It needs the scrape token or the admin key (``auth.require_metrics_reader``): it lists
every tenant's usage and the engines' URLs, and each scrape costs Redis and engine calls.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from steergate.gateway.admission import usage
from steergate.gateway.deps import Services, get_services
from steergate.gateway.edge.metrics import (
    CONTENT_TYPE,
    EngineSample,
    Metrics,
    QuotaSample,
    Snapshot,
    TenantSample,
)
from steergate.gateway.engines.overview import engine_statuses
from steergate.gateway.tenancy.auth import require_metrics_reader

router = APIRouter(include_in_schema=False, dependencies=[Depends(require_metrics_reader)])


async def _tenant_samples(svc: Services) -> dict[str, TenantSample]:
    tenants = await svc.tenants.list()
    now = usage.now_ms()
    rows = await asyncio.gather(
        *(usage.read_usage(svc.redis, t, now, history=False, minutes=0) for t in tenants)
    )
    return {
        row.tenant_id: TenantSample(
            quotas={name: QuotaSample(q.used, q.limit) for name, q in row.quotas.items()},
            tokens_total=row.tokens_total,
        )
        for row in rows
    }


async def snapshot(svc: Services) -> Snapshot:
    started = time.perf_counter()
    try:
        await asyncio.wait_for(svc.redis.ping(), svc.settings.redis_timeout_s * 2)
        ping_s: float | None = time.perf_counter() - started
        quotas = await _tenant_samples(svc)
        store_up = True
    except Exception:  # noqa: BLE001 - whatever the store failure, the answer is "down"
        ping_s, quotas, store_up = None, {}, False
    engines = tuple(
        EngineSample(
            url=s.url,
            up=s.up,
            status={
                k: float(v)
                for k, v in (s.status or {}).items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            },
        )
        for s in await engine_statuses(svc.engines)
    )
    return Snapshot(store_up=store_up, store_ping_s=ping_s, tenants=quotas, engines=engines)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    registry: Metrics = request.app.state.metrics
    body = registry.render(await snapshot(get_services(request)))
    return Response(body, media_type=CONTENT_TYPE)
