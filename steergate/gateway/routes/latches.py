"""A tenant's latches, as Redis (the system of record) holds them. A delete removes
the latch and its spec from Redis, then from every engine's cache (best effort: an
engine that misses it is dirty and synced before it serves again). Clients only
ever see their own ids."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Response

from steergate.gateway.deps import ServicesDep
from steergate.gateway.store import key_names as keys
from steergate.gateway.store.connection import store_errors
from steergate.gateway.store.scripts import DropLatch
from steergate.gateway.tenancy.auth import TenantDep
from steergate.shared.errors import APIError
from steergate.shared.scoping import check_conversation_id

router = APIRouter(tags=["latches"])


@router.get("/v1/steering/latches")
async def list_latches(tenant: TenantDep, svc: ServicesDep) -> Response:
    async with store_errors():
        members = await svc.redis.zrange(keys.latches(tenant.id), 0, -1, withscores=True)
        info = await svc.redis.hgetall(keys.latch_info(tenant.id))
    rows = []
    for conv, used in reversed(members):  # most recently used first
        entry = keys.LatchEntry.parse(info.get(conv))
        rows.append(
            {
                "conversation_id": conv,
                "bytes": entry.nbytes,
                "kind": entry.kind,
                "last_used": used / 1000.0,
            }
        )
    return Response(orjson.dumps(rows), media_type="application/json")


@router.delete("/v1/steering/latches/{conversation_id}", status_code=204)
async def delete_latch(conversation_id: str, tenant: TenantDep, svc: ServicesDep) -> Response:
    check_conversation_id(conversation_id)
    async with store_errors():
        removed = await svc.scripts.run(
            DropLatch(
                tenant_id=tenant.id,
                generation=tenant.created_at,
                conversation_ids=[conversation_id],
            )
        )
    if not removed:
        raise APIError(
            "latch_not_found",
            f"No latch for conversation '{conversation_id}'.",
            param="conversation_id",
        )
    await svc.engines.delete_latch_everywhere(tenant.id, conversation_id)
    return Response(status_code=204)
