"""Usage you can bill from: the daily rollups of a date range, as JSON or CSV.

* ``GET /v1/usage/export``: the caller's own tenant (tenant key).
* ``GET /admin/tenants/{tenant_id}/usage/export``: any tenant (admin key).

Query: ``start``, ``end`` (``YYYY-MM-DD``, UTC, inclusive; default the last 30 days
ending today; at most 400 days, the rollups' retention), ``group_by`` (``day``: one
row per day; ``key``: one row per day and API key with traffic), ``format``
(``json`` or ``csv``). What the numbers are: ``steergate/gateway/admission/usage.py`` (rollups) and
docs/api.md. All the range's day hashes are read in one pipelined round trip.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse, Response

from steergate.gateway.admission import usage
from steergate.gateway.deps import ServicesDep
from steergate.gateway.tenancy.auth import TenantDep, require_admin
from steergate.shared.scoping import check_tenant_id

router = APIRouter(tags=["usage"])

_START = Query(default=None, description="first day, YYYY-MM-DD (UTC); default: end - 29 days")
_END = Query(default=None, description="last day, YYYY-MM-DD (UTC, inclusive); default: today")
_GROUP_BY = Query(default=None, description="day (default) or key (one row per day and key)")
_FORMAT = Query(default=None, description="json (default) or csv")
#: Documents both answers (the JSON document; CSV as a download).
_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "JSON: {object, tenant_id, start, end, group_by, columns, rows, "
        "totals}; CSV (format=csv): a header row, then the rows, as an attachment.",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/csv": {"schema": {"type": "string"}},
        },
    }
}


async def _export(
    redis: Any,
    tenant_id: str,
    start: str | None,
    end: str | None,
    group_by: str | None,
    fmt: str | None,
) -> Response:
    grouping = usage.check_choice(group_by, usage.GROUP_BY, "group_by")
    kind = usage.check_choice(fmt, usage.FORMATS, "format")
    first, last = usage.export_range(start, end, usage.now_ms() / 1000)
    rollups = await usage.read_rollup_days(redis, tenant_id, first, last)
    doc = usage.export_doc(tenant_id, first, rollups, grouping)
    if kind == "json":
        return JSONResponse(doc)
    filename = f"steergate-usage-{tenant_id}-{doc['start']}-{doc['end']}-by-{grouping}.csv"
    return Response(
        usage.export_csv(doc),
        media_type="text/csv; charset=utf-8",
        headers={"Content-Disposition": f'attachment; filename="{filename}"'},
    )


@router.get("/v1/usage/export", responses=_RESPONSES)
async def my_usage_export(
    tenant: TenantDep,
    svc: ServicesDep,
    start: str | None = _START,
    end: str | None = _END,
    group_by: str | None = _GROUP_BY,
    format: str | None = _FORMAT,
) -> Response:
    return await _export(svc.redis, tenant.id, start, end, group_by, format)


@router.get(
    "/admin/tenants/{tenant_id}/usage/export",
    tags=["admin"],
    dependencies=[Depends(require_admin)],
    responses=_RESPONSES,
)
async def tenant_usage_export(
    tenant_id: str,
    svc: ServicesDep,
    start: str | None = _START,
    end: str | None = _END,
    group_by: str | None = _GROUP_BY,
    format: str | None = _FORMAT,
) -> Response:
    check_tenant_id(tenant_id)
    await svc.tenants.require(tenant_id)
    return await _export(svc.redis, tenant_id, start, end, group_by, format)
