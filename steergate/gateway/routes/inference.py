"""``POST /v1/chat/completions``, ``POST /v1/completions`` and ``POST /v1/responses``.

The request path, top to bottom: auth (``auth.get_tenant``) -> scoping
(``scoping.prescan``: ids, names, latch size) -> limits (one admit_request.lua call)
-> scoping again (``scoping.prepare_inference``: vector values, scoped ids) -> proxy
(``proxy.Turn``: the engine call, its cache filled from Redis on a miss) ->
accounting (``accounting.Settler``, queued). The engine's JSON is passed through
byte for byte unless the gateway must change it (scoped ids scrubbed, ``steering``
filled in, ``evicted_quota``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from fastapi.routing import APIRoute
from starlette.routing import request_response

from steergate.gateway.admission import request_shape
from steergate.gateway.admission.admitted import Admission
from steergate.gateway.admission.bodies import OFF_LOOP_BYTES, parse_body
from steergate.gateway.admission.metered import Admitted, admitted
from steergate.gateway.admission.request_scoping import (
    Head,
    check_latching,
    prepare_inference,
    prescan,
    scrub,
)
from steergate.gateway.admission.settlement import CLIENT_CLOSED
from steergate.gateway.admission.stream_meter import StreamMeter, prompt_estimate
from steergate.gateway.deps import get_services
from steergate.gateway.engines.proxy import Turn
from steergate.gateway.engines.upstream import (
    UpstreamBroken,
)
from steergate.gateway.tenancy.auth import caller_key, get_tenant
from steergate.gateway.tracing import span
from steergate.shared import engine_api
from steergate.shared.asgi import Receive
from steergate.shared.capture import answer_bytes, check_up_front, parse_capture
from steergate.shared.engine_api import LATCH_HEADER
from steergate.shared.errors import APIError, render
from steergate.shared.errors import spec as error_spec

log = logging.getLogger("steergate.gateway.inference")

T = TypeVar("T")


class PlainRoute(APIRoute):
    """Listed in the OpenAPI schema like any route, but served as a plain Starlette
    endpoint: FastAPI's per-request dependency solving and response validation cost
    more than the rest of the gateway's own work on this, the hot path. The endpoints
    take only the request and do auth themselves (the same ``get_tenant``)."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kw: Any) -> None:
        super().__init__(path, endpoint, **kw)
        self.app = request_response(endpoint)


router = APIRouter(tags=["inference"], route_class=PlainRoute)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await proxy_inference(request, "/v1/chat/completions")


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await proxy_inference(request, "/v1/completions")


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    """The Responses API: the same auth, scoping, limits, accounting and ``steering`` /
    ``conversation_id`` fields as chat. Conversation state lives in latches, not in
    stored responses (see :func:`request_shape.check_responses`)."""
    return await proxy_inference(request, engine_api.RESPONSES)


#: What vLLM validates of each inference route's body, checked first (request_shape.py).
SHAPE_CHECKS = {
    engine_api.RESPONSES: request_shape.check_responses,
    engine_api.CHAT_COMPLETIONS: request_shape.check_chat,
    engine_api.COMPLETIONS: request_shape.check_completion,
}


async def read_json_object(request: Request) -> dict[str, Any]:
    """A JSON body for `/tokenize` and `/detokenize` (inference and vector uploads go
    through `steergate/gateway/admission/bodies.py`). The thread does not free the loop while
    orjson runs; these bodies carry no steering."""
    raw = await request.body()
    if len(raw) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_body, raw)
    return parse_body(raw)


async def proxy_inference(request: Request, path: str) -> Response:
    tenant = await get_tenant(request)
    svc = get_services(request)
    shape = svc.engines.shape()
    raw = await request.body()
    is_responses = path == engine_api.RESPONSES
    check = SHAPE_CHECKS.get(path, request_shape.check_completion)
    # A large body is parsed, its shape checked and its steering validated in a worker
    # process, after this tenant's earlier large bodies
    # (steergate/gateway/admission/bodies.py): never on this event loop.
    parsed = None
    if len(raw) > OFF_LOOP_BYTES:
        parsed = await svc.bodies.parse(raw, tenant.id, shape, check)
    body = parsed.body if parsed else parse_body(raw)
    if is_responses:
        # vLLM's response store is one dict per engine process, shared by every tenant
        # and lost on restart: nothing is stored (the fields that need the store are
        # refused by request_shape.check_responses).
        body["store"] = False
    client_stream_options = "stream_options" in body
    # Ids validated in full and the inline budget checked; no vector data converted yet.
    if parsed is None:
        head = prescan(body, svc.bodies.budget)
        check(body)
    else:
        head = parsed.head
    if head.capture is not None and shape is not None:  # 400s before admission
        parse_capture(body["capture"], shape)
        check_up_front(
            head.capture, body, path == engine_api.COMPLETIONS, shape.hidden_size, head.tokens
        )
    steering = parsed.steering if parsed is not None and parsed.shape == shape else None
    steering = check_latching(body, head, shape, steering)  # its admission evicts latches
    admission = svc.limiter.admit(
        tenant,
        tokens=head.tokens,
        conversation_id=head.conversation_id,
        latch=head.latch,
        latch_bytes=head.latch_bytes(shape),
        latch_kind=head.latch_kind,
        vector_names=list(head.names),
        api_key=caller_key(request),
    )
    async with admitted(svc.settler, admission) as call:
        adm = call.admission
        _check_names(head, adm)
        prep = prepare_inference(
            body,
            head,
            tenant,
            shape,
            adm.vector_digests,
            steering,
            salt_secret=svc.tenants.salt_secret(tenant),
        )
        if is_responses and not client_stream_options:
            # The Responses API has no stream_options: its final event carries usage.
            body.pop("stream_options", None)
        if adm.evicted:  # the engines' copies are harmless (never bridged) but use memory
            svc.engines.forget_latches_soon(tenant.id, adm.evicted)
        turn = Turn(svc.engines, svc.redis, svc.scripts, adm, head, prep, body, path)
        on_capture = _capture_meter(request, tenant.id, head)
        # A stream's span ends once the engine's answer has started (headers relayed).
        with span("proxy", tenant_id=tenant.id, stream=head.stream):
            if head.stream:
                return await _stream(turn, call, on_capture, request.receive)
            return await _unary(turn, call, on_capture, request.receive)


def _capture_meter(request: Request, tenant_id: str, head: Head) -> Callable[[Any], None]:
    """Counts an answer's captured bytes for the tenant (``steergate_capture_bytes``)."""
    metrics = getattr(request.app.state, "metrics", None)

    def observe(capture: Any) -> None:
        if metrics is not None and head.capture is not None:
            metrics.observe_capture(tenant_id, answer_bytes(capture))

    return observe


def _check_names(head: Head, adm: Admission) -> None:
    """Named vectors the tenant does not have: 400, decided by admission's read."""
    if adm.unmetered:
        return
    for name in head.names:
        if not adm.vector_digests.get(name):
            raise head.unknown_vector(name)


def _latch_state(adm: Admission, engine_state: str | None) -> str:
    state = engine_state or "none"
    if adm.evicted and state in ("latched", "replaced"):
        return "evicted_quota"
    return state


def _total_tokens(doc: Any) -> int:
    return _usage(doc)[0]


def _usage(doc: Any) -> tuple[int, int]:
    """(total, prompt) tokens of an answer's ``usage``; -1 where unknown (the
    reservation is then charged)."""
    usage = doc.get("usage") if isinstance(doc, dict) else None
    if isinstance(usage, dict) and isinstance(usage.get("total_tokens"), int):
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        return int(usage["total_tokens"]), int(prompt) if isinstance(prompt, int) else -1
    return -1, -1


#: How long a unary answer may take before the gateway starts watching for its client's
#: disconnect (see ``unless_client_leaves``).
WATCH_AFTER_S = 0.05


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has disconnected (the body was read already, so the
    server has nothing else to deliver)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(work: Awaitable[T], receive: Receive) -> T | None:
    """``work``'s result, or None if the client disconnects first. Then ``work`` was
    cancelled and has ended: the engine client closed the engine connection, and vLLM
    aborts a request whose connection closed, so the engine stops generating an answer
    nobody will read. ``work`` runs in this task; the watcher is a task of its own,
    started once ``WATCH_AFTER_S`` has passed and cancelled as soon as the answer is in."""
    current = asyncio.current_task()
    assert current is not None
    left = False

    async def watch() -> None:
        nonlocal left
        await _disconnected(receive)
        left = True
        current.cancel()

    watcher: asyncio.Task[None] | None = None

    def arm() -> None:
        nonlocal watcher
        watcher = asyncio.ensure_future(watch())

    # Armed once the answer takes a while: a client that left before is seen at once
    # then (the server keeps reporting the disconnect). Answers within 50 ms (errors,
    # one-token answers) pay a timer instead of a task; for a generation that runs for
    # seconds the watcher's few microseconds are nothing.
    timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, arm)
    try:
        return await work
    except asyncio.CancelledError:
        if not left:
            raise  # cancelled from outside (the server stopping): not ours to swallow
        if hasattr(current, "uncancel"):  # Python 3.11+ counts cancellations
            current.uncancel()
        return None
    finally:
        timer.cancel()
        if watcher is not None:
            watcher.cancel()


async def _unary(
    turn: Turn, call: Admitted, on_capture: Callable[[Any], None], receive: Receive
) -> Response:
    adm, prep = turn.adm, turn.prep
    r = await unless_client_leaves(turn.send(), receive)
    if r is None:
        # Charged the reservation: what the engine did before it stopped is unknown (a
        # stream's client that leaves before the first byte is charged the same way).
        log.info("client disconnected before the answer; engine request cancelled")
        call.settle(CLIENT_CLOSED, -1)
        return Response(status_code=CLIENT_CLOSED)
    tenant_id = adm.tenant.id
    ok = 200 <= r.status < 300
    body = scrub(r.body, tenant_id, error=not ok)
    engine_state = turn.state_override or r.headers.get(LATCH_HEADER)
    # Whatever the status: the header says what the engine kept (on vLLM's refusal it
    # takes the turn's latch back and says "none", docs/latches.md).
    await turn.keep_latch(engine_state)
    state = _latch_state(adm, engine_state)
    # The engine's refusal generated nothing: refunded, as a refused stream is. An answer
    # without usage keeps its reservation (-1).
    tokens, prompt = (-1, -1) if ok else (0, 0)
    if ok:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            doc = None
        tokens, prompt = _usage(doc)
        if isinstance(doc, dict) and "capture" in doc:
            on_capture(doc["capture"])
        if isinstance(doc, dict):
            steering = doc.get("steering")
            if not isinstance(steering, dict) or steering.get("latch") != state:
                applied = (
                    steering.get("applied")
                    if isinstance(steering, dict)
                    else (prep.steering is not None or state in ("bridged", "restored"))
                )
                doc["steering"] = {"applied": bool(applied), "latch": state}
                body = orjson.dumps(doc)
    call.settle(r.status, tokens, engine_state, prep.steering is not None, prompt)
    headers = {**adm.headers, LATCH_HEADER: state}
    return Response(
        body,
        status_code=r.status,
        headers=headers,
        media_type=r.headers.get("content-type", "application/json"),
    )


class _RelayResponse(StreamingResponse):
    """A StreamingResponse that runs ``on_exit`` however it ends, even if the client
    left before the body iterator was ever started (whose own ``finally`` would then
    never run): that closes the engine stream and settles the request exactly once."""

    def __init__(self, *args: Any, on_exit: Callable[[], Awaitable[None]], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._on_exit = on_exit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_exit()


async def _stream(
    turn: Turn, call: Admitted, on_capture: Callable[[Any], None], receive: Receive
) -> Response:
    adm, prep = turn.adm, turn.prep
    opened = await unless_client_leaves(turn.open_stream(), receive)
    if opened is None:
        # Gone before the engine's first byte (a long prefill, a queue): the engine
        # request is cancelled and the slot freed now, as for a unary answer.
        log.info("client disconnected before the stream started; engine request cancelled")
        call.settle(CLIENT_CLOSED, -1)
        return Response(status_code=CLIENT_CLOSED)
    cm, up, content = opened
    tenant_id = adm.tenant.id
    if up.status != 200:
        try:
            data = await up.read()
        except UpstreamBroken as exc:
            raise APIError("engine_unavailable", "The inference engine is unavailable.") from exc
        finally:
            await cm.__aexit__(None, None, None)
        engine_state = turn.state_override or up.headers.get(LATCH_HEADER)
        await turn.keep_latch(engine_state)  # as for a unary refusal
        call.settle(up.status, 0, engine_state)
        return Response(
            scrub(data, tenant_id, error=True),
            status_code=up.status,
            headers={**adm.headers, LATCH_HEADER: _latch_state(adm, engine_state)},
            media_type=up.headers.get("content-type", "application/json"),
        )
    engine_state = turn.state_override or up.headers.get(LATCH_HEADER)
    # Recorded before the first event reaches the client: its next turn may come at once.
    await turn.keep_latch(engine_state)
    # What the relay has seen; settled once, by whichever of relay/on_exit ends last.
    seen: dict[str, Any] = {"status": 0, "done": False}
    # A stream cut short (client left, engine broke) has no final usage: it is charged
    # the prompt plus what was generated so far, not the reservation (stream_meter.py).
    meter = StreamMeter()

    async def finish() -> None:
        if seen["done"]:
            return
        seen["done"] = True
        await cm.__aexit__(None, None, None)
        # The engine's latch decision arrived with the headers, before any body, so it
        # holds even if the stream later broke or the client left. A client that left
        # is counted as 499, like one that left before the first byte: it was counted
        # in no response class at all (found from outside).
        tokens, prompt = meter.split(lambda: prompt_estimate(content))
        status = seen["status"] or CLIENT_CLOSED
        call.settle(status, tokens, engine_state, prep.steering is not None, prompt)

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for event in SseEvents.of(up.chunks()):
                out, failed = _relay_event(
                    event, prep.include_usage, meter, on_capture, tenant_id, prep.continuous_usage
                )
                if out is not None:
                    yield out
                if failed:
                    # vLLM's own mid-stream failure: its error event ends the stream
                    # (the [DONE] after it is not relayed), settled as what it says.
                    seen["status"] = failed
                    return
            seen["status"] = 200
        except UpstreamBroken:
            seen["status"] = 502
            err = APIError("engine_unavailable", "The inference engine failed mid-stream.")
            yield b"data: " + render(err).body + b"\n\n"
        finally:
            await finish()

    headers = {
        **adm.headers,
        LATCH_HEADER: _latch_state(adm, engine_state),
        "cache-control": "no-cache",
        "x-accel-buffering": "no",
    }
    call.hand_off()  # settled by ``finish``, once the relay ends or the client leaves
    return _RelayResponse(
        relay(), status_code=200, headers=headers, media_type="text/event-stream", on_exit=finish
    )


class SseEvents:
    """Splits an SSE byte stream into events (separated by a blank line). Linear in the
    bytes however an event is cut into chunks: a piece without a separator is kept
    as it is and joined once its event is complete (``buf += chunk`` and a search of
    the whole buffer per chunk made a 40 MB capture event cost 15 s of the loop)."""

    def __init__(self) -> None:
        self._pieces: list[bytes] = []

    @classmethod
    async def of(cls, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Each event of ``chunks``, then a final one the engine did not end, if any."""
        events = cls()
        async for chunk in chunks:
            for event in events.feed(chunk):
                yield event
        rest = events.rest()
        if rest.strip():
            yield rest

    def feed(self, chunk: bytes) -> list[bytes]:
        split_across = bool(self._pieces) and self._pieces[-1].endswith(b"\n")
        if b"\n\n" not in chunk and not (split_across and chunk.startswith(b"\n")):
            self._pieces.append(chunk)
            return []
        data = b"".join(self._pieces) + chunk if self._pieces else chunk
        *events, rest = data.split(b"\n\n")
        self._pieces = [rest] if rest else []
        return events

    def rest(self) -> bytes:
        """What followed the last separator (a final event the engine did not end)."""
        return b"".join(self._pieces)


def _error_status(doc: Any) -> int:
    """The status an engine's mid-stream ``{"error": …}`` event stands for (0: not one)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("error"), dict) or "choices" in doc:
        return 0
    code = doc["error"].get("code")
    if isinstance(code, int) and 400 <= code < 600:
        return code
    status = error_spec(code).status if isinstance(code, str) else 0
    return status if 400 <= status < 600 else 500


def _relay_event(
    event: bytes,
    client_wants_usage: bool,
    meter: StreamMeter,
    on_capture: Callable[[Any], None] | None,
    tenant_id: str,
    client_wants_continuous_usage: bool = False,
) -> tuple[bytes | None, int]:
    """One SSE event out (or None to drop it), and the status of an engine's error
    event (0 otherwise); what it reports goes to ``meter``. The usage the gateway asked
    for and the client did not (the final chunk, the count on every chunk) is removed."""
    event = scrub(event, tenant_id)  # one substring search unless the tenant's ids occur
    # Chat and completions events are one ``data:`` line; the Responses API's start
    # with an ``event:`` line.
    data_at = 0 if event.startswith(b"data: {") else event.find(b"\ndata: {") + 1
    if event.startswith(b"data: {") or data_at > 0:
        try:
            doc = orjson.loads(event[data_at + 6 :])
        except orjson.JSONDecodeError:
            doc = None
        failed = _error_status(doc)
        if failed:  # as an error body: no tenant's scoped ids, whoever's they are
            return scrub(event, tenant_id, error=True) + b"\n\n", failed
        meter.observe(doc)
        if on_capture is not None and isinstance(doc, dict):
            # chat/completions: a final chunk of its own; responses: response.completed
            inner = doc.get("response")
            capture = doc.get("capture")
            if capture is None and isinstance(inner, dict):
                capture = inner.get("capture")
            if capture is not None:
                on_capture(capture)
        if (
            not client_wants_usage
            and isinstance(doc, dict)
            and not doc.get("choices")
            and _total_tokens(doc) >= 0
        ):
            return None, 0  # the usage-only chunk we asked for ourselves
        if (
            not client_wants_continuous_usage
            and data_at == 0
            and isinstance(doc, dict)
            and doc.get("choices")
            and "usage" in doc
        ):
            del doc["usage"]  # vLLM leaves an unset field out (exclude_unset)
            return b"data: " + orjson.dumps(doc) + b"\n\n", 0
    return event + b"\n\n", 0
