"""Activation capture in the API server: the ``capture`` field in, the answer out.

:func:`take` pops and validates ``capture`` (against the served model; sites and
bytes bounded up front, ``capture_too_large``), before the steering rewrite changes
any latch. :meth:`CaptureCall.apply` then adds the worker payload to ``vllm_xargs``
with a fresh random capture id. :func:`with_capture` wraps ``send``: a non-stream
JSON 200 gets a top-level ``capture`` object; an event stream gets one chunk of its
own before ``data: [DONE]`` (chat/completions) or ``capture`` inside the
``response.completed`` event's ``response`` (responses). The worker files are read
and deleted as the answer is built, and deleted on any other ending.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from steergate.engine import capture_io
from steergate.shared import engine_api
from steergate.shared.asgi import Message, Send, header, replace_header
from steergate.shared.capture import (
    CaptureLimits,
    CaptureSpec,
    capture_answer,
    check_capture_bytes,
    encode_site,
    parse_capture,
)
from steergate.shared.errors import APIError, InvalidField
from steergate.shared.steering import ModelShape

log = logging.getLogger("steergate.capture")

#: Tokens a chat template or BOS may add to a text prompt, past one token per byte.
_TEXT_SLACK = 16


@dataclass(frozen=True)
class CaptureSupport:
    """What the API server knows about the workers' ability to capture."""

    max_model_len: int
    refused: str | None = None  # why this engine cannot capture (CUDA graphs), if so


#: Capture ids of this API server's requests still running: their workers' files are
#: being written, or wait to be collected, and the stale sweep leaves them alone.
_RUNNING: set[str] = set()


@dataclass(frozen=True)
class CaptureCall:
    spec: CaptureSpec
    cid: str
    n: int
    prompts: int
    prompt_list: bool  # /v1/completions: engine request ids carry the prompt's index
    hidden: int

    def apply(self, doc: dict[str, Any]) -> None:
        payload = capture_io.encode_payload(self.cid, self.spec.sites, self.spec.tokens,
                                            self.spec.reduce)
        doc["vllm_xargs"] = {**(doc.get("vllm_xargs") or {}), capture_io.XARGS_KEY: payload}
        _RUNNING.add(self.cid)  # until answer() or discard()

    def answer(self) -> dict[str, Any]:
        """Collect (and delete) the workers' files; every choice has every site
        (zero rows where a choice captured none, e.g. ``generated`` with one token)."""
        try:
            got = capture_io.collect(self.cid)
        finally:
            _RUNNING.discard(self.cid)
        by_index: dict[int, Mapping[tuple[str, int], Any]] = {}
        for req_id, sites in got.items():
            by_index[capture_io.choice_index(req_id, self.n, self.prompt_list)] = sites
        empty = _zeros(self.hidden)
        sites = [
            encode_site(i, hook, layer, by_index.get(i, {}).get((hook, layer), empty))
            for i in range(max(self.prompts * self.n, max(by_index, default=-1) + 1))
            for hook, layer in self.spec.sites
        ]
        return capture_answer(self.spec, sites)

    def discard(self) -> None:
        """Remove the workers' files, now and again later: a worker may write one more
        step's rows after this, also after an answer collected them (see
        ``LATE_WRITES_S``)."""
        _RUNNING.discard(self.cid)
        capture_io.discard(self.cid)
        _discard_again_later(self.cid)


#: A worker may still write a step's rows after the API server is done with its request:
#: a client left a stream mid-step, or the answer ended on a ``stop`` string (the API
#: server's detokenizer finds those, and the engine core runs the request one more step
#: before the abort reaches it). The request's files are removed again this long after.
#: Found from outside, both: such a file stayed in /dev/shm until a later capture's
#: stale sweep (10 minutes), and past the engine's end.
LATE_WRITES_S = (1.0, 10.0)


def _discard_again_later(cid: str) -> None:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no loop (a unit test's direct call): nothing runs later
        return
    for delay in LATE_WRITES_S:
        loop.call_later(delay, capture_io.discard, cid)


def take(
    doc: dict[str, Any], path: str, shape: ModelShape, support: CaptureSupport,
    limits: CaptureLimits | None = None,
) -> CaptureCall | None:
    raw = doc.pop("capture", None)
    if raw is None:
        return None
    spec = parse_capture(raw, shape, limits=limits)
    if support.refused:
        raise APIError("not_implemented", f"capture is not available on this engine: "
                       f"{support.refused}", param="capture")
    if doc.get("use_beam_search"):
        raise InvalidField("capture", "'capture' cannot be combined with 'use_beam_search'")
    n = doc.get("n", 1)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    prompt_rows = _prompt_rows(doc, path, support.max_model_len)
    max_new = _max_new(doc, path, support.max_model_len)
    # Per prompt, then times n: never a list as long as the client's n.
    rows = n * sum(min(support.max_model_len, spec.max_rows(p, max_new)) for p in prompt_rows)
    check_capture_bytes(spec, shape.hidden_size, rows, limits)
    capture_io.sweep_stale(running=_RUNNING)
    return CaptureCall(spec, capture_io.new_capture_id(), n, len(prompt_rows),
                       path == engine_api.COMPLETIONS, shape.hidden_size)


def _prompt_rows(doc: Mapping[str, Any], path: str, max_len: int) -> list[int]:
    """Per prompt, the most positions it can have (exact for token ids)."""
    if path != engine_api.COMPLETIONS:
        return [max_len]  # a chat template's length is not known here
    prompt = doc.get("prompt")
    if isinstance(prompt, str):
        return [min(max_len, len(prompt.encode()) + _TEXT_SLACK)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return [len(prompt)]
        out = []
        for p in prompt:
            if isinstance(p, list):
                out.append(len(p))
            elif isinstance(p, str):
                out.append(min(max_len, len(p.encode()) + _TEXT_SLACK))
            else:
                out.append(max_len)
        return out
    return [max_len]  # vLLM refuses it in its own words


def _max_new(doc: Mapping[str, Any], path: str, max_len: int) -> int:
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = doc.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return min(value, max_len)
    return max_len


def _zeros(hidden: int) -> Any:
    import numpy as np

    return np.zeros((0, hidden), np.float32)


def with_capture(send: Send, call: CaptureCall, path: str) -> Send:
    """See the module doc. Anything but a 200 deletes the files."""
    state: dict[str, Any] = {"mode": None, "start": None, "chunks": [], "done": False, "head": {}}

    async def _send(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            ctype = (header(headers, b"content-type") or b"").split(b";")[0].strip().lower()
            if message["status"] != 200:
                state["mode"] = "pass"
                call.discard()
                await send(message)
            elif ctype == b"text/event-stream":
                state["mode"] = "sse"
                await send(message)
            else:
                state["mode"] = "json"
                state["start"] = message
            return
        if message["type"] != "http.response.body":
            await send(message)
            return
        more = message.get("more_body", False)
        if state["mode"] == "json":
            state["chunks"].append(message.get("body", b""))
            if more:
                return
            body = _inject_json(b"".join(state["chunks"]), call)
            start = state["start"]
            start["headers"] = replace_header(
                list(start["headers"]), b"content-length", str(len(body)).encode()
            )
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        if state["mode"] == "sse":
            body = message.get("body", b"")
            if not state["done"]:
                if not state["head"]:
                    state["head"] = _chunk_head(body)
                body, state["done"] = _inject_sse(body, call, path, state["head"])
            if not more and not state["done"]:
                call.discard()  # a stream that ended without its last event
            await send({**message, "body": body})
            return
        await send(message)

    return _send


def _inject_json(body: bytes, call: CaptureCall) -> bytes:
    try:
        doc = json.loads(body)
    except ValueError:
        call.discard()
        return body
    if not isinstance(doc, dict):
        call.discard()
        return body
    doc["capture"] = call.answer()
    return json.dumps(doc, separators=(",", ":")).encode()


_DONE = b"data: [DONE]"


def _chunk_head(body: bytes) -> dict[str, Any]:
    """``id``, ``object``, ``created``, ``model`` of the stream's first chunk, which
    the capture chunk repeats so that SDKs read it as one more chunk."""
    for line in body.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                doc = json.loads(line[6:])
            except ValueError:
                return {}
            return {k: doc[k] for k in ("id", "object", "created", "model") if k in doc}
    return {}


def _inject_sse(
    body: bytes, call: CaptureCall, path: str, head: Mapping[str, Any]
) -> tuple[bytes, bool]:
    if path == engine_api.RESPONSES:
        return _inject_completed(body, call)
    at = body.find(_DONE)
    if at < 0:
        return body, False
    event = {**head, "choices": [], "capture": call.answer()}
    chunk = b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
    return body[:at] + chunk + body[at:], True


def _inject_completed(body: bytes, call: CaptureCall) -> tuple[bytes, bool]:
    if b'"response.completed"' not in body:
        return body, False
    out, done = [], False
    for line in body.split(b"\n"):
        if not done and line.startswith(b"data: ") and b'"response.completed"' in line:
            try:
                event = json.loads(line[6:])
                event["response"]["capture"] = call.answer()
                line = b"data: " + json.dumps(event, separators=(",", ":")).encode()
                done = True
            except (ValueError, KeyError, TypeError):
                pass
        out.append(line)
    return b"\n".join(out), done
