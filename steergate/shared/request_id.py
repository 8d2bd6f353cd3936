"""Request ids: one per request, on every response, in every log line and error body.

The gateway takes the client's ``x-request-id`` when it is valid (1-128 characters
of ``[A-Za-z0-9._:-]``, so it is safe in a header, a log line and a format string)
and otherwise makes one (``req_`` + 32 hex digits, OpenAI's form). It sends it to
the engine as ``x-request-id``; the engine takes it the same way, and vLLM uses it
for its own request ids (``chatcmpl-<id>``), so one id follows a request through
the gateway's log, the engine's log and vLLM's.

:class:`RequestIdMiddleware` (plain ASGI) sets it for the request's context and on
the response. :func:`install_log_records` makes every log record created while a
request is being served carry it: ``record.request_id`` and `` [request_id=...]``
at the end of the message (vLLM's formatter is not ours, so the message is the one
place every handler prints; uvicorn's access line, which ignores the message, gets it
after the client address).

Deliberately free of imports from ``shared.errors`` / ``shared.asgi`` (which use
:func:`current`), so there is no import cycle.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
import secrets
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

HEADER = "x-request-id"
_HEADER_B = HEADER.encode()
_VALID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "steergate_request_id", default=None
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def current() -> str | None:
    """The id of the request being served in this context, if any."""
    return _current.get()


def valid(value: str | None) -> bool:
    return value is not None and _VALID.fullmatch(value) is not None


def new() -> str:
    return "req_" + secrets.token_hex(16)


@contextlib.contextmanager
def use(rid: str) -> Iterator[None]:
    """``rid`` as the current id, for an answer made outside any request's context (the
    HTTP protocol's own errors, before the app runs)."""
    token = _current.set(rid)
    try:
        yield
    finally:
        _current.reset(token)


def outgoing_headers() -> dict[str, str]:
    """Headers for a call made on behalf of the current request (to an engine)."""
    rid = _current.get()
    return {HEADER: rid} if rid else {}


class RequestIdMiddleware:
    """Outermost: every response of an HTTP request carries ``x-request-id``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = _from_headers(scope.get("headers") or [])
        raw = rid.encode()
        token = _current.set(rid)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != _HEADER_B]
                headers.append((_HEADER_B, raw))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _current.reset(token)


def _from_headers(headers: list[tuple[bytes, bytes]]) -> str:
    for key, value in headers:
        if key.lower() == _HEADER_B:
            try:
                text = value.decode("ascii")
            except UnicodeDecodeError:
                break
            return text if valid(text) else new()
    return new()


_installed = False


def install_log_records() -> None:
    """Make every log record created during a request carry its id (idempotent)."""
    global _installed
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, AccessLogRequestId) for f in access.filters):
        access.addFilter(AccessLogRequestId())
    if _installed:
        return
    _installed = True
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        rid = _current.get()
        record.request_id = rid or "-"
        if rid and isinstance(record.msg, str):
            # The id's alphabet has no '%', so it is safe inside a %-format string.
            record.msg = f"{record.msg} [request_id={rid}]"
        return record

    logging.setLogRecordFactory(factory)


class AccessLogRequestId(logging.Filter):
    """uvicorn's access formatter builds its line from ``record.args`` alone (the
    message is ignored), so the id moves from the message into the client address:
    ``127.0.0.1:5123 [request_id=req_...] - "POST /v1/responses HTTP/1.1" 200``."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = getattr(record, "request_id", "-")
        args = record.args
        if rid == "-" or not (isinstance(args, tuple) and args and isinstance(args[0], str)):
            return True
        tag = f" [request_id={rid}]"
        if isinstance(record.msg, str) and record.msg.endswith(tag):
            record.msg = record.msg[: -len(tag)]
        if not args[0].endswith(tag):
            record.args = (args[0] + tag, *args[1:])
        return True
