"""Named steering vectors: per tenant, kept whole in Redis (metadata and data, within
the tenant's vector quota), installed on the engines as a cache.

A PUT is admitted by the limiter before its body is parsed, then decoded (GGUF off
the event loop), validated against the model shape, and written to Redis in one
script (quota check, metadata, data). Engines get it right away, best effort: one
that is down or fails the write is marked dirty and synced before it serves again,
and any engine that lacks it later installs it from Redis on first use
(``vector_missing``, see docs/architecture.md). GGUF uploads are stored and
installed as packed float32 JSON, so an engine only ever parses one format.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request, Response

from steergate.gateway.admission import refusals
from steergate.gateway.admission.bodies import OFF_LOOP_BYTES, parse_body
from steergate.gateway.admission.metered import admitted
from steergate.gateway.admission.refusals import Refused
from steergate.gateway.deps import Services, ServicesDep
from steergate.gateway.store import key_names as keys
from steergate.gateway.store.connection import store_errors
from steergate.gateway.store.scripts import DropVector, PutVector
from steergate.gateway.tenancy.auth import TenantDep, caller_key
from steergate.gateway.tenancy.records import Tenant
from steergate.shared.codecs import CodecError, encode_packed, vector_digest
from steergate.shared.errors import APIError, InvalidField
from steergate.shared.gguf import decode_gguf_off_loop
from steergate.shared.scoping import check_vector_name
from steergate.shared.steering import check_vectors, parse_vector_body

router = APIRouter(tags=["vectors"])
#: A ``PUT`` body in this media type (matched without case) is a GGUF control vector.
GGUF_MEDIA_TYPE = "application/octet-stream"

#: Metadata fields a client sees (the rest of the stored record is ours).
PUBLIC_FIELDS = ("name", "digest", "bytes", "layers", "hook", "description", "updated_at")
#: Shown only when present: a vector made by ``from-examples`` (routes/from_examples.py).
MADE_FIELDS = ("provenance", "report")


def _json(doc: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type="application/json")


def _not_found(name: str) -> APIError:
    return APIError("vector_not_found", f"No vector named '{name}'.", param="name")


@router.put("/v1/steering/vectors/{name}")
async def put_vector(name: str, request: Request, tenant: TenantDep, svc: ServicesDep) -> Response:
    check_vector_name(name)
    async with admitted(svc.settler, svc.limiter.admit_plain(tenant, caller_key(request))) as call:
        response = await _put_vector(name, request, tenant, svc)
        call.settle(response.status_code)
        return response


async def _put_vector(name: str, request: Request, tenant: Tenant, svc: Services) -> Response:
    shape = await svc.engines.known_shape()
    description = None
    if request.headers.get("content-type", "").split(";")[0].strip().lower() == GGUF_MEDIA_TYPE:
        try:
            layers = await decode_gguf_off_loop(await request.body())
        except CodecError as exc:
            raise InvalidField("body", f"the GGUF body {exc}", code="invalid_gguf") from exc
        hook = "post_block"
        check_vectors(layers, shape, "body")
    else:
        raw = await request.body()
        if len(raw) > OFF_LOOP_BYTES:  # in a worker process, after the tenant's others
            hook, layers, description = await svc.bodies.parse_vector(raw, tenant.id, shape)
        else:
            hook, layers, description = parse_vector_body(parse_body(raw), shape)
    meta, prev = await store_vector(svc, tenant, name, hook, layers, description)
    out = {k: meta[k] for k in ("name", "digest", "bytes", "layers", "hook")}
    return _json(out, 200 if prev else 201)


async def store_vector(
    svc: Services,
    tenant: Tenant,
    name: str,
    hook: str,
    layers: dict[int, np.ndarray],
    description: str | None,
    extra: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], bool]:
    """Write a validated vector to Redis (the tenant's quota checked in the same
    script), then offer it to every engine. ``extra``: more metadata (a made vector's
    ``provenance`` and ``report``). Returns the stored metadata and whether it
    replaced a vector of that name."""
    lim = tenant.limits
    indices = sorted(layers)
    matrix = np.stack([np.asarray(layers[i], dtype=np.float32) for i in indices])
    nbytes = int(matrix.size * 4)
    meta: dict[str, Any] = {
        "name": name,
        "digest": vector_digest(hook, layers),
        "bytes": nbytes,
        "layers": indices,
        "hook": hook,
        "description": description,
        "updated_at": time.time(),
        **(extra or {}),
    }
    data: dict[str, Any] = {"hook": hook, "packed": encode_packed(matrix, indices)}
    if description is not None:
        data["description"] = description
    body = orjson.dumps(data)
    async with store_errors():
        status, prev = await svc.scripts.run(
            PutVector(
                tenant_id=tenant.id,
                generation=tenant.created_at,
                name=name,
                meta=orjson.dumps(meta),
                nbytes=nbytes,
                count_quota=lim.vector_count,
                bytes_quota=lim.vector_bytes,
                data=body,
            )
        )
    if int(status):
        raise _over_quota(lim)
    # Stored: the tenant's vector exists from here on, whatever the engines do.
    await svc.sync.offer_vector(tenant.id, name, body)
    return meta, bool(prev)


def _over_quota(lim: Any) -> APIError:
    return Refused(refusals.BY_CAUSE["vector"], limit=lim.vector_count, bytes=lim.vector_bytes)


async def precheck_quota(svc: Services, tenant_id: str, lim: Any, name: str, nbytes: int) -> None:
    """Refuse up front a vector that the quota would refuse now (the same rule as
    put_vector.lua, which still decides atomically when storing): for work that costs
    tokens before the store, e.g. ``from-examples``."""
    async with store_errors():
        rows = await svc.redis.hgetall(keys.vectors(tenant_id))
    others = [orjson.loads(v) for k, v in rows.items() if _text(k) != name]
    total = sum(int(m.get("bytes") or 0) for m in others)
    if len(others) + 1 > lim.vector_count or total + nbytes > lim.vector_bytes:
        raise _over_quota(lim)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@router.get("/v1/steering/vectors")
async def list_vectors(tenant: TenantDep, svc: ServicesDep, include: str | None = None) -> Response:
    async with store_errors():
        rows = await svc.redis.hgetall(keys.vectors(tenant.id))
        data = await svc.redis.hgetall(keys.vector_data(tenant.id)) if include == "data" else {}
    metas = [_public(orjson.loads(rows[n]), data.get(n)) for n in sorted(rows)]
    return _json({"object": "list", "data": metas})


@router.get("/v1/steering/vectors/{name}")
async def get_vector(
    name: str, tenant: TenantDep, svc: ServicesDep, include: str | None = None
) -> Response:
    check_vector_name(name)
    async with store_errors():
        raw = await svc.redis.hget(keys.vectors(tenant.id), name)
        data = None
        if include == "data":
            data = await svc.redis.hget(keys.vector_data(tenant.id), name)
    if not raw:
        raise _not_found(name)
    return _json(_public(orjson.loads(raw), data))


def _public(meta: dict[str, Any], data: str | None) -> dict[str, Any]:
    """Metadata, plus ``packed`` (exact float32, accepted back by a PUT) when asked."""
    out = {k: meta.get(k) for k in PUBLIC_FIELDS}
    out.update({k: meta[k] for k in MADE_FIELDS if k in meta})
    if data is not None:
        out["packed"] = orjson.loads(data)["packed"]
    return out


@router.delete("/v1/steering/vectors/{name}", status_code=204)
async def delete_vector(name: str, tenant: TenantDep, svc: ServicesDep) -> Response:
    check_vector_name(name)
    async with store_errors():
        removed = await svc.scripts.run(
            DropVector(tenant_id=tenant.id, generation=tenant.created_at, name=name)
        )
    if not removed:
        raise _not_found(name)
    await svc.sync.offer_vector(tenant.id, name, None)
    return Response(status_code=204)
