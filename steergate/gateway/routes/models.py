"""``GET /v1/models`` and ``GET /v1/models/{id}``: the engines' model list, with
the served model's steering shape added (what a client needs to build a vector).

Each entry is vLLM's (``id``, ``object``, ``created``, ``owned_by``, ``root``,
``parent``, ``max_model_len``, ``permission``) plus ``"steering": {"hidden_size",
"num_layers", "hooks", "architecture", "layer_convention"}`` (the last two, and the
hooks, as the engines report them in ``/v1/steering/info``). An id the engines do not serve is a 404
``model_not_found`` (the OpenAI shape, ``param: "model"``). Both are metered.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request, Response

from steergate.gateway.admission.metered import metered_call
from steergate.gateway.admission.request_scoping import scrub
from steergate.gateway.deps import Services, ServicesDep
from steergate.gateway.tenancy.auth import TenantDep, caller_key
from steergate.shared.errors import APIError
from steergate.shared.steering import HOOKS

router = APIRouter(tags=["models"])


@router.get("/v1/models")
async def list_models(request: Request, tenant: TenantDep, svc: ServicesDep) -> Response:
    r, headers = await metered_call(
        svc.settler, svc.limiter, tenant, svc.engines.models, caller_key(request)
    )
    if r.status != 200:
        return _relay(r.status, scrub(r.body, tenant.id, error=True), headers)
    doc = _with_steering(r.json(), svc)
    return _relay(200, orjson.dumps(doc), headers)


@router.get("/v1/models/{model:path}")
async def retrieve_model(
    model: str, request: Request, tenant: TenantDep, svc: ServicesDep
) -> Response:
    r, headers = await metered_call(
        svc.settler, svc.limiter, tenant, svc.engines.models, caller_key(request)
    )
    if r.status != 200:
        return _relay(r.status, scrub(r.body, tenant.id, error=True), headers)
    for entry in _with_steering(r.json(), svc).get("data", []):
        if entry.get("id") == model:
            return _relay(200, orjson.dumps(entry), headers)
    raise APIError(
        "model_not_found",
        f"The model '{model[:256]}' does not exist.",
        param="model",
        headers=headers,
    )


def _with_steering(doc: Any, svc: Services) -> dict[str, Any]:
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        return {"object": "list", "data": []}
    shape = svc.engines.shape()
    if shape is not None:
        steering: dict[str, Any] = {
            "hidden_size": shape.hidden_size,
            "num_layers": shape.num_layers,
            "hooks": list(HOOKS),
            # what the engines report: the architecture, its layer convention and the
            # hooks it supports (none on an engine started with STEERGATE_STEERING=off)
            **svc.engines.pool.served(),
        }
        for entry in doc["data"]:
            if isinstance(entry, dict):
                entry["steering"] = steering
    return doc


def _relay(status: int, body: bytes, headers: dict[str, str]) -> Response:
    return Response(body, status_code=status, headers=headers, media_type="application/json")
