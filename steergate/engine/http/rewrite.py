"""The steering rewrite in front of vLLM's completion routes (pure ASGI).

For ``POST /v1/chat/completions``, ``/v1/completions`` and ``/v1/responses``
(``engine_api.STEERED_PATHS``; the rewrite reads no field that differs between them:
``messages``, ``prompt`` and ``input`` all pass through) it consumes ``steering``
and ``conversation_id``, validates them against the served model, resolves the
turn (latch decided *before* forwarding, so the header is known even for streams),
and forwards an ordinary vLLM request carrying the resolved payload in
``vllm_xargs["steergate"]`` with a steering-specific ``cache_salt``. Responses get
``x-steering-latch`` always; non-stream JSON 200s also get a top-level ``steering``
object. Streams are forwarded message by message, never buffered.

Every other JSON POST only loses a client-supplied ``vllm_xargs["steergate"]``:
workers trust that key, so only this middleware may write it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from steergate.engine import capture_io
from steergate.engine.http import capture as capture_http
from steergate.engine.http import compare
from steergate.engine.http.exact import prompt_key, refuse_inexact
from steergate.engine.http.runtime import RuntimeRef, SteeringRuntime
from steergate.engine.payload import XARGS_KEY, encode_payload
from steergate.engine.resolve import Expect, Resolution, resolve_turn
from steergate.shared import engine_api
from steergate.shared.asgi import (
    ASGIApp,
    Message,
    RawHeaders,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    replace_header,
    replay,
    send_error,
)
from steergate.shared.engine_api import EXPECT_FIELD
from steergate.shared.errors import APIError, InvalidField
from steergate.shared.latch_spec import SpecError, decode_spec
from steergate.shared.scoping import is_engine_conversation_id, is_engine_vector_name
from steergate.shared.steering import ModelShape, parse_steering

LATCH_HEADER = engine_api.LATCH_HEADER.encode()

# vLLM's own cache_salt rules (vllm.entrypoints.generate.base.protocol).
MAX_CACHE_SALT = 128
_SALT_FORBIDDEN = frozenset("@/\\\x00")


class SteeringRewriteMiddleware:
    def __init__(self, app: ASGIApp, runtime: RuntimeRef) -> None:
        self.app = app
        self.runtime = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        path = _route_path(scope)
        if path in engine_api.STEERED_PATHS:
            await self._steered(scope, receive, send)
        elif _is_json(scope):
            await self._strip_only(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _steered(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        if body is None:
            return
        doc = _json_object(body)
        if doc is None:  # not a JSON object: vLLM answers it in its own words
            await self.app(scope, replay(body, receive), _with_latch(send, Resolution("none")))
            return
        path = _route_path(scope)
        plain: dict[str, Any] | None = None
        try:
            runtime = self.runtime.get()
            # steering.compare: the unsteered twin (steergate/engine/http/compare.py).
            if compare.wants_compare(doc):
                plain = compare.split(doc, path)
            # Validated before the rewrite, which may change a latch.
            call = capture_http.take(doc, path, runtime.shape, runtime.capture)
            resolution = rewrite(doc, runtime)
            if plain is not None:
                rewrite(plain, runtime)  # no steering, no conversation: strips xargs only
        except APIError as exc:
            await send_error(send, exc, [(LATCH_HEADER, b"none")])
            return
        if call is not None:
            call.apply(doc)
            send = capture_http.with_capture(send, call, path)
        new_body = json.dumps(doc, separators=(",", ":")).encode()
        try:
            if plain is not None:
                plain_body = json.dumps(plain, separators=(",", ":")).encode()
                await compare.serve(
                    self.app,
                    (_with_body_length(scope, new_body), replay(new_body, receive)),
                    (_with_body_length(scope, plain_body), replay(plain_body, receive)),
                    _with_latch(send, resolution),
                    compare.num_choices(doc),
                )
                return
            await self.app(
                _with_body_length(scope, new_body),
                replay(new_body, receive),
                _with_latch(send, resolution),
            )
        finally:
            if call is not None:
                call.discard()  # now and again later: a worker may write one step more

    async def _strip_only(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        if body is None:
            return
        doc = _json_object(body)
        if doc is not None and _strip_xargs(doc):
            body = json.dumps(doc, separators=(",", ":")).encode()
            scope = _with_body_length(scope, body)
        await self.app(scope, replay(body, receive), send)


def rewrite(doc: dict[str, Any], runtime: SteeringRuntime) -> Resolution:
    """Validate, resolve and rewrite ``doc`` in place. Raises before any latch change."""
    conversation_id = _conversation_id(doc.pop("conversation_id", None))
    expect = parse_expect(doc.pop(EXPECT_FIELD, None), runtime.shape)
    raw = doc.pop("steering", None)  # null means "not given", as for OpenAI's optional fields
    if raw is not None and not runtime.served.steered:
        # The workers have no tables: the steering would be silently ignored.
        raise APIError(
            "not_implemented",
            f"this engine serves {runtime.served.architecture} unsteered "
            "(STEERGATE_STEERING=off): 'steering' is not available",
            param="steering",
        )
    steering = parse_steering(raw, runtime.shape) if raw is not None else None
    xargs = doc.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        raise InvalidField("vllm_xargs", "'vllm_xargs' must be an object")
    _strip_xargs(doc)
    if steering is not None and steering.terms:  # before a latch is stored
        refuse_inexact(doc, steering.phase)
    resolution = resolve_turn(
        steering, conversation_id, runtime.registry, runtime.controller, expect,
        runtime.max_clamps, runtime.bound,
    )
    if resolution.applied:
        refuse_inexact(doc, resolution.phase)  # bridged/restored turns
        payload, digest = encode_payload(resolution.phase, resolution.sites, resolution.clamps)
        doc["vllm_xargs"] = {**(doc.get("vllm_xargs") or {}), XARGS_KEY: payload}
        doc["cache_salt"] = salted(doc.get("cache_salt"), digest, resolution.phase, doc)
    return resolution


def parse_expect(value: Any, shape: ModelShape) -> Expect | None:
    """The gateway's ``steergate_expect`` (see ``shared.engine_api``), validated in full."""
    if value is None:
        return None
    param = EXPECT_FIELD
    if not isinstance(value, dict) or set(value) - {"vectors", "latch", "restore"}:
        raise InvalidField(param, f"'{param}' must be an object of vectors, latch, restore")
    vectors = value.get("vectors")
    vectors = {} if vectors is None else vectors  # [] or 0 is not "no vectors"
    if not isinstance(vectors, dict) or not all(
        is_engine_vector_name(k) and isinstance(v, str) for k, v in vectors.items()
    ):
        raise InvalidField(f"{param}.vectors", f"'{param}.vectors' must map names to digests")
    latch = value.get("latch")
    if latch is not None and not isinstance(latch, str):
        raise InvalidField(f"{param}.latch", f"'{param}.latch' must be a digest string")
    restore = None
    if value.get("restore") is not None:
        try:
            restore = decode_spec(value["restore"])
        except SpecError as exc:
            raise InvalidField(
                f"{param}.restore", f"'{param}.restore' is not a latch spec: {exc}"
            ) from exc
        clamp_sites = [(site, vec) for c in restore.clamps for site, vec in c.sites.items()]
        for (_hook, layer), vec in [*restore.sites.items(), *clamp_sites]:
            if not 0 <= layer < shape.num_layers or vec.shape != (shape.hidden_size,):
                raise InvalidField(
                    f"{param}.restore", f"'{param}.restore' does not fit the served model"
                )
        # The restore must be the latch the system of record names (its digest), or the
        # engine would cache a latch that every later turn's expectation contradicts.
        if latch is not None and restore.digest != latch:
            raise InvalidField(
                f"{param}.restore",
                f"'{param}.restore' is not the latch '{param}.latch' names (digest differs)",
            )
    return Expect(vectors=vectors, latch=latch, restore=restore)


def salted(
    client_salt: Any, digest: str, phase: str = "all", request: dict[str, Any] | None = None
) -> Any:
    """``client|sg:digest`` so that differently steered requests never share prefix-cache
    blocks. For phase ``prefill``/``decode`` the digest also covers the request's prompt
    (``engine.http.exact.prompt_key``): a position's KV then depends on whether it was
    prompt or generated, and vLLM caches generated tokens' blocks too. If the salt
    would pass vLLM's 128-character limit, a hash of it is used instead (still unique
    per client salt and steering). An invalid client salt is left as it is, for vLLM
    to reject in its own words."""
    if client_salt is None:
        client_salt = ""
    elif not _valid_salt(client_salt):
        return client_salt
    if phase != "all":
        if request is None:
            raise ValueError(f"phase {phase!r} needs the request to key the salt on its prompt")
        digest = hashlib.sha256(f"{digest}|prompt:{prompt_key(request)}".encode()).hexdigest()
    salt = f"{client_salt}|sg:{digest}"
    if len(salt) > MAX_CACHE_SALT:
        salt = "sg:" + hashlib.sha256(salt.encode()).hexdigest()
    return salt


def _valid_salt(value: Any) -> bool:
    return (
        isinstance(value, str)
        and 0 < len(value) <= MAX_CACHE_SALT
        and not (_SALT_FORBIDDEN & set(value))
    )


def _conversation_id(value: Any) -> str | None:
    if value is None:
        return None
    if not is_engine_conversation_id(value):
        raise InvalidField(
            "conversation_id",
            "'conversation_id' must be 1-256 characters of [A-Za-z0-9._:@-], not '.' or '..'",
            code="invalid_conversation_id",
        )
    return value


def _strip_xargs(doc: dict[str, Any]) -> bool:
    """Drop the keys workers trust (steering and capture payloads) from a client's
    ``vllm_xargs``, and from ``sampling_params.extra_args`` (the token-in, token-out
    route's ``/inference/v1/generate`` takes SamplingParams as they are): only this
    middleware writes them."""
    stripped = False
    params = doc.get("sampling_params")
    extra = params.get("extra_args") if isinstance(params, dict) else None
    for xargs in (doc.get("vllm_xargs"), extra):
        if isinstance(xargs, dict):
            for key in (XARGS_KEY, capture_io.XARGS_KEY):
                if key in xargs:
                    del xargs[key]
                    stripped = True
    return stripped


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def _route_path(scope: Scope) -> str:
    path: str = scope.get("path", "")
    root = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _is_json(scope: Scope) -> bool:
    ctype = header(scope.get("headers", []), b"content-type") or b""
    return ctype.split(b";")[0].strip().lower() == b"application/json"


def _with_body_length(scope: Scope, body: bytes) -> Scope:
    headers = replace_header(list(scope.get("headers", [])), b"transfer-encoding", None)
    return {**scope, "headers": replace_header(headers, b"content-length", str(len(body)).encode())}


def _with_latch(send: Send, resolution: Resolution) -> Send:
    """Adds the latch header to every response; for a non-stream JSON 200 also the
    top-level ``steering`` object (which needs the whole body, so only then is the
    body held back -- event streams go through message by message)."""
    state = resolution.state.encode()
    held_start: Message | None = None
    chunks: list[bytes] = []

    async def _send(message: Message) -> None:
        nonlocal held_start, state
        if message["type"] == "http.response.start":
            if message["status"] >= 400 and resolution.undo is not None:
                # vLLM refused the turn (a bad field it checks itself): the latch it
                # stored is taken back, and the header says the turn changed nothing.
                resolution.undo()
                state = b"none"
            headers: RawHeaders = replace_header(
                list(message.get("headers", [])), LATCH_HEADER, state
            )
            message = {**message, "headers": headers}
            if message["status"] == 200 and _is_json({"headers": headers}):
                held_start = message
                return
            await send(message)
        elif message["type"] == "http.response.body" and held_start is not None:
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            start, body = held_start, _inject(b"".join(chunks), resolution)
            held_start = None
            start["headers"] = replace_header(
                start["headers"], b"content-length", str(len(body)).encode()
            )
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": False})
        else:
            await send(message)

    return _send


def _inject(body: bytes, resolution: Resolution) -> bytes:
    doc = _json_object(body)
    if doc is None:
        return body
    doc["steering"] = {"applied": resolution.applied, "latch": resolution.state}
    return json.dumps(doc, separators=(",", ":")).encode()
