"""``/v1/steering/*``: engine info and status, latches, the named-vector registry.

Handlers are thin: parse, call the pure modules, shape the answer. Every failure is
an :class:`APIError` rendered in the OpenAI error shape (never a stack trace).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from steergate.engine.http.runtime import RuntimeRef
from steergate.shared import engine_api
from steergate.shared.codecs import CodecError
from steergate.shared.errors import APIError, InvalidField, render
from steergate.shared.gguf import decode_gguf_off_loop
from steergate.shared.scoping import is_engine_conversation_id, is_engine_vector_name
from steergate.shared.steering import ModelShape, check_vectors, parse_vector_body

Handler = Callable[..., Awaitable[Response]]


def _openai_errors(handler: Handler) -> Handler:
    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Response:
        try:
            return await handler(*args, **kwargs)
        except APIError as exc:
            out = render(exc)
            return Response(out.body, status_code=out.status, headers=out.headers)

    return wrapper


def build_router(ref: RuntimeRef) -> APIRouter:
    router = APIRouter()

    @router.get(engine_api.INFO)
    @_openai_errors
    async def info() -> Response:
        return JSONResponse(ref.get().info())

    @router.get(engine_api.STATUS)
    @_openai_errors
    async def status() -> Response:
        runtime = ref.get()
        return JSONResponse({**runtime.controller.status(), **runtime.registry.status()})

    @router.get(engine_api.LATCHES)
    @_openai_errors
    async def list_latches(prefix: str = "") -> Response:
        return JSONResponse(ref.get().controller.list(prefix))

    @router.delete(engine_api.LATCHES + "/{conversation_id}")
    @_openai_errors
    async def delete_latch(conversation_id: str) -> Response:
        if not is_engine_conversation_id(conversation_id):
            raise InvalidField(
                "conversation_id",
                "'conversation_id' must be 1-256 characters of [A-Za-z0-9._:@-], not '.' or '..'",
                code="invalid_conversation_id",
            )
        if not ref.get().controller.delete(conversation_id):
            raise APIError(
                "latch_not_found", "this conversation has no latch", param="conversation_id"
            )
        return Response(status_code=204)

    @router.get(engine_api.VECTORS)
    @_openai_errors
    async def list_vectors(prefix: str = "") -> Response:
        return JSONResponse([v.metadata() for v in ref.get().registry.list(prefix)])

    @router.get(engine_api.VECTORS + "/{name}")
    @_openai_errors
    async def get_vector(name: str, include: str | None = None) -> Response:
        vector = ref.get().registry.get(_vector_name(name))
        if vector is None:
            raise APIError("vector_not_found", "no vector with this name", param="name")
        return JSONResponse(vector.with_data() if include == "data" else vector.metadata())

    @router.put(engine_api.VECTORS + "/{name}")
    @_openai_errors
    async def put_vector(name: str, request: Request) -> Response:
        runtime = ref.get()
        name = _vector_name(name)
        raw = await _bounded_body(request, max_vector_body(runtime.shape))
        if _is_octet_stream(request):
            hook, layers, description = "post_block", await _gguf_layers(raw), None
            check_vectors(layers, runtime.shape, "direction")
        else:
            hook, layers, description = parse_vector_body(_json_body(raw), runtime.shape)
        vector, created = runtime.registry.put(name, hook, layers, description)
        return JSONResponse(vector.metadata(), status_code=201 if created else 200)

    @router.delete(engine_api.VECTORS + "/{name}")
    @_openai_errors
    async def delete_vector(name: str) -> Response:
        if not ref.get().registry.delete(_vector_name(name)):
            raise APIError("vector_not_found", "no vector with this name", param="name")
        return Response(status_code=204)

    return router


def max_vector_body(shape: ModelShape) -> int:
    """The largest vector body worth reading for this model: every layer once, at 32
    bytes a number (JSON's longest float32 spellings; the gateway sends base64, 5.4),
    plus 64 KiB of the rest (hook, description, GGUF header). Found from outside: a 60 MB
    body was read and parsed on the event loop, stalling every request for 2 s."""
    return 32 * shape.hidden_size * shape.num_layers + 65_536


async def _bounded_body(request: Request, limit: int) -> bytes:
    """The body, or 413 ``request_too_large`` as soon as it passes ``limit`` (declared
    or read): never read whole first."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(
        "request_too_large",
        f"a vector body for this model is at most {limit} bytes (every layer once)",
        param="body",
    )


def _vector_name(name: str) -> str:
    if not is_engine_vector_name(name):
        raise InvalidField(
            "name",
            "'name' must be 1-64 characters of [A-Za-z0-9._-], not '.' or '..', after an "
            "optional tenant scope of 1-32 characters of [a-z0-9-] and '~'",
            code="invalid_vector_name",
        )
    return name


def _is_octet_stream(request: Request) -> bool:
    return (
        request.headers.get("content-type", "").split(";")[0].strip().lower()
        == "application/octet-stream"
    )


def _json_body(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidField(
            "body", "the request body is not valid JSON", code="invalid_json"
        ) from exc


async def _gguf_layers(raw: bytes) -> dict[int, Any]:
    try:
        return await decode_gguf_off_loop(raw)
    except CodecError as exc:
        raise InvalidField("body", f"the GGUF upload {exc}", code="invalid_gguf") from exc
