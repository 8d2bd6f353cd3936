"""``POST /v1/tokenize`` and ``POST /v1/detokenize``: vLLM's tokenizer routes
(``/tokenize``, ``/detokenize`` on the engine), for tenants, metered as one request
each (no tokens charged: nothing is generated).

Bodies are vLLM's: ``{"model"?, "prompt"}`` or ``{"model"?, "messages", ...}`` ->
``{"count", "max_model_len", "tokens", "token_strs"?}``; ``{"model"?, "tokens"}`` ->
``{"prompt"}``. They carry no tenant-scoped ids, so they pass through as sent, once their
``messages`` have a shape vLLM validates cheaply (``admission/request_shape.py``).
"""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request, Response

from steergate.gateway.admission import request_shape
from steergate.gateway.admission.metered import metered_call
from steergate.gateway.admission.request_scoping import scrub
from steergate.gateway.deps import ServicesDep
from steergate.gateway.routes.inference import read_json_object
from steergate.gateway.tenancy.auth import TenantDep, caller_key

router = APIRouter(tags=["tokenizer"])


@router.post("/v1/tokenize")
async def tokenize(request: Request, tenant: TenantDep, svc: ServicesDep) -> Response:
    doc = await read_json_object(request)
    # vLLM's validation of a bad one is unbounded (admission/request_shape.py)
    (request_shape.check_chat if "messages" in doc else request_shape.check_completion)(doc)
    content = orjson.dumps(doc)
    r, headers = await metered_call(
        svc.settler, svc.limiter, tenant, lambda: svc.engines.tokenize(content), caller_key(request)
    )
    return _relay(r.status, r.body, tenant.id, headers)


@router.post("/v1/detokenize")
async def detokenize(request: Request, tenant: TenantDep, svc: ServicesDep) -> Response:
    doc = await read_json_object(request)
    request_shape.check_detokenize(doc)
    content = orjson.dumps(doc)
    r, headers = await metered_call(
        svc.settler,
        svc.limiter,
        tenant,
        lambda: svc.engines.detokenize(content),
        caller_key(request),
    )
    return _relay(r.status, r.body, tenant.id, headers)


def _relay(status: int, body: bytes, tenant_id: str, headers: dict[str, str]) -> Response:
    if status >= 400:
        body = scrub(body, tenant_id, error=True)
    return Response(body, status_code=status, headers=headers, media_type="application/json")
