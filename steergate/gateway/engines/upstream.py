"""The upstream boundary: the only module that talks HTTP to the engines, and the
only one that sees the HTTP client's exceptions. Everything leaves it as our own
types: ``UpstreamResponse``, ``UpstreamStream`` (chunks; ``UpstreamBroken``
mid-stream) or ``APIError`` (502 engine_unavailable, 504 engine_timeout).

The client is ``steergate/gateway/engines/http1.py``, a small pooled HTTP/1.1 client on asyncio and
``httptools`` (private to this module): httpx's pure-Python request machinery was
the largest part of the gateway's added latency.

Test seam: ``EnginePool(..., transport=...)`` (and ``create_app(engine_transport=...)``)
takes an ``httpx.AsyncBaseTransport``, e.g. ``httpx.ASGITransport(app=engine_app)``, and
sends every engine call through it in-process instead of over sockets. Production never
passes one: the default (None) keeps the http1 client, untouched.

Routing: a conversation always goes to the same engine (rendezvous hashing on its
scoped id, so adding/removing an engine moves only its share); other requests go to
the engine with the fewest requests in flight. Engine info (shape, caps, epoch) is
polled in the background; an epoch change means the engine restarted and lost its
latches, which triggers reconciliation.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode, urlsplit

import httpx
import orjson

from steergate.gateway import tracing
from steergate.gateway.engines import http1
from steergate.shared import engine_api, request_id
from steergate.shared.errors import APIError
from steergate.shared.settings import display_url
from steergate.shared.steering import ModelShape

log = logging.getLogger("steergate.gateway.upstream")

JSON = "application/json"


class UpstreamBroken(Exception):
    """The engine connection failed after the response had started."""


@dataclass
class Engine:
    #: As configured, credentials included: only requests use it.
    url: str = field(repr=False)
    healthy: bool = True
    inflight: int = 0
    info: dict[str, Any] | None = None
    #: Its cache may disagree with Redis (it missed a write, restarted, or was away):
    #: routed around while a clean engine is up, until ``engine_sync`` clears it.
    dirty: bool = True
    #: ``scheme://host:port`` and the path prefix of ``url`` (engines may sit under one).
    origin: str = field(init=False, repr=False)
    base_path: str = field(init=False, repr=False)
    #: ``url`` without its credentials (:func:`display_url`): the one to log or show.
    shown: str = field(init=False)

    def __post_init__(self) -> None:
        self.shown = display_url(self.url)
        parts = urlsplit(self.url)
        self.origin = f"{parts.scheme}://{parts.netloc}"
        self.base_path = parts.path.rstrip("/")

    @property
    def epoch(self) -> Any:
        return (self.info or {}).get("epoch")


@dataclass
class UpstreamResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


@dataclass
class UpstreamStream:
    status: int
    headers: dict[str, str]
    _response: http1.Response | _TransportResponse = field(repr=False)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as the engine sends it (de-chunked), never buffered here."""
        try:
            async for chunk in self._response.iter_chunks():
                yield chunk
        except http1.HTTPError as exc:
            raise UpstreamBroken(type(exc).__name__) from exc

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except http1.HTTPError as exc:
            raise UpstreamBroken(type(exc).__name__) from exc


class EngineUnreachable(APIError):
    """502 before anything was sent (the connection could not be made): the caller may
    send the same request to another engine."""


def _unavailable(engine: Engine, exc: Exception) -> APIError:
    if isinstance(exc, http1.ReadTimeout):
        return APIError("engine_timeout", "The inference engine timed out.")
    if isinstance(exc, http1.InvalidRequest):
        # Our bug, not the engine's: never mark it down for it, never show the target.
        log.error("refused to send an ill-formed request to %s", engine.shown)
        return APIError("internal_error", "Internal error.")
    if isinstance(exc, http1.PoolExhausted):
        # Busy, not down: every connection to it is in use and none freed up in time.
        return APIError("engine_overloaded", "The inference engine is busy; retry shortly.")
    if engine.healthy:
        log.warning("engine %s unavailable (%s)", engine.shown, type(exc).__name__)
    engine.healthy = False
    if isinstance(exc, http1.ConnectError):
        return EngineUnreachable("engine_unavailable", "The inference engine is unavailable.")
    return APIError("engine_unavailable", "The inference engine is unavailable.")


SyncCallback = Callable[[Engine], Awaitable[None]]


class _TransportResponse:
    """An httpx response in the shape of ``http1.Response`` (status, headers, read,
    iter_chunks, aclose), with httpx errors raised as ``http1`` ones."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code
        self.headers = {k.lower(): v for k, v in response.headers.items()}

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            raise http1.ProtocolError(str(exc)) from exc

    async def read(self) -> bytes:
        try:
            return await self._response.aread()
        except httpx.HTTPError as exc:
            raise http1.ProtocolError(str(exc)) from exc

    async def aclose(self) -> None:
        await self._response.aclose()


class _TransportClient:
    """``http1.Client.send`` over an injected ``httpx.AsyncBaseTransport`` (the test
    seam; see the module docstring). Never used unless a transport is passed."""

    def __init__(
        self, transport: httpx.AsyncBaseTransport, headers: dict[str, str], read_timeout_s: float
    ) -> None:
        # identity: the bytes are relayed as the engine sent them, as over http1.
        self._client = httpx.AsyncClient(transport=transport, headers=headers)
        self.read_timeout_s = read_timeout_s

    async def send(
        self,
        method: str,
        origin: str,
        target: str,
        *,
        content: bytes | None = None,
        content_type: str | None = None,
        read_timeout_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> _TransportResponse:
        http1.check_target(method, target)
        extra = dict(headers or {})
        if content_type is not None:
            extra["content-type"] = content_type
        timeout = self.read_timeout_s if read_timeout_s is None else read_timeout_s
        request = self._client.build_request(
            method, origin + target, content=content, headers=extra, timeout=timeout
        )
        try:
            response = await self._client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise http1.ReadTimeout(str(exc)) from exc
        except httpx.HTTPError as exc:
            raise http1.ConnectError(str(exc)) from exc
        return _TransportResponse(response)

    async def aclose(self) -> None:
        await self._client.aclose()


class EnginePool:
    """The engines behind this gateway and the one HTTP client that talks to them."""

    def __init__(
        self,
        urls: list[str],
        token: str,
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 600.0,
        max_connections: int = http1.MAX_CONNECTIONS,  # per engine; more wait their turn
        transport: httpx.AsyncBaseTransport | None = None,  # tests only: in-process engines
    ) -> None:
        self.engines = [Engine(u) for u in urls]
        # identity: no Accept-Encoding means any encoding is acceptable (RFC 9110), and
        # a compressing proxy in front of an engine then sent gzip that was relayed as
        # JSON or SSE, unreadable for the client and for metering.
        headers = {"authorization": f"Bearer {token}", "accept-encoding": "identity"}
        self._client: http1.Client | _TransportClient = (
            http1.Client(
                headers=headers,
                connect_timeout_s=connect_timeout_s,
                read_timeout_s=read_timeout_s,
                max_connections=max_connections,
            )
            if transport is None
            else _TransportClient(transport, headers, read_timeout_s)
        )
        self._rr = 0
        #: Called for a healthy engine that is dirty (restarted, back from an outage or
        #: missed a write) after each poll; set by the lifespan to ``EngineSync.sync``.
        self.on_dirty: SyncCallback | None = None

    async def aclose(self) -> None:
        await self._client.aclose()

    # -- routing -----------------------------------------------------------------

    def pick(self, affinity: str | None = None) -> Engine:
        candidates = (
            [e for e in self.engines if e.healthy and not e.dirty]
            or [e for e in self.engines if e.healthy]
            or self.engines
        )
        if len(candidates) == 1:
            return candidates[0]
        if affinity:
            return max(
                candidates,
                key=lambda e: hashlib.blake2b(
                    f"{e.url}\0{affinity}".encode(), digest_size=8
                ).digest(),
            )
        self._rr += 1
        return min(
            candidates,
            key=lambda e: (e.inflight, (self.engines.index(e) + self._rr) % len(self.engines)),
        )

    # -- calls -------------------------------------------------------------------

    async def request(
        self,
        method: str,
        path: str,
        *,
        engine: Engine | None = None,
        json: Any = None,
        content: bytes | None = None,
        params: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> UpstreamResponse:
        engine = engine or self.pick()
        if json is not None:
            content = orjson.dumps(json)
        target = engine.base_path + path + (f"?{urlencode(params)}" if params else "")
        engine.inflight += 1
        try:
            r = await self._client.send(
                method,
                engine.origin,
                target,
                content=content,
                content_type=JSON if content is not None else None,
                read_timeout_s=timeout_s,
                headers=tracing.inject_traceparent(request_id.outgoing_headers()),
            )
            try:
                body = await r.read()
            finally:
                await r.aclose()
        except http1.HTTPError as exc:
            raise _unavailable(engine, exc) from exc
        finally:
            engine.inflight -= 1
        _check_token(r.status)
        return UpstreamResponse(r.status, r.headers, body)

    @contextlib.asynccontextmanager
    async def stream(
        self, path: str, content: bytes, *, engine: Engine
    ) -> AsyncIterator[UpstreamStream]:
        """POST ``content`` and expose the response as it arrives (never buffered)."""
        engine.inflight += 1
        try:
            try:
                r = await self._client.send(
                    "POST",
                    engine.origin,
                    engine.base_path + path,
                    content=content,
                    content_type=JSON,
                    headers=tracing.inject_traceparent(request_id.outgoing_headers()),
                )
            except http1.HTTPError as exc:
                raise _unavailable(engine, exc) from exc
            try:
                _check_token(r.status)
                yield UpstreamStream(r.status, r.headers, r)
            finally:
                await r.aclose()
        finally:
            engine.inflight -= 1

    # -- engine info -------------------------------------------------------------

    def shape(self) -> ModelShape | None:
        for e in self.engines:
            if e.info and "hidden_size" in e.info and "num_layers" in e.info:
                return ModelShape(int(e.info["hidden_size"]), int(e.info["num_layers"]))
        return None

    def served(self) -> dict[str, Any]:
        """The served architecture and supported hooks, as the engines report them
        (``architecture``, ``layer_convention``, ``hooks``); empty until one did."""
        for e in self.engines:
            if e.info and "architecture" in e.info and isinstance(e.info.get("hooks"), list):
                return {k: e.info.get(k) for k in ("architecture", "layer_convention", "hooks")}
        return {}

    def caps(self) -> tuple[int, int] | None:
        """The smallest latch caps over engines that reported them."""
        known = [e.info for e in self.engines if e.info and "max_latched_conversations" in e.info]
        if not known:
            return None
        return (
            min(int(i["max_latched_conversations"]) for i in known),
            min(int(i["max_latched_bytes"]) for i in known),
        )

    async def refresh(self) -> None:
        """Fetch every engine's info; an engine that restarted (new epoch) or came back
        from an outage is marked dirty; then ``on_dirty`` syncs each dirty healthy one."""

        async def one(e: Engine) -> None:
            try:
                r = await asyncio.wait_for(
                    self.request("GET", engine_api.INFO, engine=e, timeout_s=2.0), 2.0
                )
                info = r.json() if r.status == 200 else None
            except (APIError, asyncio.TimeoutError, ValueError):
                info = None
            if not isinstance(info, dict):
                if e.healthy:
                    log.warning("engine %s failed its info poll", e.shown)
                e.healthy = False
                return
            if e.info is not None and info.get("epoch") != e.epoch:
                log.info("engine %s restarted (new epoch): its cache is empty", e.shown)
                e.dirty = True
            if not e.healthy:
                e.dirty = True  # it may have missed writes while away
            e.info, e.healthy = info, True

        await asyncio.gather(*(one(e) for e in self.engines))
        if self.on_dirty is not None:
            for e in self.engines:
                if e.healthy and e.dirty:
                    await self.on_dirty(e)


def _check_token(status: int) -> None:
    if status in (401, 403):
        # Never relay as the client's own auth failure: it is our configuration.
        raise APIError("engine_unavailable", "The inference engine refused the gateway.")
