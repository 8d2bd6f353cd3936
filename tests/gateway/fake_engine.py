"""A small stand-in for the engine's HTTP surface (contract §5), for fast gateway
tests: token check, info/status, latch controller (count cap, LRU), vector registry,
chat/completions with SSE and x-steering-latch. Not a model: it echoes."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

HIDDEN, LAYERS = 8, 4


@dataclass
class EngineState:
    token: str
    latches: dict[str, dict[str, Any]] = field(default_factory=dict)
    vectors: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)
    max_latched: int = 1024
    max_bytes: int = 268435456
    epoch: str = field(default_factory=lambda: uuid.uuid4().hex)
    delay_s: float = 0.0


def _err(status: int, message: str, code: str = "invalid_request") -> JSONResponse:
    return JSONResponse(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": code,
            }
        },
        status_code=status,
    )


def make_engine(state: EngineState) -> Starlette:
    def authed(request: Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {state.token}"

    async def info(request: Request) -> Response:
        if not authed(request):
            return _err(401, "bad token", "unauthorized")
        return JSONResponse(
            {
                "model": "fake",
                "hidden_size": HIDDEN,
                "num_layers": LAYERS,
                "hooks": ["pre_attn", "post_attn", "post_block"],
                "max_latched_conversations": state.max_latched,
                "max_latched_bytes": state.max_bytes,
                "epoch": state.epoch,
            }
        )

    async def latches(request: Request) -> Response:
        if not authed(request):
            return _err(401, "bad token")
        prefix = request.query_params.get("prefix", "")
        return JSONResponse(
            [{"conversation_id": c, **v} for c, v in state.latches.items() if c.startswith(prefix)]
        )

    async def latch_delete(request: Request) -> Response:
        if not authed(request):
            return _err(401, "bad token")
        cid = request.path_params["cid"]
        if state.latches.pop(cid, None) is None:
            return _err(404, f"no latch {cid}", "latch_not_found")
        return Response(status_code=204)

    async def vector(request: Request) -> Response:
        if not authed(request):
            return _err(401, "bad token")
        name = request.path_params["name"]
        if request.method == "PUT":
            body = orjson.loads(await request.body())
            state.vectors[name] = body
            return JSONResponse({"name": name, "hook": body["hook"]}, status_code=201)
        if request.method == "DELETE":
            return Response(status_code=204 if state.vectors.pop(name, None) else 404)
        if name not in state.vectors:
            return _err(404, f"unknown vector '{name}'")
        return JSONResponse({"name": name, **state.vectors[name]})

    async def infer(request: Request) -> Response:
        if not authed(request):
            return _err(401, "bad token")
        body = orjson.loads(await request.body())
        state.requests.append(body)
        conv = body.get("conversation_id")
        steering = body.get("steering") or {}
        for term in steering.get("vectors", []):
            if "name" in term and term["name"] not in state.vectors:
                return _err(400, f"unknown vector '{term['name']}' in steering")
        latch = "none"
        if conv and steering.get("latch"):
            latch = "replaced" if conv in state.latches else "latched"
            state.latches.pop(conv, None)
            state.latches[conv] = {"bytes": 4 * HIDDEN, "kind": "value", "last_used": time.time()}
            while len(state.latches) > state.max_latched:
                state.latches.pop(next(iter(state.latches)))
        elif conv and not steering and conv in state.latches:
            latch = "bridged"
        delay = float(body.get("fake_delay", state.delay_s))
        if delay:
            await asyncio.sleep(delay)
        text = f"echo {conv}" if conv else "echo"
        usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
        chat = request.url.path.endswith("chat/completions")
        headers = {"x-steering-latch": latch}
        if not body.get("stream"):
            choice = (
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
                if chat
                else {"index": 0, "text": text, "finish_reason": "stop"}
            )
            doc = {
                "id": "cmpl-1",
                "object": "chat.completion" if chat else "text_completion",
                "created": 1,
                "model": body.get("model", "fake"),
                "choices": [choice],
                "usage": usage,
                "steering": {"applied": bool(steering) or latch == "bridged", "latch": latch},
            }
            return JSONResponse(doc, headers=headers)

        async def events() -> Any:
            for i, word in enumerate(text.split(" ")):
                delta = (
                    {"index": 0, "delta": {"content": word}} if chat else {"index": 0, "text": word}
                )
                yield (
                    b"data: "
                    + orjson.dumps(
                        {
                            "id": "c",
                            "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": 1,
                            "model": "fake",
                            "choices": [delta],
                        }
                    )
                    + b"\n\n"
                )
                await asyncio.sleep(0.01)
                if body.get("fake_break") and i == 0:
                    raise RuntimeError("engine died mid-stream")
            if (body.get("stream_options") or {}).get("include_usage"):
                yield (
                    b"data: "
                    + orjson.dumps(
                        {
                            "id": "c",
                            "object": "chat.completion.chunk",
                            "created": 1,
                            "model": "fake",
                            "choices": [],
                            "usage": usage,
                        }
                    )
                    + b"\n\n"
                )
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def models(request: Request) -> Response:
        if not authed(request):
            return _err(401, "bad token")
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    return Starlette(
        routes=[
            Route("/v1/steering/info", info),
            Route("/v1/steering/latches", latches),
            Route("/v1/steering/latches/{cid:path}", latch_delete, methods=["DELETE"]),
            Route("/v1/steering/vectors/{name}", vector, methods=["GET", "PUT", "DELETE"]),
            Route("/v1/chat/completions", infer, methods=["POST"]),
            Route("/v1/completions", infer, methods=["POST"]),
            Route("/v1/models", models),
        ]
    )
