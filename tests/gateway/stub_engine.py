"""The engine the gateway tests talk to: the REAL endpoint plugin (token auth, the
steering rewrite, latch controller with its count and byte caps, vector registry,
``/v1/steering/*`` routes) in front of a stub of vLLM's OpenAI routes instead of a
model. There is one implementation of latch semantics, the engine's; this file only
stands in for the forward pass.

The stub "model" answers ``echo`` when a turn is not steered and ``echo <digest>``
when it is (the first 12 hex digits of the steering payload's digest), so a gateway
test can tell exactly *which* steering a turn got, e.g. that a restored latch steers
like the original. Test knobs in the request body: ``fake_delay`` (seconds before
answering; a request whose connection closes meanwhile is abandoned, as vLLM aborts
it), ``fake_chunks`` (a stream of that many one-token chunks), ``fake_break``
(the stream dies after its first chunk), ``fake_no_chunk_usage`` (no usage on each
chunk even when ``stream_options.continuous_usage_stats`` asks).
"""

from __future__ import annotations

import asyncio
import json
import logging
from argparse import Namespace
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import SecretStr

from steergate.engine.http.plugin import SteeringEndpointPlugin
from steergate.engine.http.runtime import SteeringRuntime
from steergate.engine.payload import XARGS_KEY, decode_payload
from steergate.shared import engine_api
from steergate.shared.settings import EngineSettings
from steergate.shared.steering import ModelShape
from tests.gateway import stub_capture, stub_vllm

HIDDEN, LAYERS = 8, 4
SHAPE = ModelShape(HIDDEN, LAYERS)


class _ModelConfig:
    max_model_len = stub_vllm.MAX_MODEL_LEN
    architectures = ["LlamaForCausalLM"]  # config.json's
    architecture = "LlamaForCausalLM"  # the vLLM class serving it

    def get_hidden_size(self) -> int:
        return HIDDEN

    def get_total_num_hidden_layers(self) -> int:
        return LAYERS


_ENGINE_CLIENT = SimpleNamespace(
    vllm_config=SimpleNamespace(
        model_config=_ModelConfig(),
        device_config=SimpleNamespace(device_type="cpu"),
        compilation_config=SimpleNamespace(cudagraph_mode=None),
    )
)


def answer_for(body: dict[str, Any]) -> str:
    """What the stub model says: which steering (if any) this request carries."""
    payload = (body.get("vllm_xargs") or {}).get(XARGS_KEY)
    if not payload:
        return "echo"
    return f"echo {decode_payload(payload).digest[:12]}"


async def _disconnects_within(request: Request, seconds: float) -> bool:
    """Wait ``seconds``, the "model" working; True if the client (the gateway)
    disconnected meanwhile. vLLM's routes do the same (``with_cancellation``: the
    handler races the ASGI ``http.disconnect`` and the request is aborted)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    try:
        await asyncio.wait_for(disconnected(), seconds)
    except asyncio.TimeoutError:
        return False
    return True


class StubEngine:
    """One engine process, as far as the gateway can tell."""

    def __init__(
        self,
        token: str,
        *,
        max_latched: int = engine_api.DEFAULT_MAX_LATCHED_CONVERSATIONS,
        max_bytes: int = engine_api.DEFAULT_MAX_LATCHED_BYTES,
    ) -> None:
        self.settings = EngineSettings(
            engine_token=SecretStr(token),
            max_latched_conversations=max_latched,
            max_latched_bytes=max_bytes,
        )
        self.plugin = SteeringEndpointPlugin(self.settings)
        #: JSON bodies of inference requests as the gateway sent them.
        self.requests: list[dict[str, Any]] = []
        #: The same requests as vLLM would have received them (after the rewrite).
        self.seen: list[dict[str, Any]] = []
        self.delay_s = 0.0
        #: The ``x-request-id`` of every request that reached the engine, in order.
        self.request_ids: list[str | None] = []
        #: Bodies of the requests whose connection closed during their ``fake_delay``:
        #: abandoned unanswered, as vLLM's ``with_cancellation`` aborts them.
        self.abandoned: list[dict[str, Any]] = []
        self.started = False
        self.app = self._build()

    # -- what tests look at ---------------------------------------------------------

    @property
    def runtime(self) -> SteeringRuntime:
        return self.plugin.runtime.get()

    @property
    def latches(self) -> dict[str, dict[str, Any]]:
        return {row["conversation_id"]: row for row in self.runtime.controller.list()}

    @property
    def vectors(self) -> dict[str, dict[str, Any]]:
        return {v.name: v.metadata() for v in self.runtime.registry.list()}

    @property
    def epoch(self) -> str:
        return self.runtime.epoch

    def plant_latch(self, conversation_id: str) -> None:
        """Engine-side drift: a latch the engine holds that no gateway stored."""
        from steergate.engine.latch import Latch

        site = np.ones(HIDDEN, dtype=np.float32)
        self.runtime.controller.store(conversation_id, Latch("all", {("post_block", 0): site}))

    def restart(self) -> None:
        """What a process restart does to the engine's state: all of it is gone."""
        self.plugin.runtime.set(SteeringRuntime.create("stub", SHAPE, self.settings))

    # -- the app ----------------------------------------------------------------------

    def _build(self) -> Any:
        app = FastAPI()
        stub = self

        async def completion(request: Request) -> Any:
            body = await request.json()
            stub.seen.append(body)
            delay = float(body.get("fake_delay", stub.delay_s))
            if delay and await _disconnects_within(request, delay):
                stub.abandoned.append(body)
                return None  # the connection is gone: nobody to answer
            chat = request.url.path.endswith("chat/completions")
            refused = stub_vllm.error_for(body)
            if refused is not None:
                return refused
            if body.get("fake_raise"):  # a bug in the engine: nothing handles it
                raise RuntimeError("stub engine bug")
            logging.getLogger("steergate.stub").info("serving %s", request.url.path)
            captured = 0 if chat else stub_capture.write_worker_files(body, HIDDEN)
            if captured:
                return JSONResponse(stub_capture.completion(body, captured))
            text = answer_for(body)
            if not body.get("stream"):
                return JSONResponse(_completion(body, chat, text))
            return StreamingResponse(_events(body, chat, text), media_type="text/event-stream")

        async def models(request: Request) -> Any:
            return JSONResponse(stub_vllm.model_list())

        app.post(engine_api.CHAT_COMPLETIONS)(completion)
        app.post(engine_api.COMPLETIONS)(completion)
        app.get(engine_api.MODELS)(models)
        stub_vllm.install(app, self.seen, answer_for)
        self.plugin.attach_router(app)

        @app.on_event("startup")
        async def _start() -> None:
            # Served again after stop(): the same process back from an outage keeps its
            # state (use restart() for a process restart).
            if not stub.started:
                stub.started = True
                await stub.plugin.init_state(
                    _ENGINE_CLIENT, app.state, Namespace(model="stub", served_model_name=None)
                )

        return _Recorder(app, self.requests, self.request_ids)


class _Recorder:
    """Outermost ASGI layer: keeps what the gateway sent to the inference routes."""

    def __init__(
        self, app: Any, requests: list[dict[str, Any]], request_ids: list[str | None]
    ) -> None:
        self.app = app
        self.requests = requests
        self.request_ids = request_ids

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            ids = [v.decode() for k, v in scope.get("headers", []) if k == b"x-request-id"]
            self.request_ids.append(ids[0] if ids else None)
        if scope["type"] != "http" or scope["path"] not in engine_api.STEERED_PATHS:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        raw = b"".join(chunks)
        try:
            self.requests.append(json.loads(raw))
        except ValueError:
            pass
        done = False

        async def replay() -> Any:
            nonlocal done
            if not done:
                done = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _completion(body: dict[str, Any], chat: bool, text: str) -> dict[str, Any]:
    choice = (
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        if chat
        else {"index": 0, "text": text, "finish_reason": "stop"}
    )
    return {
        "id": "cmpl-1",
        "object": "chat.completion" if chat else "text_completion",
        "created": 1,
        "model": body.get("model", "stub"),
        "choices": [choice],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }


async def _events(body: dict[str, Any], chat: bool, text: str) -> AsyncIterator[bytes]:
    n_chunks = int(body.get("fake_chunks", 0))
    words = ["tok"] * n_chunks if n_chunks else text.split(" ")
    usage = {"prompt_tokens": 5, "completion_tokens": len(words), "total_tokens": 5 + len(words)}
    for i, word in enumerate(words):
        delta = {"index": 0, "delta": {"content": word}} if chat else {"index": 0, "text": word}
        chunk = {
            "id": "c",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1,
            "model": "stub",
            "choices": [delta],
        }
        if (body.get("stream_options") or {}).get("continuous_usage_stats") and not body.get(
            "fake_no_chunk_usage"  # an engine without per-chunk counts: the gateway estimates
        ):
            chunk["usage"] = {
                "prompt_tokens": 5,
                "completion_tokens": i + 1,
                "total_tokens": 6 + i,
            }
        yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        await asyncio.sleep(0.001 if n_chunks else 0.01)
        if body.get("fake_break") and i == 0:
            raise RuntimeError("engine died mid-stream")
        if body.get("fake_stream_error") and i == 0:
            said = body["fake_stream_error"]  # vLLM's own words for a failure, or these
            yield stub_vllm.stream_error_event(*([said] if isinstance(said, str) else []))
            break
    if (body.get("stream_options") or {}).get("include_usage"):
        final = {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "stub",
            "choices": [],
            "usage": usage,
        }
        yield b"data: " + orjson.dumps(final) + b"\n\n"
    yield b"data: [DONE]\n\n"
