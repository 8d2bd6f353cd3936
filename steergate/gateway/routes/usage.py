"""``GET /v1/usage``: the caller's own tenant — limits, current use, response counts
and the last hour minute by minute. See ``steergate/gateway/admission/usage.py`` for what each
number means; this route only authenticates and serialises."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from steergate.gateway.admission import usage
from steergate.gateway.deps import ServicesDep
from steergate.gateway.tenancy.auth import TenantDep

router = APIRouter(tags=["usage"])


@router.get("/v1/usage", responses={200: {"model": usage.TenantUsage}})
async def my_usage(tenant: TenantDep, svc: ServicesDep) -> dict[str, Any]:
    # Authentication may have come from the replica's cache; show the live limits.
    current = await svc.tenants.get(tenant.id) or tenant
    row = await usage.read_usage(svc.redis, current, usage.now_ms(), history=True)
    return row.model_dump(mode="json")
