"""A small pooled HTTP/1.1 client on asyncio protocols and the ``httptools`` parser.

Private to ``steergate/gateway/engines/upstream.py`` (nothing else imports it): the engine API is a
handful of JSON routes plus SSE, so this does only what that needs — keep-alive
connection pools per origin with a cap on open connections, ``Content-Length``
request bodies, responses with a length, chunked or close-delimited body, delivered
whole or chunk by chunk with back-pressure, and connect / read timeouts. It exists
because httpx costs several hundred microseconds of pure Python per request, which
was most of the gateway's added latency (see docs/gateway.md, Performance).

Errors: :class:`ConnectError` (could not connect, incl. connect timeout;
:class:`PoolExhausted` when every connection the cap allows stayed busy that long),
:class:`ReadTimeout` (no bytes for ``read_timeout_s``), :class:`ProtocolError`
(the connection broke or the answer was not HTTP), :class:`InvalidRequest` (refused
before any connection was used: a request target or header that would not be one
well-formed HTTP/1.1 request). All are :class:`HTTPError`.

Resending: a request is sent again (once, on a new connection) only when that cannot
make the engine act twice: it never left (the pooled connection was already closing,
or the write itself failed), or it is idempotent and a kept-alive connection broke
before any byte of an answer came back. A POST the engine may have read is never
resent: the caller gets :class:`ProtocolError`. Tests: tests/gateway/engines/test_http1.py.
"""

from __future__ import annotations

import asyncio
import collections
import re
import ssl
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httptools

#: Pause reading from the engine when this much of a streamed body is unconsumed.
HIGH_WATER = 256 * 1024
#: Idle keep-alive connections kept per origin (more are closed on release).
MAX_IDLE = 64
#: An idle connection older than this is closed instead of reused. It must stay below
#: the engine's keep-alive timeout (uvicorn's default, vLLM's
#: ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, is 5 s; ``steergate engine`` sets 30 s): a POST
#: written just as the engine closes an idle connection may have been read, so it cannot
#: be resent, and the client would get a 502 for a request the engine never served.
IDLE_TTL_S = 4.0
#: Open connections (connecting, in use or idle) per origin, unless the Client is told
#: otherwise; a request beyond it waits (FIFO) up to the connect timeout.
MAX_CONNECTIONS = 256
#: Methods whose repetition has the effect of one (RFC 9110 9.2.2); the engine's PUT
#: and DELETE of vectors and latches are idempotent by design.
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})


class HTTPError(Exception):
    pass


class ConnectError(HTTPError):
    pass


class PoolExhausted(ConnectError):
    """Every connection the per-origin cap allows stayed busy for the connect timeout."""


class ReadTimeout(HTTPError):
    pass


class ProtocolError(HTTPError):
    pass


class InvalidRequest(HTTPError):
    """Refused before sending: the request line or a header would not be what the
    caller meant (a CR/LF in it would end the line early and let the rest be read
    as more head or another request). A caller bug, never the engine's fault."""


class InvalidRequestTarget(InvalidRequest):
    pass


class InvalidHeader(InvalidRequest):
    pass


#: A request target is visible ASCII only (RFC 9112 3.2): no space, control
#: character, DEL or non-ASCII byte. Callers percent-encode anything else.
_TARGET = re.compile(r"[\x21-\x7e]+")
_METHOD = re.compile(r"[A-Z]+")
#: Header names are tokens; values may hold anything but CR, LF and NUL.
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEADER_BAD = re.compile(r"[\r\n\x00]")


def check_target(method: str, target: str) -> None:
    """Raise :class:`InvalidRequestTarget` unless ``method target`` is a safe request line."""
    if not _METHOD.fullmatch(method) or not _TARGET.fullmatch(target) or target[0] != "/":
        raise InvalidRequestTarget(
            "refused to send a request whose method or target holds a space, control, "
            "DEL or non-ASCII character"  # never the target itself: it may hold scoped ids
        )


def check_header(name: str, value: str) -> None:
    if not _HEADER_NAME.fullmatch(name) or _HEADER_BAD.search(value) or not value.isascii():
        raise InvalidHeader(f"refused to send header {name[:40]!r}: CR, LF, NUL or non-ASCII")


class _Conn(asyncio.Protocol):
    """One connection; one request/response in flight at a time."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.parser = httptools.HttpResponseParser(self)
        self.loop = pool.loop
        self.reused = False
        #: loop.time() when it last went idle (see IDLE_TTL_S).
        self.idle_since = 0.0
        #: Counted against the pool's cap until it closes (set once connected).
        self.slot = False
        self.paused = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done: asyncio.Future[None] = self.loop.create_future()
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.complete = False
        self.error: HTTPError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.paused = False
        self.got_bytes = False
        #: Taken from the head: httptools forgets it once the message is complete.
        self.keep_alive = False
        #: Some of the request may have reached the engine (the write did not fail).
        self.sent = False

    def usable(self) -> bool:
        """Open, and not known to be closing (an EOF from the engine closes it)."""
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    # -- asyncio.Protocol --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ProtocolError(f"bad response: {type(exc).__name__}"))
            self._close()

    def eof_received(self) -> bool | None:
        # Close the transport: connection_lost then ends a close-delimited body (or
        # reports a break). Feeding b"" here would not: httptools only emits an empty body.
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        by_us = self.closed
        self.closed = True
        self._free_slot()
        self.pool.forget(self)
        if self.complete:
            return
        h = self.headers
        if (
            exc is None  # the engine's EOF; never a reset, nor our own close mid-body
            and not by_us
            and self.head_done.done()
            and self.error is None
            and "content-length" not in h
            and "chunked" not in h.get("transfer-encoding", "")
        ):
            self.complete = True  # a close-delimited body ends here
            self._wake()
            return
        self._fail(ProtocolError("engine connection closed"))

    def pause_writing(self) -> None:  # bodies are small; the kernel buffers them
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks -----------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:
            # More bytes after the answer (before we asked again): not HTTP we can trust;
            # the answer already read stays intact, the connection is not reused.
            raise ProtocolError("bytes after the response")

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        val = value.decode("latin-1")
        prev = self.headers.get(key)
        self.headers[key] = val if prev is None else f"{prev}, {val}"

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if not self.head_done.done():
            self.head_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # -- helpers -----------------------------------------------------------------

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, err: HTTPError) -> None:
        if self.error is None:
            self.error = err
        if not self.head_done.done():
            self.head_done.set_exception(err)
            self.head_done.exception()  # mark retrieved: nobody may be waiting
        self._wake()

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        self._free_slot()  # now, not at connection_lost: a waiter may use it at once

    def _free_slot(self) -> None:
        if self.slot:
            self.slot = False
            self.pool.slot_freed()

    async def _wait(self, fut: asyncio.Future[Any], timeout_s: float) -> None:
        handle = self.loop.call_later(timeout_s, _expire, fut)
        try:
            await fut
        finally:
            handle.cancel()

    # -- used by Response ----------------------------------------------------------

    async def next_chunk(self, timeout_s: float) -> bytes | None:
        """The next piece of body, or None at its end."""
        while True:
            if self.chunks:
                chunk = self.chunks.popleft()
                self.buffered -= len(chunk)
                if self.paused and self.buffered <= HIGH_WATER // 4 and self.transport:
                    self.paused = False
                    self.transport.resume_reading()
                return chunk
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            self.waiter = self.loop.create_future()
            try:
                await self._wait(self.waiter, timeout_s)
            except asyncio.TimeoutError:
                raise ReadTimeout("engine read timed out") from None
            finally:
                self.waiter = None


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError())


class Response:
    """A response whose head has arrived; read the body with :meth:`read` or
    :meth:`iter_chunks`, then :meth:`aclose` (always; it returns the connection)."""

    def __init__(self, conn: _Conn, read_timeout_s: float) -> None:
        self._conn = conn
        self._timeout = read_timeout_s
        self.status = conn.status
        self.headers = conn.headers
        self._released = False

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        while True:
            chunk = await self._conn.next_chunk(self._timeout)
            if chunk is None:
                return
            yield chunk

    async def read(self) -> bytes:
        parts: list[bytes] = []
        while True:
            chunk = await self._conn.next_chunk(self._timeout)
            if chunk is None:
                return b"".join(parts)
            parts.append(chunk)

    async def aclose(self) -> None:
        if self._released:
            return
        self._released = True
        conn = self._conn
        reusable = conn.complete and conn.error is None and conn.keep_alive and conn.usable()
        if reusable:
            conn.pool.release(conn)
        else:
            conn._close()


class _Pool:
    """Connections to one origin: at most ``max_connections`` open, idle keep-alive
    ones most recently used first, and the requests waiting for one, first come first
    served (a released connection or a freed slot goes to the longest waiter)."""

    def __init__(self, origin: str, ssl_ctx: ssl.SSLContext | None, max_connections: int) -> None:
        parts = urlsplit(origin)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl_ctx if parts.scheme == "https" else None
        default = (parts.scheme == "https" and self.port == 443) or self.port == 80
        self.host_header = self.host if default else f"{self.host}:{self.port}"
        self.idle: list[_Conn] = []
        self.max_connections = max_connections
        #: Connections counted against the cap: connecting, in use or idle.
        self.open = 0
        #: Each gets a connection handed over, or None: a slot is reserved, connect.
        self.waiters: collections.deque[asyncio.Future[_Conn | None]] = collections.deque()
        self.loop = asyncio.get_running_loop()

    async def acquire(self, connect_timeout_s: float, *, fresh: bool = False) -> _Conn:
        """A connection for one exchange; ``fresh``: never one that sat idle."""
        if not self.waiters:
            if not fresh:
                stale = self.loop.time() - IDLE_TTL_S
                while self.idle:
                    conn = self.idle.pop()
                    if conn.usable() and conn.idle_since > stale:
                        conn._reset()
                        conn.reused = True
                        return conn
                    conn._close()
            elif self.open >= self.max_connections and self.idle:
                self.idle.pop(0)._close()  # the oldest idle one makes room for the retry
        if self.open < self.max_connections and not self.waiters:
            self.open += 1
        else:
            conn_or_slot = await self._wait_turn(connect_timeout_s)
            if conn_or_slot is not None:
                return conn_or_slot
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: _Conn(self),
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None,
                ),
                connect_timeout_s,
            )
        except (OSError, asyncio.TimeoutError) as exc:
            self.slot_freed()
            raise ConnectError(type(exc).__name__) from exc
        except BaseException:
            self.slot_freed()
            raise
        if conn.closed:  # reset before we could use it
            self.slot_freed()
            raise ConnectError("engine connection closed")
        conn.slot = True
        return conn

    async def _wait_turn(self, timeout_s: float) -> _Conn | None:
        fut: asyncio.Future[_Conn | None] = self.loop.create_future()
        self.waiters.append(fut)
        handle = self.loop.call_later(timeout_s, _expire, fut)
        try:
            return await fut  # popped from the queue by whoever handed it over
        except BaseException as exc:
            if fut in self.waiters:  # a dead entry would make the next request queue
                self.waiters.remove(fut)
            if isinstance(exc, asyncio.TimeoutError):
                raise PoolExhausted("engine connection pool exhausted") from None
            # Cancelled: a connection or slot handed over in the meantime goes back.
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                got = fut.result()
                if got is None:
                    self.slot_freed()
                else:
                    self.release(got)
            raise
        finally:
            handle.cancel()

    def _next_waiter(self) -> asyncio.Future[_Conn | None] | None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                return fut
        return None

    def release(self, conn: _Conn) -> None:
        """A connection whose answer was read in full and may be kept alive."""
        if conn.paused and conn.transport is not None:
            # Its body ended while reading was paused and was released unread: paused,
            # it would see neither the engine's EOF while idle nor the next answer.
            conn.paused = False
            conn.transport.resume_reading()
        waiter = self._next_waiter()
        if waiter is not None:
            conn._reset()
            conn.reused = True
            waiter.set_result(conn)
        elif len(self.idle) < MAX_IDLE:
            conn.idle_since = self.loop.time()
            self.idle.append(conn)
        else:
            conn._close()

    def slot_freed(self) -> None:
        waiter = self._next_waiter()
        if waiter is not None:
            waiter.set_result(None)  # the slot passes to it: it stays counted
        else:
            self.open -= 1

    def forget(self, conn: _Conn) -> None:
        if conn in self.idle:
            self.idle.remove(conn)

    def close(self) -> None:
        for conn in list(self.idle):
            conn._close()
        self.idle.clear()
        while (waiter := self._next_waiter()) is not None:
            waiter.set_exception(ConnectError("client closed"))
            waiter.exception()  # mark retrieved: the waiter may be gone


class Client:
    """Pooled HTTP/1.1 client. ``headers`` are sent with every request."""

    def __init__(
        self,
        *,
        headers: dict[str, str],
        connect_timeout_s: float,
        read_timeout_s: float,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        """``max_connections``: open connections per origin (engine); more concurrent
        requests wait for one, first come first served, up to ``connect_timeout_s``."""
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self.max_connections = max_connections
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        for name, value in headers.items():
            check_header(name, value)
        self._base = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._pools: dict[str, _Pool] = {}
        self._heads: dict[tuple[str, str], bytes] = {}
        self._ssl: ssl.SSLContext | None = None

    def _pool(self, origin: str) -> _Pool:
        pool = self._pools.get(origin)
        if pool is None:
            if origin.startswith("https:") and self._ssl is None:
                self._ssl = ssl.create_default_context()
            pool = self._pools[origin] = _Pool(origin, self._ssl, self.max_connections)
        return pool

    def _head(self, pool: _Pool, method: str) -> bytes:
        key = (pool.host_header, method)
        head = self._heads.get(key)
        if head is None:
            head = self._heads[key] = f"host: {pool.host_header}\r\n{self._base}".encode("latin-1")
        return head

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
    ) -> Response:
        """Send a request to ``origin`` (``http://host:port``) for ``target`` (path
        and query) and wait for the response head. Raises :class:`InvalidRequest`
        before touching a connection if ``target``, ``content_type`` or a header in
        ``headers`` (per-request, e.g. ``x-request-id``) is unsafe."""
        check_target(method, target)
        if content_type is not None:
            check_header("content-type", content_type)
        pool = self._pool(origin)
        timeout = self.read_timeout_s if read_timeout_s is None else read_timeout_s
        extra = f"content-type: {content_type}\r\n" if content_type else ""
        for name, value in (headers or {}).items():
            check_header(name, value)
            extra += f"{name}: {value}\r\n"
        if content is not None or method in ("POST", "PUT", "PATCH"):
            extra += f"content-length: {len(content or b'')}\r\n"
        data = b"".join(
            (
                f"{method} {target} HTTP/1.1\r\n".encode("latin-1"),
                self._head(pool, method),
                extra.encode("latin-1"),
                b"\r\n",
                content or b"",
            )
        )
        conn = await pool.acquire(self.connect_timeout_s)
        try:
            return await self._exchange(conn, data, timeout)
        except ProtocolError:
            # Once more on a new connection only if that cannot make the engine act
            # twice: nothing of ours left (the connection was closing, or the write
            # failed), or an idempotent request on a kept-alive connection that broke
            # before any answer (the engine's keep-alive timeout racing our write).
            # A POST the engine may have read is never resent.
            retry = not conn.sent or (method in IDEMPOTENT and conn.reused and not conn.got_bytes)
            if not retry:
                raise
        conn = await pool.acquire(self.connect_timeout_s, fresh=True)
        return await self._exchange(conn, data, timeout)

    async def _exchange(self, conn: _Conn, data: bytes, timeout: float) -> Response:
        transport = conn.transport
        assert transport is not None
        try:
            if not conn.usable():  # it closed between acquire and now: nothing sent
                raise ProtocolError("engine connection closed")
            transport.write(data)
            # A write that failed at once closed the transport: not a byte went out.
            conn.sent = not transport.is_closing()
            await conn._wait(conn.head_done, timeout)
        except asyncio.TimeoutError:
            conn._close()
            raise ReadTimeout("engine read timed out") from None
        except HTTPError:
            conn._close()
            raise
        except BaseException:
            conn._close()  # cancelled: the connection is mid-exchange, never reuse it
            raise
        return Response(conn, timeout)

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
