"""Usage you can bill from: the daily rollups of a date range, as JSON or CSV.

* ``GET /v1/usage/export``: the caller's own tenant (tenant key).
* ``GET /admin/tenants/{tenant_id}/usage/export``: any tenant (admin key).

Query: ``start``, ``end`` (``YYYY-MM-DD``, UTC, inclusive; default the last 30 days
ending today; at most 400 days, the rollups' retention), ``group_by`` (``day``: one
row per day; ``key``: one row per day and API key with traffic), ``format``
(``json`` or ``csv``). What the numbers are: ``steergate/gateway/admission/usage.py`` (rollups) and
docs/api.md. The range's day hashes are read in pipelined slices
(``usage.ROLLUP_DAYS_PER_TRIP``); one tenant's exports run one at a time per process.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response

from steergate.gateway.admission import usage
from steergate.gateway.deps import Services, ServicesDep
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
    svc: Services,
    tenant_id: str,
    start: str | None,
    end: str | None,
    group_by: str | None,
    fmt: str | None,
) -> Response:
    grouping = usage.check_choice(group_by, usage.GROUP_BY, "group_by")
    kind = usage.check_choice(fmt, usage.FORMATS, "format")
    first, last = usage.export_range(start, end, usage.now_ms() / 1000)
    # A 400-day export by key is ~35k hash fields to read and shape: one tenant's
    # exports run one at a time (per gateway process), read in slices of days, and are
    # shaped on a thread, so the event loop every tenant shares is never held for it.
    async with svc.exports.turn(tenant_id):
        rollups = await usage.read_rollup_days(svc.redis, tenant_id, first, last)
        if kind == "json":
            body = await asyncio.to_thread(_json, tenant_id, first, rollups, grouping)
            return Response(body, media_type="application/json")
        doc, text = await asyncio.to_thread(_csv, tenant_id, first, rollups, grouping)
    filename = f"steergate-usage-{tenant_id}-{doc['start']}-{doc['end']}-by-{grouping}.csv"
    return Response(
        text,
        media_type="text/csv; charset=utf-8",
        headers={"Content-Disposition": f'attachment; filename="{filename}"'},
    )


def _json(tenant_id: str, first: int, rollups: list[dict[str, Any]], grouping: str) -> bytes:
    return orjson.dumps(usage.export_doc(tenant_id, first, rollups, grouping))


def _csv(
    tenant_id: str, first: int, rollups: list[dict[str, Any]], grouping: str
) -> tuple[dict[str, Any], str]:
    doc = usage.export_doc(tenant_id, first, rollups, grouping)
    return doc, usage.export_csv(doc)


@router.get("/v1/usage/export", responses=_RESPONSES)
async def my_usage_export(
    tenant: TenantDep,
    svc: ServicesDep,
    start: str | None = _START,
    end: str | None = _END,
    group_by: str | None = _GROUP_BY,
    format: str | None = _FORMAT,
) -> Response:
    return await _export(svc, tenant.id, start, end, group_by, format)


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
    check_tenant_id(tenant_id, "tenant_id")
    await svc.tenants.require(tenant_id)
    return await _export(svc, tenant_id, start, end, group_by, format)
