"""The admin API (contract §3): tenants, their keys, admin keys, the audit log,
everyone's usage, the engines.

Every route needs an admin key (``require_admin`` on the router: the bootstrap
``STEERGATE_ADMIN_KEY``, compared in constant time, or a key from ``POST
/admin/keys``; a ``viewer`` key may only GET; a tenant key is 403, no or an unknown
key 401). Decisions about limits — validation, the overcommit 409 — are
``TenantStore``'s, so the CLI, ``steergate up`` and this API can never disagree.
Bodies are parsed by hand rather than by FastAPI models so that every 400 is
OpenAI-shaped and names its field (``param``). Every write is recorded in the audit
log (``steergate/gateway/tenancy/audit.py``) after it succeeded.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, BeforeValidator, Field

from steergate.gateway.admission import usage
from steergate.gateway.admission.bodies import parse_body
from steergate.gateway.deps import get_services
from steergate.gateway.engines.client import EngineClient
from steergate.gateway.engines.overview import capacity, engine_statuses
from steergate.gateway.tenancy import audit
from steergate.gateway.tenancy.api_keys import looks_like_key_id
from steergate.gateway.tenancy.auth import require_admin
from steergate.gateway.tenancy.records import (
    ADMIN_ROLES,
    DEFAULT_GRACE_S,
    KEY_FIELDS,
    MAX_GRACE_S,
    MAX_NAME,
    SCOPES,
    AdminKey,
    KeyInfo,
    KeyLimits,
    Limits,
    Tenant,
    check_name,
)
from steergate.gateway.tenancy.tenants import TenantStore
from steergate.shared import request_id
from steergate.shared.errors import APIError, InvalidField, reject_unknown
from steergate.shared.scoping import check_tenant_id

log = logging.getLogger("steergate.gateway.admin")

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])

CREATE_FIELDS = {"id", "name", "limits", "allow_overcommit"}


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


class KeyCreateBody(BaseModel):
    """``POST /admin/tenants/{id}/keys`` (documentation only; every field optional)."""

    name: str = Field(default="", max_length=MAX_NAME)
    expires_at: float | None = Field(
        default=None, description="unix seconds; past it the key is 401 expired_api_key"
    )
    scopes: list[str] = Field(
        default=list(SCOPES), description=f"any of {', '.join(SCOPES)}; default all"
    )
    limits: KeyLimits = Field(
        default_factory=KeyLimits, description="rpm, max_concurrency: each <= the tenant's"
    )


class KeyRotateBody(BaseModel):
    """``POST /admin/keys/{key_id}/rotate``."""

    grace_s: int = Field(
        default=DEFAULT_GRACE_S,
        ge=0,
        le=MAX_GRACE_S,
        description="seconds the old secret keeps working",
    )


class AdminKeyCreateBody(BaseModel):
    """``POST /admin/keys``."""

    role: str = Field(description=" or ".join(ADMIN_ROLES))
    name: str = Field(default="", max_length=MAX_NAME)


def _store(request: Request) -> TenantStore:
    return get_services(request).tenants


def _actor(request: Request) -> AdminKey:
    """The admin key of this request (set by ``require_admin``, the router's dependency)."""
    actor: AdminKey = request.state.admin
    return actor


async def _audit(
    request: Request, action: str, target: str, fields: dict[str, Any] | None = None
) -> None:
    """Record an admin write (after it succeeded). Never pass a secret or a hash."""
    actor = _actor(request)
    await _store(request).audit.record(
        actor=actor.key_id,
        role=actor.role,
        action=action,
        target=target,
        fields=fields,
        request_id=request_id.current(),
    )


def _changes(before: dict[str, Any], after: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"limits.rpm": [old, new], ...}: what an update changed, as dotted paths."""
    out: dict[str, Any] = {}
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name), after.get(name)
        path = f"{prefix}{name}"
        if isinstance(old, dict) and isinstance(new, dict):
            out.update(_changes(old, new, path + "."))
        elif old != new:
            out[path] = [old, new]
    return out


def _engines(request: Request) -> EngineClient:
    return get_services(request).engines


async def _json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    return parse_body(raw)


def _shown(key_id: str) -> str:
    """A key id as an error names it: quoted when it has the shape ids are made in
    (``key_``/``adm_`` + 16 hex), else not echoed (it is the caller's raw input)."""
    return f"'{key_id}'" if looks_like_key_id(key_id) else "with that id"


def _check_common(body: dict[str, Any]) -> None:
    check_name(body.get("name"))
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
    reject_unknown(body, CREATE_FIELDS)
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
    public = _public(tenant)
    await _audit(
        request, "tenant.create", tenant.id, {k: v for k, v in public.items() if k != "id"}
    )
    return JSONResponse(public, status_code=201)


@router.get("/tenants")
async def list_tenants(request: Request) -> dict[str, Any]:
    return {"tenants": [_public(t) for t in await _store(request).list()]}


@router.get("/tenants/{tenant_id}")
async def get_tenant(tenant_id: str, request: Request) -> dict[str, Any]:
    check_tenant_id(tenant_id, "tenant_id")
    return _public(await _store(request).require(tenant_id))


@router.patch("/tenants/{tenant_id}", openapi_extra=_body_doc(TenantPatchBody))
async def update_tenant(tenant_id: str, request: Request) -> dict[str, Any]:
    check_tenant_id(tenant_id, "tenant_id")
    body = await _json_object(request)
    _check_common(body)
    if "id" in body and body["id"] != tenant_id:
        raise InvalidField("id", "a tenant's id cannot be changed")
    body.pop("id", None)
    before, tenant = await _store(request).update_from(tenant_id, body)
    log.info("tenant %s updated", tenant_id)
    public = _public(tenant)
    await _audit(request, "tenant.update", tenant_id, _changes(_public(before), public))
    return public


@router.delete("/tenants/{tenant_id}", status_code=204)
async def delete_tenant(tenant_id: str, request: Request) -> Response:
    check_tenant_id(tenant_id, "tenant_id")
    if not await _store(request).delete(tenant_id):
        raise APIError("tenant_not_found", f"no tenant '{tenant_id}'", param="id")
    await get_services(request).sync.sync_tenant(tenant_id)
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.forget_tenant(tenant_id)
    log.info("tenant %s deleted", tenant_id)
    await _audit(request, "tenant.delete", tenant_id)
    return Response(status_code=204)


# ------------------------------------------------------------------------- keys


@router.post("/tenants/{tenant_id}/keys", status_code=201, openapi_extra=_body_doc(KeyCreateBody))
async def create_key(tenant_id: str, request: Request) -> JSONResponse:
    check_tenant_id(tenant_id, "tenant_id")
    body = await _json_object(request)
    reject_unknown(body, KEY_FIELDS)
    info, key = await _store(request).create_key_info(
        tenant_id,
        name=body.get("name"),
        expires_at=body.get("expires_at"),
        scopes=body.get("scopes"),
        limits=body.get("limits"),
    )
    log.info("key %s created for tenant %s", info.key_id, tenant_id)
    public = info.public()
    await _audit(
        request,
        "key.create",
        info.key_id,
        {k: public[k] for k in ("tenant_id", "name", "scopes", "limits", "expires_at")},
    )
    return JSONResponse(
        {"key": key, **public}, status_code=201, headers={"Cache-Control": "no-store"}
    )


@router.get("/tenants/{tenant_id}/keys")
async def list_keys(tenant_id: str, request: Request) -> dict[str, Any]:
    check_tenant_id(tenant_id, "tenant_id")
    return {"keys": [k.public() for k in await _store(request).list_keys(tenant_id)]}


@router.post("/keys/{key_id}/rotate", openapi_extra=_body_doc(KeyRotateBody))
async def rotate_key(key_id: str, request: Request) -> JSONResponse:
    body = await _json_object(request)
    reject_unknown(body, {"grace_s"})
    grace = body.get("grace_s", DEFAULT_GRACE_S)
    if isinstance(grace, bool) or not isinstance(grace, int) or not 0 <= grace <= MAX_GRACE_S:
        raise InvalidField(
            "grace_s", f"'grace_s' must be an integer from 0 to {MAX_GRACE_S} (7 days)"
        )

    async def record(info: KeyInfo) -> None:
        # A step of the rotation: if it fails, the rotation is undone (the 503's retry
        # must not find an unseen secret in place of the one in use).
        await _audit(
            request,
            "key.rotate",
            key_id,
            {
                "tenant_id": info.tenant_id,
                "grace_s": grace,
                "previous_expires_at": info.public()["previous_expires_at"],
            },
        )

    rotated = await _store(request).rotate_key(key_id, grace, recorded=record)
    if rotated is None:
        raise APIError("key_not_found", f"no key {_shown(key_id)}", param="key_id")
    info, key = rotated
    log.info("key %s rotated (grace %d s)", key_id, grace)
    public = info.public()
    return JSONResponse(
        {"key": key, "grace_s": grace, **public}, headers={"Cache-Control": "no-store"}
    )


@router.delete("/keys/{key_id}", status_code=204)
async def revoke_key(key_id: str, request: Request) -> Response:
    """A tenant key or an admin key, by its id (``key_…`` / ``adm_…``)."""
    store = _store(request)
    tenant_id = await store.revoke_key(key_id)
    if tenant_id is not None:
        log.info("key %s revoked", key_id)
        await _audit(request, "key.revoke", key_id, {"tenant_id": tenant_id})
        return Response(status_code=204)
    admin = await store.revoke_admin_key(key_id)
    if admin is None:
        raise APIError("key_not_found", f"no key {_shown(key_id)}", param="key_id")
    log.info("admin key %s revoked", key_id)
    await _audit(request, "admin_key.revoke", key_id, {"role": admin.role, "name": admin.name})
    return Response(status_code=204)


# ------------------------------------------------------------------------- admin keys


@router.post("/keys", status_code=201, openapi_extra=_body_doc(AdminKeyCreateBody))
async def create_admin_key(request: Request) -> JSONResponse:
    body = await _json_object(request)
    reject_unknown(body, {"role", "name"})
    role = body.get("role")
    if role not in ADMIN_ROLES:
        raise InvalidField("role", f"'role' is required: one of {', '.join(ADMIN_ROLES)}")
    name = check_name(body.get("name"))
    admin, key = await _store(request).create_admin_key(
        role, name=name, created_by=_actor(request).key_id
    )
    log.info("admin key %s created (role %s)", admin.key_id, role)
    await _audit(request, "admin_key.create", admin.key_id, {"role": role, "name": name})
    return JSONResponse(
        {"key": key, **admin.public()}, status_code=201, headers={"Cache-Control": "no-store"}
    )


@router.get("/keys")
async def list_admin_keys(request: Request) -> dict[str, Any]:
    return {"keys": [k.public() for k in await _store(request).list_admin_keys()]}


# ------------------------------------------------------------------------- audit


def _written_as_a_number(value: Any) -> Any:
    """A query number as people write it: Python's int() and float() also read
    ``1_000`` (found from outside: ``limit=1_0`` was 10)."""
    if isinstance(value, str) and "_" in value:
        raise ValueError("a number without '_'")
    return value


_QueryNumber = BeforeValidator(_written_as_a_number)


@router.get("/audit")
async def audit_log(
    request: Request,
    since: Annotated[
        float | None,
        Query(
            ge=0, allow_inf_nan=False, description="only entries at or after this time (unix s)"
        ),
        _QueryNumber,
    ] = None,
    limit: Annotated[
        int, Query(ge=1, le=audit.MAX_LIMIT, description="at most this many"), _QueryNumber
    ] = audit.DEFAULT_LIMIT,
) -> dict[str, Any]:
    """Admin writes, newest first."""
    return {"entries": await _store(request).audit.read(since=since, limit=limit)}


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
