"""Named steering vectors: per tenant, quota-checked in Redis, registered on every
engine under the tenant-scoped name (a conversation may be routed to any engine).

GGUF control vectors (``application/octet-stream``) are decoded here, validated
against the model shape, counted at float32 size, and forwarded as JSON packed
float32 — the engine only ever parses one format.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request, Response

from gateway import keys
from gateway.auth import TenantDep
from gateway.deps import Services, ServicesDep
from gateway.rewrite import scrub
from gateway.routes.inference import read_json_object
from gateway.store import store_errors
from gateway.upstream import UpstreamResponse
from shared.codecs import CodecError, decode_gguf_control_vector, encode_packed, vector_digest
from shared.errors import APIError, InvalidField
from shared.scoping import check_vector_name, scope
from shared.steering import ModelShape, check_vectors, parse_vector_body

router = APIRouter(tags=["vectors"])


async def _shape(svc: Services) -> ModelShape:
    shape = svc.pool.shape()
    if shape is None:
        await svc.pool.refresh()
        shape = svc.pool.shape()
    if shape is None:
        raise APIError(502, "engine_unavailable", "The inference engine is unavailable.")
    return shape


def _json(doc: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type="application/json")


def _not_found(name: str) -> APIError:
    return APIError(404, "vector_not_found", f"No vector named '{name}'.", param="name")


@router.put("/v1/steering/vectors/{name}")
async def put_vector(name: str, request: Request, tenant: TenantDep, svc: ServicesDep) -> Response:
    check_vector_name(name)
    shape = await _shape(svc)
    description = None
    if request.headers.get("content-type", "").split(";")[0].strip() == "application/octet-stream":
        try:
            layers = decode_gguf_control_vector(await request.body())
        except CodecError as exc:
            raise InvalidField("body", f"the GGUF body {exc}") from exc
        hook = "post_block"
        check_vectors(layers, shape, "body")
    else:
        hook, layers, description = parse_vector_body(await read_json_object(request), shape)
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
    }
    lim = tenant.limits
    async with store_errors():
        status, prev = await svc.scripts.put_vector(
            keys=[keys.vectors(tenant.id)],
            args=[name, orjson.dumps(meta), nbytes, lim.vector_count, lim.vector_bytes],
        )
    if int(status):
        raise APIError(
            429,
            "vector_quota_exceeded",
            f"Storing this vector would exceed the tenant's vector quota "
            f"({lim.vector_count} vectors, {lim.vector_bytes} bytes).",
            headers={"retry-after": "60", "retry-after-ms": "60000"},
        )
    payload: dict[str, Any] = {"hook": hook, "packed": encode_packed(matrix, indices)}
    if description is not None:
        payload["description"] = description
    results = await svc.pool.broadcast(
        "PUT", f"/v1/steering/vectors/{scope(tenant.id, name)}", json=payload
    )
    failed = next((r for r in results if isinstance(r, APIError) or r.status >= 300), None)
    if failed is not None:
        async with store_errors():  # roll back the quota reservation
            if prev:
                await svc.redis.hset(keys.vectors(tenant.id), name, prev)
            else:
                await svc.redis.hdel(keys.vectors(tenant.id), name)
        if isinstance(failed, APIError):
            raise failed
        return Response(
            scrub(failed.body, tenant.id, error=True),
            status_code=failed.status,
            media_type="application/json",
        )
    first = results[0]
    if isinstance(first, UpstreamResponse):
        try:
            digest = first.json().get("digest")
        except (orjson.JSONDecodeError, AttributeError):
            digest = None
        if isinstance(digest, str) and digest != meta["digest"]:
            meta["digest"] = digest
            async with store_errors():
                await svc.redis.hset(keys.vectors(tenant.id), name, orjson.dumps(meta))
    out = {k: meta[k] for k in ("name", "digest", "bytes", "layers", "hook")}
    return _json(out, 200 if prev else 201)


@router.get("/v1/steering/vectors")
async def list_vectors(
    request: Request, tenant: TenantDep, svc: ServicesDep, include: str | None = None
) -> Response:
    async with store_errors():
        rows = await svc.redis.hgetall(keys.vectors(tenant.id))
    metas = [orjson.loads(rows[n]) for n in sorted(rows)]
    if include == "data":
        metas = [await _with_data(svc, tenant.id, m) for m in metas]
    return _json({"object": "list", "data": metas})


@router.get("/v1/steering/vectors/{name}")
async def get_vector(
    name: str, tenant: TenantDep, svc: ServicesDep, include: str | None = None
) -> Response:
    check_vector_name(name)
    async with store_errors():
        raw = await svc.redis.hget(keys.vectors(tenant.id), name)
    if not raw:
        raise _not_found(name)
    meta = orjson.loads(raw)
    return _json(await _with_data(svc, tenant.id, meta) if include == "data" else meta)


async def _with_data(svc: Services, tenant_id: str, meta: dict[str, Any]) -> dict[str, Any]:
    r = await svc.pool.request(
        "GET",
        f"/v1/steering/vectors/{scope(tenant_id, meta['name'])}",
        engine=svc.pool.pick(),
        params={"include": "data"},
    )
    if r.status != 200:
        raise APIError(502, "engine_unavailable", "The engine does not hold this vector's data.")
    doc = orjson.loads(scrub(r.body, tenant_id))
    extra = {k: v for k, v in doc.items() if k not in meta} if isinstance(doc, dict) else {}
    return {**meta, **extra}


@router.delete("/v1/steering/vectors/{name}", status_code=204)
async def delete_vector(name: str, tenant: TenantDep, svc: ServicesDep) -> Response:
    check_vector_name(name)
    async with store_errors():
        removed = await svc.redis.hdel(keys.vectors(tenant.id), name)
    if not removed:
        raise _not_found(name)
    await svc.pool.broadcast("DELETE", f"/v1/steering/vectors/{scope(tenant.id, name)}")
    return Response(status_code=204)
