"""The gateway's HTTP/1.1 engine client (steergate/gateway/engines/http1.py, issue 15 item 3),
against tiny asyncio servers on loopback that write exact bytes: bodies of every framing,
keep-alive reuse, what is resent after a broken connection and what never is,
back-pressure, timeouts and the per-engine connection cap. Request-target and header
validation are in test_http1_target.py."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import re
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
import uvloop

from steergate.gateway.engines import http1
from steergate.gateway.engines.http1 import (
    HIGH_WATER,
    Client,
    ConnectError,
    PoolExhausted,
    ProtocolError,
    ReadTimeout,
)
from steergate.gateway.engines.upstream import EnginePool

Reader = asyncio.StreamReader
Writer = asyncio.StreamWriter


def ok(body: bytes = b"ok", *extra: str) -> bytes:
    head = "".join(f"{h}\r\n" for h in extra)
    return f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n{head}\r\n".encode() + body


@dataclass
class Server:
    """What a test server saw: connections (total, at once) and request lines."""

    handler: Callable[[Server, Reader, Writer], Awaitable[None]]
    connections: int = 0
    active: int = 0
    max_active: int = 0
    requests: list[bytes] = field(default_factory=list)
    written: int = 0
    tasks: list[tuple[asyncio.Task[None], Writer]] = field(default_factory=list)

    async def handle(self, reader: Reader, writer: Writer) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.append((task, writer))
        self.connections += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await self.handler(self, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # cancelled: the test is over (Python 3.11 would log a cancelled handler)
        finally:
            self.active -= 1
            writer.close()

    async def read_request(self, reader: Reader) -> bytes | None:
        """One request (head and content-length body); its request line, None at EOF."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        length = re.search(rb"(?im)^content-length: *(\d+)", head)
        if length:
            await reader.readexactly(int(length[1]))
        line = head.split(b"\r\n", 1)[0]
        self.requests.append(line)
        return line

    def count(self, line: bytes) -> int:
        return sum(1 for r in self.requests if r.startswith(line))


@contextlib.asynccontextmanager
async def serving(
    handler: Callable[[Server, Reader, Writer], Awaitable[None]],
) -> AsyncIterator[tuple[Server, str]]:
    srv = Server(handler)
    listener = await asyncio.start_server(srv.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        yield srv, f"http://127.0.0.1:{port}"
    finally:
        listener.close()
        for task, writer in srv.tasks:
            writer.close()
            task.cancel()
        await asyncio.gather(*(t for t, _ in srv.tasks), return_exceptions=True)
        await listener.wait_closed()


def answering(*responses: bytes, delay_s: float = 0.0) -> Callable[..., Awaitable[None]]:
    """Answers each request on a connection with the next of ``responses`` (the last
    one repeated), after ``delay_s``."""

    async def handler(srv: Server, reader: Reader, writer: Writer) -> None:
        i = 0
        while await srv.read_request(reader) is not None:
            await asyncio.sleep(delay_s)
            writer.write(responses[min(i, len(responses) - 1)])
            await writer.drain()
            i += 1

    return handler


@contextlib.asynccontextmanager
async def client(**kw: float) -> AsyncIterator[Client]:
    opts: dict[str, float] = {"connect_timeout_s": 1.0, "read_timeout_s": 1.0, **kw}
    c = Client(headers={"authorization": "Bearer t"}, **opts)  # type: ignore[arg-type]
    try:
        yield c
    finally:
        await c.aclose()


async def fetch(c: Client, origin: str, method: str = "GET", target: str = "/") -> bytes:
    r = await c.send(method, origin, target, content=b"{}" if method == "POST" else None)
    try:
        return await r.read()
    finally:
        await r.aclose()


def rst(writer: Writer) -> None:
    """Close with a TCP reset, as a crashed or killed engine does."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


# -- bodies ------------------------------------------------------------------------


async def test_a_content_length_body_is_read_whole_and_chunk_by_chunk() -> None:
    body = bytes(range(256)) * 40
    async with serving(answering(ok(body, "x-engine: a", "x-engine: b"))) as (_, origin):
        async with client() as c:
            r = await c.send("GET", origin, "/whole")
            assert (r.status, r.headers["x-engine"]) == (200, "a, b")
            assert await r.read() == body
            await r.aclose()
            r = await c.send("GET", origin, "/pieces")
            assert b"".join([chunk async for chunk in r.iter_chunks()]) == body
            await r.aclose()


async def test_a_chunked_body_arrives_dechunked_piece_by_piece_as_sent() -> None:
    go_on = asyncio.Event()

    async def handler(srv: Server, reader: Reader, writer: Writer) -> None:
        while await srv.read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await go_on.wait()  # the client must have the first piece before the next
            writer.write(b"6\r\n world\r\n0\r\n\r\n")
            go_on.clear()

    async with serving(handler) as (srv, origin):
        async with client() as c:
            r = await c.send("GET", origin, "/stream")
            pieces = []
            async for chunk in r.iter_chunks():
                pieces.append(chunk)
                go_on.set()
            assert pieces == [b"hello", b" world"]
            await r.aclose()
            go_on.set()
            assert await fetch(c, origin) == b"hello world"
            assert srv.connections == 1  # the chunked framing ended the message


async def test_a_close_delimited_body_ends_at_eof_and_the_connection_is_not_reused() -> None:
    async def handler(srv: Server, reader: Reader, writer: Writer) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil ")
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(b"the end")
        await writer.drain()
        writer.close()

    async with serving(handler) as (srv, origin):
        async with client() as c:
            r = await c.send("GET", origin, "/")
            assert [chunk async for chunk in r.iter_chunks()] == [b"until ", b"the end"]
            await r.aclose()
            assert await fetch(c, origin) == b"until the end"
            assert srv.connections == 2


async def test_a_close_delimited_body_cut_by_a_reset_is_an_error_not_an_end() -> None:
    async def handler(srv: Server, reader: Reader, writer: Writer) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n\r\npart")
        await writer.drain()
        await asyncio.sleep(0.05)
        rst(writer)

    async with serving(handler) as (_, origin):
        async with client() as c:
            r = await c.send("GET", origin, "/")
            with pytest.raises(ProtocolError):
                await r.read()
            await r.aclose()


# -- keep-alive --------------------------------------------------------------------


async def test_sequential_requests_reuse_one_connection() -> None:
    async with serving(answering(ok())) as (srv, origin):
        async with client() as c:
            assert await fetch(c, origin, "GET", "/a") == b"ok"
            assert await fetch(c, origin, "POST", "/b") == b"ok"
            assert await fetch(c, origin, "DELETE", "/c") == b"ok"
            assert srv.connections == 1 and len(srv.requests) == 3


async def test_a_connection_close_answer_or_an_unread_body_is_not_reused() -> None:
    async with serving(answering(ok(b"ok", "connection: close"), ok())) as (srv, origin):
        async with client() as c:
            assert await fetch(c, origin) == b"ok"
            assert srv.connections == 1
            assert await fetch(c, origin) == b"ok"
            assert srv.connections == 2
    async with serving(answering(b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok")) as (
        srv,
        origin,
    ):
        async with client() as c:
            await fetch(c, origin)
            await fetch(c, origin)
            assert srv.connections == 2  # HTTP/1.0 without keep-alive

    async def slow_body(srv: Server, reader: Reader, writer: Writer) -> None:
        while await srv.read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nha")
            await asyncio.sleep(0.05)
            writer.write(b"lf")

    async with serving(slow_body) as (srv, origin):
        async with client() as c:
            r = await c.send("GET", origin, "/")
            await r.aclose()  # body not read: the connection is mid-message
            assert await fetch(c, origin) == b"half"
            assert srv.connections == 2


async def test_bytes_after_an_answer_spoil_the_connection_not_the_answer() -> None:
    async with serving(answering(ok(b"ok") + b"HTTP/1.1 200 OK\r\n", ok())) as (srv, origin):
        async with client() as c:
            assert await fetch(c, origin) == b"ok"
            assert await fetch(c, origin) == b"ok"
            assert srv.connections == 2


async def test_a_body_that_ended_while_reading_was_paused_leaves_a_working_connection() -> None:
    body = b"x" * (HIGH_WATER + 1000)  # the last piece pauses reading, then completes
    async with serving(answering(ok(body), ok())) as (srv, origin):
        async with client() as c:
            r = await c.send("GET", origin, "/big")
            while not r._conn.complete:
                await asyncio.sleep(0.005)
            assert r._conn.paused
            await r.aclose()  # released unread, still paused
            assert await fetch(c, origin) == b"ok"
            assert srv.connections == 1

    async def then_close(srv: Server, reader: Reader, writer: Writer) -> None:
        if srv.connections > 1:
            return await answering(ok())(srv, reader, writer)
        await srv.read_request(reader)
        writer.write(ok(body))
        await writer.drain()
        writer.close()  # while the client's connection sits idle

    async with serving(then_close) as (srv, origin):
        async with client() as c:
            r = await c.send("GET", origin, "/big")
            while not r._conn.complete:
                await asyncio.sleep(0.005)
            await r.aclose()
            await asyncio.sleep(0.05)  # the EOF is seen only if reading was resumed
            assert await fetch(c, origin, "POST", "/p") == b"ok"
            assert srv.count(b"POST /p ") == 1 and srv.connections == 2


# -- what is sent again, and what never is ------------------------------------------


async def test_an_idle_connection_the_engine_closed_is_replaced_without_an_error() -> None:
    async def handler(srv: Server, reader: Reader, writer: Writer) -> None:
        await srv.read_request(reader)
        writer.write(ok())
        await writer.drain()
        writer.close()  # its keep-alive timeout, without saying connection: close

    async with serving(handler) as (srv, origin):
        async with client() as c:
            await fetch(c, origin, "GET", "/warm")
            await asyncio.sleep(0.05)
            assert await fetch(c, origin, "POST", "/post") == b"ok"
            await asyncio.sleep(0.05)
            assert await fetch(c, origin, "GET", "/get") == b"ok"
            assert srv.count(b"POST /post ") == 1 and srv.count(b"GET /get ") == 1


async def test_a_connection_idle_past_its_ttl_is_not_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The engine may be closing a connection idle for its keep-alive timeout just as a
    # POST is written to it; that POST could not be resent. Connections idle longer
    # than IDLE_TTL_S (below the engine's timeout) are closed and a new one is used.
    monkeypatch.setattr(http1, "IDLE_TTL_S", 0.05)
    async with serving(answering(ok())) as (srv, origin):
        async with client() as c:
            await fetch(c, origin, "GET", "/warm")
            assert await fetch(c, origin, "POST", "/soon") == b"ok"
            assert srv.connections == 1  # reused while fresh
            await asyncio.sleep(0.1)
            assert await fetch(c, origin, "POST", "/late") == b"ok"
            assert srv.connections == 2 and srv.count(b"POST /late ") == 1


async def test_a_post_on_a_connection_reset_while_idle_is_sent_once() -> None:
    closed = asyncio.Event()

    async def handler(srv: Server, reader: Reader, writer: Writer) -> None:
        if srv.connections > 1:
            return await answering(ok())(srv, reader, writer)
        await srv.read_request(reader)
        writer.write(ok())
        await writer.drain()
        await asyncio.sleep(0.02)
        rst(writer)
        await asyncio.sleep(0)  # the socket is closed in the next callback
        closed.set()

    async with serving(handler) as (srv, origin):
        async with client() as c:
            await fetch(c, origin, "GET", "/warm")
            await closed.wait()
            # Sent at once: the reset may not have been read yet, so the write may be
            # what finds it. Either way nothing left, and it goes out once.
            assert await fetch(c, origin, "POST", "/post") == b"ok"
            assert srv.count(b"POST /post ") == 1 and srv.connections == 2


def read_then_break(how: Callable[[Writer], None]) -> Callable[..., Awaitable[None]]:
    """Answers the first request on the first connection; reads the second and breaks
    the connection without an answer. Later connections answer everything."""

    async def handler(srv: Server, reader: Reader, writer: Writer) -> None:
        if srv.connections > 1:
            return await answering(ok())(srv, reader, writer)
        await srv.read_request(reader)
        writer.write(ok())
        await writer.drain()
        await srv.read_request(reader)
        how(writer)

    return handler


@pytest.mark.parametrize("how", [rst, Writer.close], ids=["reset", "close"])
async def test_a_post_the_engine_read_is_never_sent_twice(
    how: Callable[[Writer], None],
) -> None:
    async with serving(read_then_break(how)) as (srv, origin):
        async with client() as c:
            await fetch(c, origin, "GET", "/warm")
            with pytest.raises(ProtocolError):
                await fetch(c, origin, "POST", "/v1/chat/completions")
            assert srv.count(b"POST /v1/chat/completions ") == 1
            assert srv.connections == 1


async def test_a_post_on_a_new_connection_that_breaks_is_not_resent() -> None:
    async def handler(srv: Server, reader: Reader, writer: Writer) -> None:
        await srv.read_request(reader)
        rst(writer)

    async with serving(handler) as (srv, origin):
        async with client() as c:
            with pytest.raises(ProtocolError):
                await fetch(c, origin, "POST", "/p")
            assert srv.count(b"POST /p ") == 1


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
async def test_an_idempotent_request_is_resent_once_on_a_new_connection(method: str) -> None:
    async with serving(read_then_break(rst)) as (srv, origin):
        async with client() as c:
            await fetch(c, origin, "GET", "/warm")
            r = await c.send(method, origin, "/v1/steering/vectors/a~b", content=b"{}")
            assert await r.read() == b"ok"
            await r.aclose()
            assert srv.count(f"{method} /v1/steering/vectors/a~b ".encode()) == 2
            assert srv.connections == 2


async def test_an_idempotent_request_is_resent_only_once() -> None:
    async def handler(srv: Server, reader: Reader, writer: Writer) -> None:
        if srv.connections == 1:
            await srv.read_request(reader)
            writer.write(ok())
            await writer.drain()
        await srv.read_request(reader)
        rst(writer)

    async with serving(handler) as (srv, origin):
        async with client() as c:
            await fetch(c, origin, "GET", "/warm")
            with pytest.raises(ProtocolError):
                await fetch(c, origin, "GET", "/g")
            assert srv.count(b"GET /g ") == 2


# -- back-pressure -------------------------------------------------------------------


async def test_a_slow_reader_stalls_the_engine_instead_of_buffering() -> None:
    total = 16 * 1024 * 1024
    piece = b"y" * 65536

    async def handler(srv: Server, reader: Reader, writer: Writer) -> None:
        await srv.read_request(reader)
        writer.write(f"HTTP/1.1 200 OK\r\ncontent-length: {total}\r\n\r\n".encode())
        while srv.written < total:
            writer.write(piece)
            await writer.drain()
            srv.written += len(piece)

    async with serving(handler) as (srv, origin):
        async with client() as c:
            r = await c.send("GET", origin, "/stream")
            seen, deadline = -1, time.monotonic() + 0.8
            while srv.written != seen and time.monotonic() < deadline:
                seen = srv.written
                await asyncio.sleep(0.05)
            assert srv.written == seen < total // 2  # the engine's drain() stalled
            conn = r._conn
            assert conn.paused
            assert conn.buffered <= HIGH_WATER + 256 * 1024  # one read past the mark
            got = 0
            async for chunk in r.iter_chunks():
                got += len(chunk)
            assert got == total and srv.written == total
            await r.aclose()


# -- timeouts and connect errors -------------------------------------------------------


async def test_nothing_listening_is_a_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with client() as c:
        with pytest.raises(ConnectError):
            await c.send("GET", f"http://127.0.0.1:{port}", "/")
        with pytest.raises(ConnectError):  # the failed connect held no slot
            await c.send("GET", f"http://127.0.0.1:{port}", "/")


async def test_a_connect_that_hangs_is_a_connect_error_after_the_connect_timeout() -> None:
    with socket.socket() as listener, socket.socket() as filler:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)  # never accepted: after one queued connect, SYNs are dropped
        filler.connect(listener.getsockname())
        async with client(connect_timeout_s=0.2) as c:
            t0 = time.monotonic()
            port = listener.getsockname()[1]
            with pytest.raises(ConnectError):
                await c.send("GET", f"http://127.0.0.1:{port}", "/")
            assert 0.15 < time.monotonic() - t0 < 0.6


async def test_no_answer_is_a_read_timeout() -> None:
    async def handler(srv: Server, reader: Reader, writer: Writer) -> None:
        await srv.read_request(reader)
        await reader.read()  # never answers

    async with serving(handler) as (_, origin):
        async with client(read_timeout_s=0.2) as c:
            t0 = time.monotonic()
            with pytest.raises(ReadTimeout):
                await c.send("POST", origin, "/p", content=b"{}")
            assert 0.15 < time.monotonic() - t0 < 0.6
            with pytest.raises(ReadTimeout):  # the per-request timeout wins
                await c.send("GET", origin, "/g", read_timeout_s=0.05)


async def test_a_body_that_stops_arriving_is_a_read_timeout() -> None:
    async def handler(srv: Server, reader: Reader, writer: Writer) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await reader.read()

    async with serving(handler) as (_, origin):
        async with client(read_timeout_s=0.2) as c:
            r = await c.send("GET", origin, "/")
            with pytest.raises(ReadTimeout):
                await r.read()
            await r.aclose()


# -- the per-engine connection cap ------------------------------------------------------


async def test_the_per_engine_cap_bounds_concurrent_connections() -> None:
    async with serving(answering(ok(), delay_s=0.05)) as (srv, origin):
        async with client(max_connections=2) as c:
            bodies = await asyncio.gather(*(fetch(c, origin, "GET", f"/{i}") for i in range(8)))
            assert bodies == [b"ok"] * 8
            assert srv.max_active == 2 and srv.connections == 2 and len(srv.requests) == 8


async def test_waiters_get_connections_first_come_first_served() -> None:
    async with serving(answering(ok(), delay_s=0.02)) as (srv, origin):
        async with client(max_connections=1) as c:
            tasks = []
            for i in range(5):
                tasks.append(asyncio.create_task(fetch(c, origin, "GET", f"/{i}")))
                await asyncio.sleep(0)  # each queues before the next starts
            await asyncio.gather(*tasks)
            assert srv.requests == [f"GET /{i} HTTP/1.1".encode() for i in range(5)]


async def test_a_request_that_waits_past_the_connect_timeout_is_pool_exhausted() -> None:
    async with serving(answering(ok(), delay_s=0.5)) as (srv, origin):
        async with client(max_connections=1, connect_timeout_s=0.1) as c:
            busy = asyncio.create_task(fetch(c, origin, "GET", "/slow"))
            await asyncio.sleep(0.02)
            t0 = time.monotonic()
            with pytest.raises(PoolExhausted) as err:
                await fetch(c, origin, "GET", "/waits")
            assert isinstance(err.value, ConnectError)  # a 502 that may go to another engine
            assert 0.08 < time.monotonic() - t0 < 0.4
            assert await busy == b"ok"
            assert srv.connections == 1 and srv.count(b"GET /waits") == 0


async def test_a_failed_or_cancelled_request_gives_its_slot_back() -> None:
    async def handler(srv: Server, reader: Reader, writer: Writer) -> None:
        while (line := await srv.read_request(reader)) is not None:
            if line.startswith(b"GET /hang"):
                await reader.read()
            writer.write(ok())

    async with serving(handler) as (srv, origin):
        async with client(max_connections=1, read_timeout_s=0.1) as c:
            with pytest.raises(ReadTimeout):
                await fetch(c, origin, "GET", "/hang")
            assert await fetch(c, origin, "GET", "/next") == b"ok"
            holder = await c.send("GET", origin, "/held")  # body unread: holds the slot
            waiter = asyncio.create_task(fetch(c, origin, "GET", "/cancelled"))
            await asyncio.sleep(0.02)
            waiter.cancel()
            await holder.read()
            await holder.aclose()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
            assert await fetch(c, origin, "GET", "/after") == b"ok"
            assert srv.count(b"GET /cancelled") == 0


def test_the_engine_pool_passes_its_cap_to_the_client() -> None:
    assert EnginePool(["http://e:1"], "t")._client.max_connections == http1.MAX_CONNECTIONS
    assert EnginePool(["http://e:1"], "t", max_connections=3)._client.max_connections == 3
    with pytest.raises(ValueError):
        Client(headers={}, connect_timeout_s=1.0, read_timeout_s=1.0, max_connections=0)


# -- the same, on the production event loop ----------------------------------------------


def _all_cases() -> list[Callable[[], Awaitable[None]]]:
    plain = [
        f
        for name, f in sorted(globals().items())
        if name.startswith("test_")
        and inspect.iscoroutinefunction(f)
        and not inspect.signature(f).parameters
    ]
    return [
        *plain,
        functools.partial(test_a_post_the_engine_read_is_never_sent_twice, rst),
        functools.partial(test_a_post_the_engine_read_is_never_sent_twice, Writer.close),
        functools.partial(test_an_idempotent_request_is_resent_once_on_a_new_connection, "PUT"),
    ]


@pytest.mark.parametrize(
    "case", _all_cases(), ids=lambda f: getattr(f, "__name__", None) or f.func.__name__
)
def test_under_uvloop(case: Callable[[], Awaitable[None]]) -> None:
    """The gateway runs uvloop, whose transports differ from asyncio's in when a reset
    or an EOF is noticed: every test above again, on it."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(case())  # type: ignore[arg-type]
