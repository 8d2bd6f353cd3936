"""The admin API (contract §3): tenants, their keys, everyone's usage, the engines.

Every route needs the admin key (``AdminDep``: compared in constant time; a tenant
key is 403, no or an unknown key 401). Decisions about limits — validation, the
overcommit 409 — are ``TenantStore``'s, so the CLI, ``steergate up`` and this API
can never disagree. Bodies are parsed by hand rather than by FastAPI models so that
every 400 is OpenAI-shaped and names its field (``param``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from gateway import usage
from gateway.auth import require_admin
from gateway.deps import get_services
from gateway.engines import EngineClient
from gateway.overview import capacity, engine_statuses
from gateway.tenants import Limits, Tenant, TenantStore
from shared.errors import APIError, InvalidField
from shared.jsondepth import check_json_depth
from shared.scoping import check_tenant_id

log = logging.getLogger("steergate.gateway.admin")

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])

CREATE_FIELDS = {"id", "name", "limits", "allow_overcommit"}
MAX_NAME = 200


class TenantCreateBody(BaseModel):
    """``POST /admin/tenants`` (documentation only: bodies are parsed by hand below)."""

    id: str = Field(description="1-32 characters of [a-z0-9-]")
    name: str = Field(default="", max_length=MAX_NAME)
    limits: Limits = Field(default_factory=Limits, description="omitted fields take defaults")
    allow_overcommit: bool = False


class TenantPatchBody(BaseModel):
    """``PATCH /admin/tenants/{id}``: every field optional; ``limits`` may be partial."""

    name: str | None = Field(default=None, max_length=MAX_NAME)
    limits: dict[str, Any] | None = Field(default=None, description="a subset of Limits")
    allow_overcommit: bool | None = None


def _body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """An inline OpenAPI request body for ``model`` ($defs resolved in place, since
    the schema is not registered under components)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.rsplit("/", 1)[1]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": inline(schema)}},
        }
    }


def _store(request: Request) -> TenantStore:
    return get_services(request).tenants


def _engines(request: Request) -> EngineClient:
    return get_services(request).engines


async def _json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    check_json_depth(raw)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidField("body", "The request body is not valid JSON.", "invalid_json") from exc
    if not isinstance(body, dict):
        raise InvalidField("body", "The request body must be a JSON object.", "invalid_json")
    return body


def _check_common(body: dict[str, Any]) -> None:
    name = body.get("name")
    if name is not None and (not isinstance(name, str) or len(name) > MAX_NAME):
        raise InvalidField("name", f"'name' must be a string of at most {MAX_NAME} characters")
    if "allow_overcommit" in body and not isinstance(body["allow_overcommit"], bool):
        raise InvalidField("allow_overcommit", "'allow_overcommit' must be a boolean")
    limits = body.get("limits")
    if limits is not None and not isinstance(limits, dict):
        raise InvalidField("limits", "'limits' must be an object")


def _public(tenant: Tenant) -> dict[str, Any]:
    return tenant.model_dump(mode="json")


# ------------------------------------------------------------------------- tenants


@router.post("/tenants", status_code=201, openapi_extra=_body_doc(TenantCreateBody))
async def create_tenant(request: Request) -> JSONResponse:
    body = await _json_object(request)
    for field in body:
        if field not in CREATE_FIELDS:
            raise InvalidField(str(field), f"unknown field '{field}'")
    if "id" not in body:
        raise InvalidField("id", "'id' is required")
    check_tenant_id(body["id"])
    _check_common(body)
    tenant = await _store(request).create(
        body["id"],
        name=body.get("name") or "",
        limits=body.get("limits"),
        allow_overcommit=bool(body.get("allow_overcommit", False)),
    )
    log.info("tenant %s created", tenant.id)
    return JSONResponse(_public(tenant), status_code=201)


@router.get("/tenants")
async def list_tenants(request: Request) -> dict[str, Any]:
    return {"tenants": [_public(t) for t in await _store(request).list()]}


@router.get("/tenants/{tenant_id}")
async def get_tenant(tenant_id: str, request: Request) -> dict[str, Any]:
    return _public(await _store(request).require(tenant_id))


@router.patch("/tenants/{tenant_id}", openapi_extra=_body_doc(TenantPatchBody))
async def update_tenant(tenant_id: str, request: Request) -> dict[str, Any]:
    body = await _json_object(request)
    _check_common(body)
    if "id" in body and body["id"] != tenant_id:
        raise InvalidField("id", "a tenant's id cannot be changed")
    body.pop("id", None)
    tenant = await _store(request).update(tenant_id, body)
    log.info("tenant %s updated", tenant_id)
    return _public(tenant)


@router.delete("/tenants/{tenant_id}", status_code=204)
async def delete_tenant(tenant_id: str, request: Request) -> Response:
    if not await _store(request).delete(tenant_id):
        raise APIError("tenant_not_found", f"no tenant '{tenant_id}'", param="id")
    await get_services(request).sync.sync_tenant(tenant_id)
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.forget_tenant(tenant_id)
    log.info("tenant %s deleted", tenant_id)
    return Response(status_code=204)


# ------------------------------------------------------------------------- keys


@router.post("/tenants/{tenant_id}/keys", status_code=201)
async def create_key(tenant_id: str, request: Request) -> JSONResponse:
    await _json_object(request)  # accepted and ignored: keys have no options yet
    key_id, key, prefix = await _store(request).create_key(tenant_id)
    log.info("key %s created for tenant %s", key_id, tenant_id)
    return JSONResponse(
        {"key_id": key_id, "key": key, "prefix": prefix, "tenant_id": tenant_id},
        status_code=201,
        headers={"Cache-Control": "no-store"},
    )


@router.get("/tenants/{tenant_id}/keys")
async def list_keys(tenant_id: str, request: Request) -> dict[str, Any]:
    return {"keys": [k.public() for k in await _store(request).list_keys(tenant_id)]}


@router.delete("/keys/{key_id}", status_code=204)
async def revoke_key(key_id: str, request: Request) -> Response:
    if not await _store(request).revoke_key(key_id):
        raise APIError("key_not_found", f"no key '{key_id}'", param="key_id")
    log.info("key %s revoked", key_id)
    return Response(status_code=204)


# ------------------------------------------------------------------------- usage, engines


@router.get("/usage")
async def all_usage(
    request: Request,
    tenant: str | None = Query(default=None, description="only this tenant"),
    history: bool = Query(default=False, description="include the per-minute history"),
) -> dict[str, Any]:
    store = _store(request)
    tenants = await store.list()
    shown = tenants
    if tenant is not None:
        check_tenant_id(tenant, "tenant")
        shown = [t for t in tenants if t.id == tenant]
        if not shown:
            raise APIError("tenant_not_found", f"no tenant '{tenant}'", param="tenant")
    now = usage.now_ms()
    rows = await asyncio.gather(
        *(usage.read_usage(store.redis, t, now, history=history) for t in shown)
    )
    caps = _engines(request).pool.caps()
    return {
        "tenants": [r.model_dump(mode="json", exclude_none=True) for r in rows],
        "capacity": {k: v.model_dump() for k, v in capacity(tenants, caps).items()},
    }


@router.get("/engines")
async def engines(request: Request) -> dict[str, Any]:
    statuses = await engine_statuses(_engines(request))
    return {"engines": [s.model_dump(mode="json") for s in statuses]}
