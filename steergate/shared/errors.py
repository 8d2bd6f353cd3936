"""The error vocabulary: every code a client (or the gateway, from an engine) can get,
with its HTTP status, OpenAI ``type``, retry semantics and when it happens.

Every error body is ``{"error": {"message", "type", "param", "code", "request_id"}}``:
``code`` is always a string from :data:`REGISTRY`, and ``request_id`` is the
request's ``x-request-id`` (see ``steergate/shared/request_id.py``). Code raises errors by
code only -- ``APIError("vector_quota_exceeded", message)`` -- and the status, type
and retry headers come from here, so one code can never mean two statuses.
docs/api.md's error table is generated from :data:`REGISTRY`
(``scripts/error_table.py``); ``tests/shared/test_error_registry.py`` fails when a
code is raised anywhere but not registered, registered but never used, or missing
from the docs.

Retry semantics (``Retry``), read by the official SDKs:

* ``never``: waiting cannot help (invalid input, a quota that does not refill with
  time, a missing resource). ``x-should-retry: false`` and no ``Retry-After``.
* ``after``: the gateway knows when it can succeed (a GCRA limit, exact to the
  millisecond). ``Retry-After`` (whole seconds, rounded up) and ``retry-after-ms``.
* ``backoff``: it may succeed later but nobody knows when (a request in flight must
  end, an engine or Redis must come back). ``x-should-retry: true`` and no
  ``Retry-After``: the client's own exponential backoff decides; the gateway never
  invents a time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Container, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from steergate.shared import request_id


class Retry(str, Enum):
    NEVER = "never"
    AFTER = "after"
    BACKOFF = "backoff"


class Side(str, Enum):
    """Who sends the code to a client."""

    GATEWAY = "gateway"
    ENGINE = "engine"  # the engine only (direct callers); never reaches a gateway client
    BOTH = "gateway, engine"
    INTERNAL = "engine → gateway"  # consumed by the gateway, never shown to a client


@dataclass(frozen=True)
class ErrorCode:
    code: str
    status: int  # 0: the status of the HTTP error it stands for (``http_error`` only)
    type: str
    retry: Retry
    side: Side
    when: str


_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def _type_for(status: int) -> str:
    return _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")


def _e(code: str, status: int, retry: Retry, side: Side, when: str) -> ErrorCode:
    return ErrorCode(code, status, _type_for(status), retry, side, when)


_N, _A, _B = Retry.NEVER, Retry.AFTER, Retry.BACKOFF
_GW, _EN, _BOTH, _INT = Side.GATEWAY, Side.ENGINE, Side.BOTH, Side.INTERNAL

# fmt: off
_CODES = (
    _e("invalid_request", 400, _N, _BOTH,
       "a field is invalid; `param` names it as a JSON path, e.g. `steering.vectors[2].layers.7` "
       "(unknown hook, layer out of range, length ≠ hidden size, NaN/Inf, bad base64, shape/data "
       "mismatch, more than 256 terms, an unknown field); also vLLM's own 400s (e.g. "
       "`max_tokens: -1`, `tools` on an engine without tool parsing)"),
    _e("invalid_json", 400, _N, _BOTH,
       "the body is not JSON, not a JSON object, or nests arrays/objects more than 64 levels"),
    _e("invalid_conversation_id", 400, _N, _BOTH,
       "`conversation_id` is not 1–256 characters of `[A-Za-z0-9._:@-]`, or is `.` or `..`"),
    _e("invalid_vector_name", 400, _N, _BOTH, "a vector name is not 1–64 characters of "
       "`[A-Za-z0-9._-]`, or is `.` or `..`"),
    _e("invalid_tenant_id", 400, _N, _GW, "a tenant id is not 1–32 characters of `[a-z0-9-]`"),
    _e("invalid_gguf", 400, _N, _BOTH,
       "an `application/octet-stream` vector upload is not a readable GGUF control vector"),
    _e("unknown_vector", 400, _N, _BOTH,
       "`steering.vectors[].name` names a vector the caller does not have"),
    _e("latch_without_conversation_id", 400, _N, _BOTH,
       "`steering.latch: true` without a `conversation_id`"),
    _e("steering_too_large", 400, _N, _GW,
       "`steering` carries more inline (JSON array) numbers than one term or one request may "
       "(`STEERGATE_MAX_INLINE_FLOATS_PER_TERM` / `_PER_REQUEST`, default 32,768 / 65,536); "
       "`param` names the term: send it as `packed` or a named vector"),
    _e("unsupported_parameter", 400, _N, _GW,
       "a field the gateway cannot serve safely across tenants: `previous_response_id`, "
       "`background` on `/v1/responses` (use `conversation_id` and a latch instead)"),
    _e("capture_too_large", 400, _N, _BOTH,
       "`capture` names more sites than allowed, or can produce more float32 bytes than "
       "allowed per request (choices x sites x rows x hidden x 4; decided up front)"),
    _e("examples_too_large", 400, _N, _GW,
       "a `from-examples` body holds more examples per side (256), characters per example "
       "(8,000) or characters in all (400,000) than allowed; `param` names the side or example; "
       "or its activations (examples x layers x hidden size x 4 bytes) would pass "
       "`STEERGATE_EXAMPLES_MEMORY_BYTES`: `param` is `layers`"),
    _e("examples_indistinguishable", 400, _N, _GW,
       "a `from-examples` body whose `positive` and `negative` hold the same examples (in any "
       "order; decided before any work), or whose activations came back identical at a layer "
       "(`param` is `layers`; the message names the layer): their difference is zero and has "
       "no direction to steer along; nothing is stored"),
    _e("invalid_api_key", 401, _N, _BOTH, "missing, unknown, malformed or revoked key (on the "
       "engine: missing or wrong engine token); also `Authorization` sent more than once, "
       "whatever the copies hold"),
    _e("expired_api_key", 401, _N, _GW,
       "the key's `expires_at` has passed (refused on every replica within 1 s of it)"),
    _e("insufficient_scope", 403, _N, _GW,
       "the key's `scopes` do not include the route's scope (`inference`, `vectors`, "
       "`latches`, `usage`)"),
    _e("permission_denied", 403, _N, _GW,
       "a tenant key on an `/admin/*` route, `/metrics` or `/openapi.json`; a `viewer` admin "
       "key on anything but a GET"),
    _e("not_found", 404, _N, _BOTH, "no such route (`Invalid URL (METHOD /path)`; paths "
       "are exact: a trailing slash is not redirected), or a dashboard file that does not exist"),
    _e("model_not_found", 404, _N, _BOTH, "`model` (or `GET /v1/models/{id}`) names a model the "
       "engines do not serve"),
    _e("tenant_not_found", 404, _N, _GW, "no tenant with this id"),
    _e("key_not_found", 404, _N, _GW, "no key with this key id"),
    _e("vector_not_found", 404, _N, _BOTH, "the caller has no vector with this name"),
    _e("latch_not_found", 404, _N, _BOTH, "the caller has no latch for this conversation"),
    _e("method_not_allowed", 405, _N, _BOTH,
       "the route exists, the method does not; decided before authentication, as the route "
       "list is public (this document)"),
    _e("tenant_exists", 409, _N, _GW, "`POST /admin/tenants` with an id in use"),
    _e("tenant_changed", 409, _B, _GW,
       "`PATCH /admin/tenants/{id}` lost the race to other updates of the same tenant five "
       "times; nothing of this update was kept, retrying is safe"),
    _e("key_changed", 409, _B, _GW,
       "`POST /admin/keys/{key_id}/rotate` lost the race to other rotations or changes of "
       "the same key five times; nothing of this rotation was kept, retrying is safe"),
    _e("engine_overcommitted", 409, _N, _GW,
       "limits whose Σ latch quotas over all tenants would exceed the smallest engine's caps, "
       "without `allow_overcommit`"),
    _e("steering_state_changed", 409, _B, _GW,
       "the tenant's vectors or latch changed while the request ran (three cache fills did "
       "not settle it, or the latch Redis holds is no longer the one the request was "
       "admitted with); retrying is safe"),
    _e("vector_missing", 409, _N, _INT,
       "the engine's cache lacks a named vector the gateway expects (the gateway installs it "
       "from Redis and sends the turn again)"),
    _e("latch_missing", 409, _N, _INT,
       "the engine's cache lacks the conversation's latch (the gateway restores it and sends "
       "the turn again)"),
    _e("request_timeout", 408, _B, _GW,
       "the request body was not complete within `STEERGATE_BODY_TIMEOUT_S` (60 s) of its "
       "head; the connection closes. Nothing of the request ran"),
    _e("headers_too_large", 431, _N, _GW,
       "a request head with header fields past 64 KiB in all, or more than 128 of them; "
       "the connection closes. Nothing of the request ran"),
    _e("request_too_large", 413, _N, _BOTH,
       "body larger than `STEERGATE_MAX_BODY_BYTES` (gateway) or than vLLM accepts"),
    _e("unsupported_media_type", 415, _N, _EN,
       "vLLM's JSON routes called with another `Content-Type`"),
    _e("unprocessable_entity", 422, _N, _BOTH,
       "vLLM understood the request but cannot serve it (e.g. a prompt longer than the "
       "model's context)"),
    _e("rate_limit_exceeded", 429, _A, _GW,
       "requests/min or tokens/min; the message says which, `Retry-After` when it will pass"),
    _e("concurrency_limit_exceeded", 429, _B, _GW,
       "too many of the tenant's (or, with per-key `limits`, the key's) requests in flight"),
    _e("budget_exceeded", 429, _N, _GW,
       "the tenant's `limits.token_budget` for this day or month is spent; `Retry-After` says "
       "when the period rolls over (UTC)"),
    _e("latch_quota_exceeded", 429, _N, _GW,
       "a new latch over quota under `latch_policy: reject`, or one latch larger than the "
       "tenant's whole `latch_bytes` quota (whatever the policy); delete latches to make room"),
    _e("vector_quota_exceeded", 429, _N, _GW,
       "vector count or bytes over quota; delete vectors to make room"),
    _e("internal_error", 500, _N, _BOTH, "a bug; the log line with the request id says where"),
    _e("not_implemented", 501, _N, _BOTH, "the served model or engine lacks the feature"),
    _e("engine_unavailable", 502, _B, _GW,
       "no engine reachable, an engine refused the gateway's token, or a stream broke"),
    _e("store_unavailable", 503, _B, _GW, "Redis unreachable (answered within about 1 s; fail "
       "closed)"),
    _e("engine_overloaded", 503, _B, _BOTH, "vLLM's queue is full or a request failed "
       "transiently"),
    _e("engine_starting", 503, _B, _EN,
       "the engine's steering plugin is not initialised yet (engine-only: the gateway routes "
       "around an engine until it answers its info route)"),
    _e("gateway_busy", 503, _B, _GW,
       "`from-examples`: other tenants' jobs hold the gateway's activation memory "
       "(`STEERGATE_EXAMPLES_MEMORY_BYTES`, 2 GiB) now; nothing was charged, retrying is safe"),
    _e("engine_timeout", 504, _B, _GW,
       "the engine did not answer within `STEERGATE_ENGINE_READ_TIMEOUT_S`"),
    _e("http_error", 0, _N, _BOTH, "any other HTTP error, with the status it stands for"),
)
# fmt: on

#: Every code, by name.
REGISTRY: dict[str, ErrorCode] = {e.code: e for e in _CODES}

#: The code for an error that arrived without one of ours (vLLM's own errors, which
#: carry the status as an integer ``code``; Starlette's plain-text errors), by status.
_BY_STATUS: dict[int, str] = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
    422: "unprocessable_entity",
    500: "internal_error",
    501: "not_implemented",
    502: "engine_unavailable",
    503: "engine_overloaded",
    504: "engine_timeout",
}


def spec(code: str) -> ErrorCode:
    """The registry entry of ``code`` (``http_error`` for an unregistered one)."""
    return REGISTRY.get(code) or REGISTRY["http_error"]


def code_for_status(status: int, param: str | None = None) -> str:
    """Our code for a foreign error of ``status`` (``param`` as the sender named it)."""
    if status == 404 and param == "model":
        return "model_not_found"
    return _BY_STATUS.get(status, "http_error")


def retry_headers(code: str, retry_after_ms: int | None = None) -> dict[str, str]:
    """The headers that tell a client whether and when to retry (see module doc)."""
    policy = spec(code).retry
    when: dict[str, str] = {}
    if retry_after_ms is not None:
        ms = max(1, int(retry_after_ms))
        when = {"retry-after": str(max(1, math.ceil(ms / 1000))), "retry-after-ms": str(ms)}
    if policy is Retry.NEVER:
        # A refusal that lifts at a known time only (a token budget's next period)
        # still says when, for people and dashboards; clients must not retry before.
        return {"x-should-retry": "false", **when}
    if policy is Retry.AFTER and when:
        return {"x-should-retry": "true", **when}
    return {"x-should-retry": "true"}


class APIError(Exception):
    """An error that is safe to show the client as it is (no secrets, no scoped ids).

    ``APIError(code, message, param=..., headers=..., retry_after_ms=...)``: status
    and type come from :data:`REGISTRY`; ``status`` only for ``http_error``, the one
    code that stands for any status. :func:`render` turns it into what is sent.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        retry_after_ms: int | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.status: int = spec(code).status or status or 500
        self.headers = {**retry_headers(code, retry_after_ms), **(headers or {})}

    @property
    def type(self) -> str:
        entry = spec(self.code)
        return entry.type if entry.status else _type_for(self.status)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


@dataclass(frozen=True)
class Rendered:
    """An error as it is sent: its status, its headers (``content-type`` included) and
    its JSON body."""

    status: int
    headers: dict[str, str]
    body: bytes

    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        """The headers for an ASGI ``http.response.start``, ``content-length`` too."""
        out = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
        return [*out, (b"content-length", str(len(self.body)).encode())]


def render(exc: APIError) -> Rendered:
    """The one rendering of an :class:`APIError`: the error handlers of both apps, the
    raw-ASGI middlewares and a stream's ``data: {"error": ...}`` event all send this."""
    body = json.dumps(exc.body(), separators=(",", ":"), ensure_ascii=False).encode()
    return Rendered(exc.status, {"content-type": "application/json", **exc.headers}, body)


class InvalidField(APIError):
    """A 400 that names the offending request field (``param``)."""

    def __init__(self, param: str, message: str, code: str = "invalid_request") -> None:
        super().__init__(code, message, param=param)


#: The most characters of a client's key that an error quotes (in ``param`` and the
#: message): an unknown key is named, not echoed whole however long it is.
MAX_QUOTED_KEY = 64


def reject_unknown(obj: Iterable[Any], allowed: Container[str], parent: str | None = None) -> None:
    """A 400 naming the first key of ``obj`` that is not in ``allowed`` (under
    ``parent``, e.g. ``steering.vectors[0]``); every parser's unknown-field check."""
    for key in obj:
        if key not in allowed:
            name = str(key)
            if len(name) > MAX_QUOTED_KEY:
                name = name[:MAX_QUOTED_KEY] + "..."
            param = f"{parent}.{name}" if parent else name
            raise InvalidField(param, f"unknown field '{param}'")


def error_body(message: str, type_: str, param: str | None, code: str) -> dict[str, Any]:
    err: dict[str, Any] = {"message": message, "type": type_, "param": param, "code": code}
    rid = request_id.current()
    if rid:
        err["request_id"] = rid
    return {"error": err}


def normalize_error(status: int, doc: Any, text: str = "") -> dict[str, Any]:
    """Any error body (ours, vLLM's ``{"error": {..., "code": 400}}``, FastAPI's
    ``{"detail": ...}``, plain ``text``) as ours: a registered string code that fits
    ``status``, the registry's type, ``param`` kept, the current request id."""
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict):
        message, param, code = err.get("message"), err.get("param"), err.get("code")
    else:
        message, param, code = _detail(doc.get("detail") if isinstance(doc, dict) else None)
        message = message or text
    if not isinstance(message, str) or not message:
        message = f"HTTP {status}"
    param = param if isinstance(param, str) else None
    if not (isinstance(code, str) and code in REGISTRY and REGISTRY[code].status in (0, status)):
        code = code_for_status(status, param)
    entry = REGISTRY[code]
    body = error_body(message, entry.type if entry.status else _type_for(status), param, code)
    sent_id = err.get("request_id") if isinstance(err, dict) else None
    if isinstance(sent_id, str) and "request_id" not in body["error"]:
        body["error"]["request_id"] = sent_id
    return body


def _detail(detail: Any) -> tuple[str | None, str | None, None]:
    """FastAPI's ``{"detail": "..."}`` or ``{"detail": [{"loc", "msg"}, ...]}``."""
    if isinstance(detail, str):
        return detail, None, None
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):
        first = detail[0]
        loc = [str(p) for p in first.get("loc", ())[1:]]
        return f"Invalid request: {first.get('msg', 'bad input')}", ".".join(loc) or None, None
    return None, None, None
