"""More of vLLM 0.32's OpenAI surface for the stub engine (``stub_engine.py``), in
vLLM's own shapes (read from ``vllm/entrypoints``): ``/v1/responses`` (JSON and its
event stream), ``/tokenize``, ``/detokenize``, the model card, and the errors vLLM
sends in its own words (``"type": "BadRequestError", "code": 400``), which the
endpoint plugin must rewrite into the OpenAI shape.

Error knobs, as a client would trigger them on a real engine: ``max_tokens`` < 1, a
``model`` of ``no-such-model``, ``tools`` without ``tool_choice: "none"`` (vLLM
without ``--enable-auto-tool-choice``), ``fake_stream_error`` (the stream ends with
vLLM's ``data: {"error": ...}`` event after its first chunk), ``fake_raise`` (an
exception nothing in the app handles).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from steergate.shared import engine_api

MODEL = "stub"
UNKNOWN_MODEL = "no-such-model"
MAX_MODEL_LEN = 2048


def vllm_error(message: str, status: int, err_type: str, param: str | None = None) -> dict:
    """``vllm.entrypoints.serve.exception_handling.error_response.create_error_response``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_for(body: dict[str, Any]) -> JSONResponse | None:
    """vLLM's answer to a request it refuses, or None."""
    max_tokens = body.get("max_tokens", body.get("max_output_tokens"))
    if isinstance(max_tokens, int) and max_tokens < 1:
        msg = f"max_tokens must be at least 1, got {max_tokens}."
        return JSONResponse(vllm_error(msg, 400, "BadRequestError", "max_tokens"), 400)
    if "prompt" in body and not _is_prompt(body["prompt"]):
        # vLLM's request model: a string, a list of token ids, or a list of either
        msg = "prompt: Input should be a valid string or a list of strings or token ids"
        return JSONResponse(vllm_error(msg, 400, "BadRequestError", "prompt"), 400)
    if body.get("model") == UNKNOWN_MODEL:
        msg = f"The model `{UNKNOWN_MODEL}` does not exist. Valid aliases: {MODEL}."
        return JSONResponse(vllm_error(msg, 404, "NotFoundError", "model"), 404)
    if body.get("tools") and body.get("tool_choice", "auto") not in (None, "none"):
        msg = (
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        )
        return JSONResponse(vllm_error(msg, 400, "BadRequestError"), 400)
    return None


def _is_prompt(prompt: Any) -> bool:
    def tokens(x: Any) -> bool:
        return isinstance(x, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in x
        )

    if isinstance(prompt, str) or tokens(prompt):
        return True
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(p, str) or (tokens(p) and p) for p in prompt)
    )


def stream_error_event(message: str = "Internal server error") -> bytes:
    """What vLLM's stream generators yield on an exception mid-stream."""
    err = vllm_error(message, 500, "InternalServerError")
    return b"data: " + orjson.dumps(err) + b"\n\n"


def model_list() -> dict[str, Any]:
    card = {
        "id": MODEL,
        "object": "model",
        "created": 1,
        "owned_by": "vllm",
        "root": MODEL,
        "parent": None,
        "max_model_len": MAX_MODEL_LEN,
        "permission": [
            {
                "id": "modelperm-1",
                "object": "model_permission",
                "created": 1,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }
    return {"object": "list", "data": [card]}


def _usage(output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 5 + output_tokens,
    }


def _response(body: dict[str, Any], text: str, status: str, usage: Any) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": None}]
    output = (
        [
            {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": content,
            }
        ]
        if status == "completed"
        else []
    )
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "model": body.get("model") or MODEL,
        "output": output,
        "status": status,
        "usage": usage,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "metadata": None,
        "parallel_tool_calls": True,
        "temperature": 1.0,
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "background": False,
        "max_output_tokens": body.get("max_output_tokens") or 16,
        "previous_response_id": None,
        "reasoning": None,
        "service_tier": "auto",
        "text": None,
        "truncation": "disabled",
        "user": None,
    }


async def _response_events(body: dict[str, Any], text: str) -> AsyncIterator[bytes]:
    """vLLM's event order for a plain text answer (``event:`` line, then ``data:``)."""
    words = text.split(" ")
    seq = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        doc = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return f"event: {kind}\ndata: ".encode() + orjson.dumps(doc) + b"\n\n"

    yield event("response.created", response=_response(body, "", "in_progress", None))
    yield event("response.in_progress", response=_response(body, "", "in_progress", None))
    item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "in_progress"}
    yield event("response.output_item.added", output_index=0, item={**item, "content": []})
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    yield event(
        "response.content_part.added", item_id="msg_1", output_index=0, content_index=0, part=part
    )
    for word in words:
        yield event(
            "response.output_text.delta",
            item_id="msg_1",
            output_index=0,
            content_index=0,
            delta=word,
            logprobs=[],
        )
        await asyncio.sleep(0.005)
    yield event(
        "response.output_text.done",
        item_id="msg_1",
        output_index=0,
        content_index=0,
        text=text,
        logprobs=[],
    )
    done = {**part, "text": text}
    yield event(
        "response.content_part.done", item_id="msg_1", output_index=0, content_index=0, part=done
    )
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": None}]
    yield event(
        "response.output_item.done",
        output_index=0,
        item={**item, "status": "completed", "content": content},
    )
    final = _response(body, text, "completed", _usage(len(words)))
    yield event("response.completed", response=final)


def install(app: FastAPI, seen: list[dict[str, Any]], answer: Callable[[dict], str]) -> None:
    """The Responses API and the tokenizer routes, on the stub's app."""

    async def responses(request: Request) -> Any:
        body = await request.json()
        seen.append(body)
        refused = error_for(body)
        if refused is not None:
            return refused
        text = answer(body)
        if not body.get("stream"):
            return JSONResponse(_response(body, text, "completed", _usage(len(text.split()))))
        return StreamingResponse(_response_events(body, text), media_type="text/event-stream")

    async def tokenize(request: Request) -> Any:
        body = await request.json()
        messages = body.get("messages")
        if isinstance(body.get("prompt"), str):
            text = body["prompt"]
        elif isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
            text = " ".join(str(m.get("content", "")) for m in messages)
        else:
            err = vllm_error("1 validation error:\n  prompt: Field required", 400, "Bad Request")
            err["error"]["param"] = "prompt"
            return JSONResponse(err, 400)
        tokens = [len(w) for w in text.split()]
        out: dict[str, Any] = {
            "count": len(tokens),
            "max_model_len": MAX_MODEL_LEN,
            "tokens": tokens,
        }
        out["token_strs"] = text.split() if body.get("return_token_strs") else None
        return JSONResponse(out)

    async def detokenize(request: Request) -> Any:
        body = await request.json()
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
            msg = "1 validation error:\n  tokens: Input should be a valid list"
            return JSONResponse(vllm_error(msg, 400, "Bad Request", "tokens"), 400)
        return JSONResponse({"prompt": " ".join(f"<{t}>" for t in tokens)})

    app.post(engine_api.RESPONSES)(responses)
    app.post(engine_api.TOKENIZE)(tokenize)
    app.post(engine_api.DETOKENIZE)(detokenize)
