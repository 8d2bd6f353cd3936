"""Liveness and readiness (the model list is ``steergate/gateway/routes/models.py``)."""

from __future__ import annotations

import asyncio

import orjson
from fastapi import APIRouter, Response

from steergate.gateway.deps import ServicesDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(svc: ServicesDep) -> Response:
    """Ready when Redis answers and at least one engine answered its info route at the
    last poll (the poller runs every ``reconcile_interval_s``; a probe never fans out)."""
    try:
        redis_ok = bool(await asyncio.wait_for(svc.redis.ping(), 1.0))
    except Exception:
        redis_ok = False
    engines = sum(1 for e in svc.engines.engines if e.healthy and e.info is not None)
    ok = redis_ok and engines >= 1
    return Response(
        orjson.dumps(
            {"status": "ready" if ok else "unavailable", "redis": redis_ok, "engines": engines}
        ),
        status_code=200 if ok else 503,
        media_type="application/json",
    )
