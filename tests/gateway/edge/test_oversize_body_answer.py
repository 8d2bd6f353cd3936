"""Issue 9 item 10: a client that writes its whole oversize body before reading
(urllib, requests) must read a complete 413 with the OpenAI error shape, not a
connection reset. Real uvicorn, raw sockets: the client does exactly that."""

from __future__ import annotations

import socket
import time
from typing import Any

import orjson
from starlette.responses import PlainTextResponse

from steergate.gateway.edge.body_limit import BodyLimitMiddleware
from tests.gateway.conftest import make_tenant
from tests.gateway.servers import ServerThread

NINE_MIB = 9 * 1024 * 1024


def _connect(server: ServerThread) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=15)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)  # no kernel-buffer slack
    return sock


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Everything up to EOF, parsed (the server closes after a 413)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    headers = {k.lower(): v for k, v in headers.items()}
    assert len(body) == int(headers["content-length"]), "truncated 413 body"
    return int(lines[0].split()[1]), headers, body


def _request_head(key: str, extra: str) -> bytes:
    return (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
        f"authorization: Bearer {key}\r\ncontent-type: application/json\r\n{extra}\r\n"
    ).encode()


def _assert_openai_413(status: int, headers: dict[str, str], body: bytes) -> None:
    assert status == 413
    assert headers["connection"] == "close"
    error = orjson.loads(body)["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code", "request_id"}


def test_9_mib_body_written_before_reading_gets_a_complete_413(
    gateway: ServerThread, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme")
    with _connect(gateway) as sock:
        sock.sendall(_request_head(key, f"content-length: {NINE_MIB}\r\n"))
        sock.sendall(b"x" * NINE_MIB)  # a reset here (EPIPE/ECONNRESET) was the bug
        _assert_openai_413(*_read_response(sock))


def test_9_mib_chunked_body_written_before_reading_gets_a_complete_413(
    gateway: ServerThread, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme")
    piece = b"x" * (256 * 1024)
    frame = b"%x\r\n" % len(piece) + piece + b"\r\n"
    with _connect(gateway) as sock:
        sock.sendall(_request_head(key, "transfer-encoding: chunked\r\n"))
        for _ in range(NINE_MIB // len(piece)):
            sock.sendall(frame)
        sock.sendall(b"0\r\n\r\n")
        _assert_openai_413(*_read_response(sock))


def test_expect_100_continue_gets_the_413_without_sending_the_body(
    gateway: ServerThread, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme")
    with _connect(gateway) as sock:
        sock.sendall(_request_head(key, f"content-length: {NINE_MIB}\r\nexpect: 100-continue\r\n"))
        start = time.monotonic()
        _assert_openai_413(*_read_response(sock))
        assert time.monotonic() - start < 2.0


def _tiny_app(max_bytes: int, **kw: Any) -> ServerThread:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            while (await receive()).get("more_body"):
                pass
            await PlainTextResponse("ok")(scope, receive, send)

    return ServerThread(BodyLimitMiddleware(app, max_bytes=max_bytes, **kw)).start()


def test_a_client_that_stalls_mid_body_is_answered_at_once_and_cut_off_at_the_bound() -> None:
    server = _tiny_app(1024, drain_s=0.5)
    try:
        with _connect(server) as sock:
            sock.sendall(
                b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n" + b"x" * 10
            )
            start = time.monotonic()
            first = sock.recv(65536)
            assert first.startswith(b"HTTP/1.1 413") and time.monotonic() - start < 0.3
            while sock.recv(65536):  # EOF once the drain bound passes
                pass
            assert 0.4 < time.monotonic() - start < 3.0
    finally:
        server.stop()


def test_drain_is_bounded_in_bytes() -> None:
    server = _tiny_app(1024, drain_bytes=64 * 1024, drain_s=10)
    try:
        with _connect(server) as sock:
            sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 10000000\r\n\r\n")
            sent, closed = 0, False
            try:
                while sent < 10_000_000:
                    sent += sock.send(b"x" * 65536)
            except (ConnectionResetError, BrokenPipeError):
                closed = True  # the server stopped reading past its bound and closed
            assert closed and sent < 10_000_000
    finally:
        server.stop()


def test_bodies_within_the_limit_still_pass() -> None:
    server = _tiny_app(1024)
    try:
        with _connect(server) as sock:
            sock.sendall(
                b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1024\r\n\r\n" + b"x" * 1024
            )
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        server.stop()
