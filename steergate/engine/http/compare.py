"""``steering.compare: true``: the steered answer and the same request unsteered, in
one response (issue 20).

Where: in the engine's API server, one level below the steering rewrite. The request
is sent to vLLM twice, concurrently, inside the same HTTP exchange: once as rewritten
(steered, latch semantics as usual), once without ``steering``, ``conversation_id``
and the gateway's expectations (so the default answer ignores any latch), both with the
same ``seed`` (one is drawn when the request has none). vLLM batches the two like any
other pair of requests, so the unsteered one is exactly what the same request without
steering gives.

The answers are merged: the steered request's ``k`` choices (``n`` per prompt) keep
indices ``0..k-1``, the unsteered ones become ``k..2k-1`` in the same order; ``usage``
is the sum of both, so a gateway (or anyone) metering the response meters the tokens
of both. In a stream the two requests' chunks are relayed as they come (their choice
indices keep them apart), the two final usage chunks become one summed chunk, and one
``data: [DONE]`` ends it. If either request fails before its answer starts (a
4xx/5xx), that answer is sent and the other is cancelled.

Why not the gateway: the gateway relays one upstream exchange per request (one lease,
one engine, one stream meter); doing the fan-out here keeps every gateway path
unchanged and keeps both halves on the engine that holds the conversation's latch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from steergate.shared.asgi import header, replace_header
from steergate.shared.engine_api import EXPECT_FIELD
from steergate.shared.errors import InvalidField

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]
Receive = Callable[[], Awaitable[Message]]
App = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]

_DONE = b"data: [DONE]"


def wants_compare(doc: dict[str, Any]) -> bool:
    steering = doc.get("steering")
    return isinstance(steering, dict) and steering.get("compare") is True


def split(doc: dict[str, Any], path: str) -> dict[str, Any]:
    """Prepare ``doc`` (steered, in place: a seed) and return the unsteered twin."""
    if path.endswith("/responses"):
        raise InvalidField(
            "steering.compare",
            "'steering.compare' is served on /v1/chat/completions and /v1/completions",
        )
    if doc.get("capture") is not None:
        raise InvalidField("steering.compare", "'steering.compare' cannot be combined with capture")
    if doc.get("seed") is None:
        doc["seed"] = secrets.randbits(31)  # the same draw for both answers
    plain = {k: v for k, v in doc.items() if k not in ("steering", "conversation_id",
                                                       EXPECT_FIELD)}
    return plain


def num_choices(doc: dict[str, Any]) -> int:
    """The choices one answer holds: ``n`` per prompt. A ``/v1/completions`` prompt that
    is a list of texts or of token-id lists is that many prompts (vLLM numbers their
    choices prompt by prompt); the default answer's are shifted past all of them. They
    used to be shifted by ``n`` alone: two prompts gave indices 0, 1, 1, 2."""
    n = doc.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return n * len(prompt)
    return n


class _Answer:
    """What one inner request sends, as a queue of ASGI messages."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Message] = asyncio.Queue()

    async def send(self, message: Message) -> None:
        await self.queue.put(message)

    async def start(self) -> Message:
        while True:
            message = await self.queue.get()
            if message["type"] == "http.response.start":
                return message

    async def body(self) -> bytes:
        chunks = []
        while True:
            message = await self.queue.get()
            if message["type"] != "http.response.body":
                continue
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)


async def serve(
    app: App,
    steered: tuple[dict[str, Any], Receive],
    plain: tuple[dict[str, Any], Receive],
    send: Send,
    shift: int,
) -> None:
    """Run both requests (scope, receive) and send one merged answer."""
    a, b = _Answer(), _Answer()
    tasks = [asyncio.create_task(app(steered[0], steered[1], a.send)),
             asyncio.create_task(app(plain[0], plain[1], b.send))]
    try:
        start_a, start_b = await asyncio.gather(a.start(), b.start())
        failed = next(((s, x) for s, x in ((start_a, a), (start_b, b)) if s["status"] != 200),
                      None)
        if failed is not None:
            await send(failed[0])
            await send({"type": "http.response.body", "body": await failed[1].body()})
            return
        ctype = (header(list(start_a.get("headers", [])), b"content-type") or b"").lower()
        if ctype.startswith(b"text/event-stream"):
            await _merge_streams(start_a, a, b, send, shift)
        else:
            await _merge_json(start_a, a, b, send, shift)
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task


def _add_usage(total: dict[str, Any] | None, usage: Any) -> dict[str, Any] | None:
    if not isinstance(usage, dict):
        return total
    out = dict(total or {})
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        if isinstance(usage.get(key), int):
            out[key] = out.get(key, 0) + usage[key]
    return out


def _shift(doc: dict[str, Any], shift: int) -> None:
    for choice in doc.get("choices") or ():
        if isinstance(choice, dict) and isinstance(choice.get("index"), int):
            choice["index"] += shift


async def _merge_json(start: Message, a: _Answer, b: _Answer, send: Send, shift: int) -> None:
    body_a, body_b = await asyncio.gather(a.body(), b.body())
    try:
        doc_a, doc_b = json.loads(body_a), json.loads(body_b)
        _shift(doc_b, shift)
        doc_a["choices"] = list(doc_a.get("choices") or []) + list(doc_b.get("choices") or [])
        usage = _add_usage(_add_usage(None, doc_a.get("usage")), doc_b.get("usage"))
        if usage is not None:
            doc_a["usage"] = {**(doc_a.get("usage") or {}), **usage}
        body = json.dumps(doc_a, separators=(",", ":")).encode()
    except (ValueError, TypeError, AttributeError):
        body = body_a  # not vLLM's shape: the steered answer alone, unchanged
    headers = replace_header(list(start.get("headers", [])), b"content-length",
                             str(len(body)).encode())
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _merge_streams(start: Message, a: _Answer, b: _Answer, send: Send, shift: int) -> None:
    await send(start)
    state: dict[str, Any] = {"usage": None, "template": None}
    lock = asyncio.Lock()

    async def pump(answer: _Answer, offset: int) -> None:
        buf = b""
        while True:
            message = await answer.queue.get()
            if message["type"] != "http.response.body":
                continue
            buf += message.get("body", b"")
            out = []
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                relayed = _event(event, offset, state)
                if relayed is not None:
                    out.append(relayed + b"\n\n")
            if out:
                async with lock:
                    await send({"type": "http.response.body", "body": b"".join(out),
                                "more_body": True})
            if not message.get("more_body", False):
                return

    await asyncio.gather(pump(a, 0), pump(b, shift))
    tail = b""
    if state["template"] is not None:
        chunk = {**state["template"], "usage": state["usage"]}
        tail += b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
    await send({"type": "http.response.body", "body": tail + _DONE + b"\n\n",
                "more_body": False})


def _event(event: bytes, offset: int, state: dict[str, Any]) -> bytes | None:
    """One SSE event of either stream, as relayed (None: held back or dropped)."""
    line = event.strip()
    if line == _DONE:
        return None  # one [DONE] ends the merged stream
    if not line.startswith(b"data: {"):
        return event
    try:
        doc = json.loads(line[6:])
    except ValueError:
        return event
    if not isinstance(doc, dict):
        return event
    if doc.get("choices") == [] and isinstance(doc.get("usage"), dict):
        state["usage"] = _add_usage(state["usage"], doc["usage"])
        state["template"] = doc
        return None
    if offset and doc.get("choices"):
        _shift(doc, offset)
        return b"data: " + json.dumps(doc, separators=(",", ":")).encode()
    return event
