"""Liveness, readiness and the model list."""

from __future__ import annotations

import asyncio

import orjson
from fastapi import APIRouter, Response

from gateway.auth import TenantDep
from gateway.deps import ServicesDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(svc: ServicesDep) -> Response:
    """Ready when Redis answers and at least one engine answers its info route."""
    try:
        redis_ok = bool(await asyncio.wait_for(svc.redis.ping(), 1.0))
    except Exception:
        redis_ok = False
    await svc.pool.refresh()
    engines = sum(1 for e in svc.pool.engines if e.healthy and e.info is not None)
    ok = redis_ok and engines >= 1
    return Response(
        orjson.dumps(
            {"status": "ready" if ok else "unavailable", "redis": redis_ok, "engines": engines}
        ),
        status_code=200 if ok else 503,
        media_type="application/json",
    )


@router.get("/v1/models")
async def models(tenant: TenantDep, svc: ServicesDep) -> Response:
    r = await svc.pool.request("GET", "/v1/models")
    return Response(r.body, status_code=r.status, media_type="application/json")
