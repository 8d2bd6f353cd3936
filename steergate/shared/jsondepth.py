"""A nesting-depth bound for JSON request bodies, checked on the raw bytes before
anything parses them.

JSON nested 1,000 deep is valid JSON. Python's ``json`` then raises RecursionError
and ``orjson.dumps`` refuses past 254 levels, both as 500s, and the gateway spent an
admission on it first. Nothing we serve needs more than a few levels (OpenAI tool
schemas a dozen or so), so 64 is generous.

The scan never runs per byte in Python (a body may be 8 MiB): ``bytes.count`` settles
the usual case, strings are cut out by one regex, everything but brackets is deleted
by ``bytes.translate``, and the running depth is a numpy cumulative sum. Malformed
JSON is left to the parser; this only answers "deeper than the limit?".
"""

from __future__ import annotations

import re

import numpy as np

from steergate.shared.asgi import (
    ASGIApp,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    replay,
    send_error,
)
from steergate.shared.errors import InvalidField

MAX_JSON_DEPTH = 64
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_CHUNK = 1 << 20  # brackets per numpy step, which bounds the scan's memory


def json_too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when arrays/objects in ``raw`` nest more than ``limit`` levels deep."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False  # too few openers to get that deep: the common case, O(n) memchr
    if b'"' in raw:
        raw = _STRING.sub(b"", raw)
    brackets = raw.translate(None, _NOT_BRACKET)
    depth = 0
    for start in range(0, len(brackets), _CHUNK):
        # "[" 0x5b and "{" 0x7b have bit 1 set, "]" 0x5d and "}" 0x7d do not: +1 / -1.
        part = np.frombuffer(brackets, np.uint8, min(_CHUNK, len(brackets) - start), start)
        running = np.cumsum((part & 2).astype(np.int32) - 1) + depth
        if int(running.max()) > limit:
            return True
        depth = int(running[-1])
    return False


def not_utf8_json(raw: bytes) -> bool:
    """True for a body in UTF-16 or UTF-32, which JSON's exchange form (RFC 8259) is
    not: Python's ``json.loads`` reads them from bytes (a NUL among the first four
    bytes, or a UTF-16 byte-order mark), while the depth scan reads bytes as UTF-8, so
    in one of them a string hides brackets from the scan (UTF-16 ``"\u5c00"`` is the
    bytes ``00 5c``: a backslash) and 3,000 levels passed it, then raised
    RecursionError (a 500)."""
    head = raw[:4]
    return b"\x00" in head or head.startswith((b"\xff\xfe", b"\xfe\xff"))


def check_json_depth(raw: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise the contract's 400 ``invalid_json`` for a body nested deeper than
    ``limit``, or one not in UTF-8 (:func:`not_utf8_json`), whose depth it cannot see."""
    if not_utf8_json(raw):
        raise InvalidField("body", "The request body must be JSON in UTF-8.", code="invalid_json")
    if json_too_deep(raw, limit):
        raise InvalidField(
            "body",
            f"The request body nests arrays/objects more than {limit} levels deep.",
            code="invalid_json",
        )


_BINARY_TYPES = (b"application/octet-stream", b"multipart/")


class JsonDepthMiddleware:
    """The engine's copy of the bound, for every body anything behind it may parse as
    JSON (vLLM's own routes included). Install it inside the token check: only
    authenticated bodies are buffered. GGUF and multipart uploads pass untouched."""

    def __init__(self, app: ASGIApp, limit: int = MAX_JSON_DEPTH) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        ctype = (header(scope.get("headers", []), b"content-type") or b"").strip().lower()
        if ctype.startswith(_BINARY_TYPES):
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:
            return
        try:
            check_json_depth(body, self.limit)
        except InvalidField as exc:
            await send_error(send, exc)
            return
        await self.app(scope, replay(body, receive), send)
