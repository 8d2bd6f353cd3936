"""One error shape on the wire, whoever made the error (plain ASGI).

Sits just inside :class:`shared.request_id.RequestIdMiddleware` on both the gateway
and the engine. For every response with status >= 400 it reads the (small) body and
rewrites it with :func:`shared.errors.normalize_error`: vLLM's own errors
(``"type": "BadRequestError", "code": 400``), Starlette's plain-text ``Not Found``
and our own all leave as ``{"error": {"message", "type", "param", "code",
"request_id"}}`` with a registered string code, plus the registry's retry headers
(``x-should-retry``; ``Retry-After`` only where the sender set a true time). In an
event stream, a ``data: {"error": ...}`` event (vLLM's mid-stream failure) is
rewritten the same way. Successful non-stream bodies pass through untouched.

An exception that escapes the app before the response started is answered here as
``500 internal_error`` (so it too carries the request id), then re-raised for the
server to log.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from steergate.shared import errors
from steergate.shared.asgi import (
    ASGIApp,
    Message,
    Receive,
    Scope,
    Send,
    header,
    replace_header,
    send_error,
)

log = logging.getLogger("steergate.errors")

#: Error bodies larger than this are not errors we can read; passed through as sent.
MAX_ERROR_BODY = 64 * 1024
_RETRY_HEADERS = (b"x-should-retry", b"retry-after", b"retry-after-ms")


class OpenAIErrorMiddleware:
    """``passthrough``: paths whose answers are not API errors and go out as sent
    (the gateway's ``/readyz``: its 503 body says whether Redis or the engines are
    down, which a generic error body would hide)."""

    def __init__(self, app: ASGIApp, passthrough: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.passthrough = passthrough

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.passthrough:
            await self.app(scope, receive, send)
            return
        state: dict[str, Any] = {"started": False}
        held: Message | None = None
        chunks: list[bytes] = []
        size = 0
        streaming = False

        async def shaped_send(message: Message) -> None:
            nonlocal held, size, streaming
            kind = message["type"]
            if kind == "http.response.start":
                state["started"] = True
                headers = list(message.get("headers", []))
                if message["status"] >= 400:
                    held = message
                    return
                ctype = header(headers, b"content-type") or b""
                streaming = ctype.startswith(b"text/event-stream")
                await send(message)
            elif kind == "http.response.body" and held is not None:
                body = message.get("body", b"")
                size += len(body)
                more = message.get("more_body", False)
                if size > MAX_ERROR_BODY:  # not an error body we understand: as sent
                    start, held = held, None
                    await send(start)
                    for chunk in chunks:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    chunks.clear()
                    await send(message)
                    return
                chunks.append(body)
                raw = b"".join(chunks)
                # A complete JSON body goes out at once, even if the sender keeps the
                # response open (the gateway's 413 drains the upload after its answer).
                if more and not _is_json(raw):
                    return
                start, held = held, None
                await _send_shaped(send, start, raw, more_body=more)
            elif kind == "http.response.body" and streaming:
                body = message.get("body", b"")
                if b'"error"' in body:
                    message = {**message, "body": shape_stream_chunk(body)}
                await send(message)
            else:
                await send(message)

        try:
            await self.app(scope, receive, shaped_send)
        except Exception:
            if not state["started"]:
                log.exception("unhandled error on %s", scope.get("path", "?"))
                exc = errors.APIError("internal_error", "Internal error.")
                # The error is re-raised (for the server's log) and the server then
                # closes the connection: say so, or a keep-alive client (the gateway's
                # pool) sends its next request on a connection that is being closed.
                await send_error(send, exc, [(b"connection", b"close")])
            raise


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return False
    return True


async def _send_shaped(
    send: Send,
    start: Message,
    raw: bytes,
    extra: dict[str, str] | None = None,
    *,
    more_body: bool = False,
) -> None:
    status = int(start["status"])
    headers = list(start.get("headers", []))
    try:
        doc = json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError):
        doc = None
    text = raw.decode("utf-8", "replace").strip()[:500] if doc is None else ""
    body = errors.normalize_error(status, doc, text)
    out = json.dumps(body, separators=(",", ":")).encode()
    headers = replace_header(headers, b"content-type", b"application/json")
    headers = replace_header(headers, b"content-length", str(len(out)).encode())
    have = {k.lower() for k, _ in headers}
    retry = {**errors.retry_headers(body["error"]["code"]), **(extra or {})}
    if not have & set(_RETRY_HEADERS):  # the sender's own retry decision wins
        headers += [(k.encode(), v.encode()) for k, v in retry.items()]
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": out, "more_body": more_body})


def shape_stream_chunk(chunk: bytes) -> bytes:
    """Rewrite the ``data: {"error": ...}`` events of one SSE chunk (vLLM sends each
    event as one chunk; an event split across chunks is left as it is)."""
    events = chunk.split(b"\n\n")
    for i, event in enumerate(events):
        if b'"error"' not in event:
            continue
        lines = event.split(b"\n")
        for j, line in enumerate(lines):
            if not line.startswith(b"data: {"):
                continue
            try:
                doc = json.loads(line[6:])
            except (ValueError, UnicodeDecodeError):
                continue
            if not (isinstance(doc, dict) and set(doc) == {"error"}):
                continue
            err = doc["error"]
            status = _status_of(err)
            shaped = errors.normalize_error(status, doc)
            lines[j] = b"data: " + json.dumps(shaped, separators=(",", ":")).encode()
        events[i] = b"\n".join(lines)
    return b"\n\n".join(events)


def _status_of(err: Any) -> int:
    """The HTTP status a streamed error stands for: vLLM's integer ``code``, or our
    registered code's status, else 500."""
    code = err.get("code") if isinstance(err, dict) else None
    if isinstance(code, int) and 400 <= code <= 599:
        return code
    if isinstance(code, str) and code in errors.REGISTRY and errors.REGISTRY[code].status:
        return errors.REGISTRY[code].status
    return 500
