"""``POST /v1/chat/completions`` and ``POST /v1/completions``.

The request path, top to bottom: auth (``auth.get_tenant``) -> scoping (rewrite.prepare_inference)
-> limits (one admit_request.lua call) -> proxy (upstream) -> accounting (Settler,
queued). The engine's JSON is passed through byte for byte unless the gateway must
change it (scoped ids scrubbed, ``steering`` filled in, ``evicted_quota``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from fastapi.routing import APIRoute
from starlette.routing import request_response

from gateway.accounting import Outcome
from gateway.auth import get_tenant
from gateway.deps import Services, get_services
from gateway.limits import Admission, estimate_tokens
from gateway.rewrite import Prepared, prepare_inference, scrub
from gateway.upstream import UpstreamBroken
from shared.errors import APIError, InvalidField
from shared.scoping import scope

log = logging.getLogger("steergate.gateway.inference")


class PlainRoute(APIRoute):
    """Listed in the OpenAPI schema like any route, but served as a plain Starlette
    endpoint: FastAPI's per-request dependency solving and response validation cost
    more than the rest of the gateway's own work on this, the hot path. The endpoints
    take only the request and do auth themselves (the same ``get_tenant``)."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kw: Any) -> None:
        super().__init__(path, endpoint, **kw)
        self.app = request_response(endpoint)


router = APIRouter(tags=["inference"], route_class=PlainRoute)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await proxy_inference(request, "/v1/chat/completions")


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await proxy_inference(request, "/v1/completions")


async def read_json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidField("body", "The request body is not valid JSON.") from exc
    if not isinstance(body, dict):
        raise InvalidField("body", "The request body must be a JSON object.")
    return body


async def proxy_inference(request: Request, path: str) -> Response:
    tenant = await get_tenant(request)
    svc = get_services(request)
    body = await read_json_object(request)
    prep = prepare_inference(body, tenant, svc.pool.shape())
    adm = await svc.limiter.admit(
        tenant,
        tokens=estimate_tokens(body),
        conversation_id=prep.conversation_id,
        latch=bool(prep.steering and prep.steering.latch),
        latch_bytes=prep.latch_bytes,
        latch_kind=prep.latch_kind,
    )
    try:
        if adm.evicted:
            await evict_on_engines(svc, tenant.id, adm.evicted)
        engine = svc.pool.pick(prep.scoped_conversation_id)
        content = orjson.dumps(body)
        if prep.stream:
            return await _stream(svc, adm, prep, path, content, engine)
        return await _unary(svc, adm, prep, path, content, engine)
    except APIError as exc:
        _settle(svc, adm, exc.status, 0, None)
        exc.headers = {**adm.headers, **exc.headers}
        raise
    except BaseException:
        _settle(svc, adm, 0, 0, None)  # client went away: release the lease now
        raise


async def evict_on_engines(svc: Services, tenant_id: str, conversation_ids: list[str]) -> None:
    """Quota evictions are carried out before the new latch is stored, so the
    engine never holds more than the tenant's quota because of this request."""
    for conv in conversation_ids:
        await svc.pool.broadcast("DELETE", f"/v1/steering/latches/{scope(tenant_id, conv)}")


def _settle(
    svc: Services,
    adm: Admission,
    status: int,
    tokens: int,
    latch_state: str | None,
    steered: bool = False,
) -> None:
    svc.settler.submit(Outcome(adm, status, tokens, latch_state, steered))


def _latch_state(adm: Admission, engine_state: str | None) -> str:
    state = engine_state or "none"
    if adm.evicted and state in ("latched", "replaced"):
        return "evicted_quota"
    return state


def _total_tokens(doc: Any) -> int:
    usage = doc.get("usage") if isinstance(doc, dict) else None
    if isinstance(usage, dict) and isinstance(usage.get("total_tokens"), int):
        return int(usage["total_tokens"])
    return -1  # unknown: keep the reservation as the charge


async def _unary(
    svc: Services, adm: Admission, prep: Prepared, path: str, content: bytes, engine: Any
) -> Response:
    r = await svc.pool.request("POST", path, engine=engine, content=content)
    tenant_id = adm.tenant.id
    ok = 200 <= r.status < 300
    body = scrub(r.body, tenant_id, error=not ok)
    engine_state = r.headers.get("x-steering-latch")
    state = _latch_state(adm, engine_state)
    tokens = -1
    if ok:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            doc = None
        tokens = _total_tokens(doc)
        if isinstance(doc, dict):
            steering = doc.get("steering")
            if not isinstance(steering, dict) or steering.get("latch") != state:
                applied = (
                    steering.get("applied")
                    if isinstance(steering, dict)
                    else (prep.steering is not None or state == "bridged")
                )
                doc["steering"] = {"applied": bool(applied), "latch": state}
                body = orjson.dumps(doc)
    _settle(svc, adm, r.status, tokens, engine_state, prep.steering is not None)
    headers = {**adm.headers, "x-steering-latch": state}
    return Response(
        body,
        status_code=r.status,
        headers=headers,
        media_type=r.headers.get("content-type", "application/json"),
    )


class _RelayResponse(StreamingResponse):
    """A StreamingResponse that runs ``on_exit`` however it ends, even if the client
    left before the body iterator was ever started (whose own ``finally`` would then
    never run): that closes the engine stream and settles the request exactly once."""

    def __init__(self, *args: Any, on_exit: Callable[[], Awaitable[None]], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._on_exit = on_exit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_exit()


async def _stream(
    svc: Services, adm: Admission, prep: Prepared, path: str, content: bytes, engine: Any
) -> Response:
    cm = svc.pool.stream(path, content, engine=engine)
    up = await cm.__aenter__()
    tenant_id = adm.tenant.id
    if up.status != 200:
        try:
            data = await up.read()
        except UpstreamBroken as exc:
            raise APIError(
                502, "engine_unavailable", "The inference engine is unavailable."
            ) from exc
        finally:
            await cm.__aexit__(None, None, None)
        _settle(svc, adm, up.status, 0, up.headers.get("x-steering-latch"))
        return Response(
            scrub(data, tenant_id, error=True),
            status_code=up.status,
            headers={**adm.headers, "x-steering-latch": "none"},
            media_type=up.headers.get("content-type", "application/json"),
        )
    engine_state = up.headers.get("x-steering-latch")
    marker = f"{tenant_id}~".encode()
    # What the relay has seen; settled once, by whichever of relay/on_exit ends last.
    seen: dict[str, Any] = {"tokens": -1, "status": 0, "done": False}

    async def finish() -> None:
        if seen["done"]:
            return
        seen["done"] = True
        await cm.__aexit__(None, None, None)
        # The engine's latch decision arrived with the headers, before any body, so it
        # holds even if the stream later broke or the client left (status 0).
        _settle(svc, adm, seen["status"], seen["tokens"], engine_state, prep.steering is not None)

    async def relay() -> AsyncIterator[bytes]:
        buf = b""
        try:
            async for chunk in up.chunks():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    out, used = _relay_event(event, prep.include_usage, marker)
                    seen["tokens"] = used if used >= 0 else seen["tokens"]
                    if out is not None:
                        yield out
            if buf.strip():
                out, used = _relay_event(buf, prep.include_usage, marker)
                seen["tokens"] = used if used >= 0 else seen["tokens"]
                if out is not None:
                    yield out
            seen["status"] = 200
        except UpstreamBroken:
            seen["status"] = 502
            err = APIError(502, "engine_unavailable", "The inference engine failed mid-stream.")
            yield b"data: " + orjson.dumps(err.body()) + b"\n\n"
        finally:
            await finish()

    headers = {
        **adm.headers,
        "x-steering-latch": _latch_state(adm, engine_state),
        "cache-control": "no-cache",
        "x-accel-buffering": "no",
    }
    return _RelayResponse(
        relay(), status_code=200, headers=headers, media_type="text/event-stream", on_exit=finish
    )


def _relay_event(event: bytes, client_wants_usage: bool, marker: bytes) -> tuple[bytes | None, int]:
    """One SSE event out (or None to drop it) and the total tokens it reports (-1)."""
    if marker in event:
        event = event.replace(marker, b"")
    used = -1
    if b'"usage"' in event and event.startswith(b"data: {"):
        try:
            doc = orjson.loads(event[6:])
        except orjson.JSONDecodeError:
            doc = None
        used = _total_tokens(doc)
        if (
            used >= 0
            and not client_wants_usage
            and isinstance(doc, dict)
            and not doc.get("choices")
        ):
            return None, used  # the usage-only chunk we asked for ourselves
    return event + b"\n\n", used
