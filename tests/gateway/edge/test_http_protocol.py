"""Requests the HTTP parser refuses never reach the app, so no middleware shapes their
answer: uvicorn used to write ``text/plain`` "Invalid HTTP request received.". The
installed ``steergate gateway`` (raw sockets, the bytes an attacker or a broken client
sends) answers each with the project's error shape, then closes the connection, and goes
on serving everyone else."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.gateway.conftest import FakeEngine, installed_gateway
from tests.harness import GatewayProcess

MALFORMED = {
    "control character in a header value": (
        b"GET /healthz HTTP/1.1\r\nHost: gw\r\nX-Note: a\x01b\r\n\r\n"
    ),
    "NUL in the request line": b"GET\x00 /healthz HTTP/1.1\r\nHost: gw\r\n\r\n",
    "request target over 64 KiB": (
        b"GET /v1/models?" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: gw\r\n\r\n"
    ),
    "bad chunk size": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
    ),
    "TLS handshake on the plain port": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64),
}


@pytest.fixture()
def gateway_process(redis_url: str, fake_engine: FakeEngine) -> Iterator[GatewayProcess]:
    gw = installed_gateway(redis_url, fake_engine.url)
    yield gw
    gw.stop()


def _exchange(port: int, data: bytes) -> bytes:
    """Send ``data``, read until the server closes (a hang fails on the timeout)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_http_gets_an_openai_shaped_400_and_the_connection_closes(
    gateway_process: GatewayProcess, name: str
) -> None:
    answer = _exchange(gateway_process.port, MALFORMED[name])
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
    assert lines[0] == "HTTP/1.1 400 Bad Request", answer[:200]
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    assert headers["x-should-retry"] == "false"
    assert len(body) == int(headers["content-length"])
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code", "request_id"}
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "invalid_request",
        None,
    )
    assert "HTTP" in error["message"]
    assert error["request_id"] == headers["x-request-id"]
    assert error["request_id"].startswith("req_")
    # The gateway goes on serving: a well-formed request right after is answered.
    assert httpx.get(gateway_process.url + "/healthz", timeout=10).status_code == 200
