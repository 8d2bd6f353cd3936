"""The gateway's HTTP/1.1 client refuses a request target or header that would not be
one well-formed request (issue 9, item 1): a scoped id ending in "\\n" once reached
the engine's request line. The refusal comes before any connection is used, so the
engine sees not one byte of it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from steergate.gateway.engines.http1 import Client, HTTPError, InvalidHeader, InvalidRequestTarget

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: text/plain\r\n\r\nok"


@dataclass
class Recorder:
    """A tiny HTTP server: answers 200 to each request head, records every byte."""

    connections: int = 0
    received: bytearray = field(default_factory=bytearray)
    handlers: list[tuple[asyncio.Task[None], asyncio.StreamWriter]] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.handlers.append((task, writer))
        buf = b""
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                self.received += data
                buf += data
                while b"\r\n\r\n" in buf:
                    _, buf = buf.split(b"\r\n\r\n", 1)
                    writer.write(OK)
                    await writer.drain()
        finally:
            writer.close()

    async def stop(self) -> None:
        for _, writer in self.handlers:
            writer.close()  # the handler's read then sees EOF and it ends by itself
        await asyncio.gather(*(task for task, _ in self.handlers), return_exceptions=True)


@contextlib.asynccontextmanager
async def serving() -> AsyncIterator[tuple[Recorder, str]]:
    """Started inside the test, on the test's own event loop."""
    rec = Recorder()
    srv = await asyncio.start_server(rec.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield rec, f"http://127.0.0.1:{port}"
    finally:
        srv.close()
        await rec.stop()
        await srv.wait_closed()


def client(**headers: str) -> Client:
    return Client(
        headers={"authorization": "Bearer t", **headers},
        connect_timeout_s=2.0,
        read_timeout_s=2.0,
    )


BAD_TARGETS = [
    "/v1/steering/latches/acme~chat-1\n",  # the audit's trailing newline
    "/v1/steering/vectors/acme~calm\r\nX-Injected: 1",
    "/v1/steering/vectors/acme~calm HTTP/1.1\r\n\r\nGET /v1/steering/status",
    "/v1/steering/vectors/acme~ca lm",
    "/v1/steering/vectors/acme~calm\t",
    "/v1/steering/vectors/acme~calm\x00",
    "/v1/steering/vectors/acme~calm\x7f",
    "/v1/steering/vectors/acme~cälm",
    "/v1/steering/vectors/acme~calm\u2028",
    *(f"/v1/x{chr(c)}" for c in range(0x21)),
    "",
]


async def test_a_target_with_whitespace_control_or_non_ascii_never_reaches_the_server() -> None:
    async with serving() as (rec, origin):
        c = client()
        try:
            for target in BAD_TARGETS:
                for method in ("GET", "DELETE", "PUT"):
                    with pytest.raises(InvalidRequestTarget):
                        await c.send(method, origin, target, content=b"{}")
            await asyncio.sleep(0.05)
            assert rec.connections == 0 and bytes(rec.received) == b""
            # The same client and server work for a clean target: the refusal was the check.
            r = await c.send("DELETE", origin, "/v1/steering/latches/acme~chat-1")
            assert r.status == 200 and await r.read() == b"ok"
            await r.aclose()
            assert rec.connections == 1
        finally:
            await c.aclose()


async def test_the_refusal_is_an_http_error_so_callers_need_no_new_except() -> None:
    async with serving() as (_, origin):
        c = client()
        try:
            with pytest.raises(HTTPError):
                await c.send("GET", origin, "/v1/steering/info\n")
        finally:
            await c.aclose()


async def test_a_header_with_cr_lf_or_nul_is_refused_before_sending() -> None:
    for name, value in [
        ("authorization", "Bearer t\r\nx-injected: 1"),
        ("authorization", "Bearer t\n"),
        ("authorization", "Bearer t\x00"),
        ("x-bad name", "v"),
        ("x-bad\r\nname", "v"),
    ]:
        with pytest.raises(InvalidHeader):
            Client(headers={name: value}, connect_timeout_s=1.0, read_timeout_s=1.0)
    async with serving() as (rec, origin):
        c = client()
        try:
            for ctype in ("application/json\r\nx-injected: 1", "application/json\n", "a\x00"):
                with pytest.raises(InvalidHeader):
                    await c.send(
                        "POST", origin, "/v1/chat/completions", content=b"{}", content_type=ctype
                    )
        finally:
            await c.aclose()
        await asyncio.sleep(0.05)
        assert rec.connections == 0 and bytes(rec.received) == b""


async def test_a_bad_target_does_not_spoil_a_pooled_connection() -> None:
    async with serving() as (rec, origin):
        c = client()
        try:
            for target in ("/a", "/b\n", "/c"):
                try:
                    r = await c.send("GET", origin, target)
                except InvalidRequestTarget:
                    continue
                assert await r.read() == b"ok"
                await r.aclose()
            got = bytes(rec.received)
            assert b"GET /a " in got and b"GET /c " in got and b"/b" not in got
        finally:
            await c.aclose()
