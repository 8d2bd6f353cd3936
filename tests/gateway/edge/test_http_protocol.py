"""The gateway's HTTP protocol (steergate/gateway/edge/http_protocol.py), against the
installed ``steergate gateway`` over raw sockets, with the bytes an attacker or a broken
client sends.

Requests the HTTP parser refuses never reach the app, so no middleware shaped their
answer: uvicorn wrote ``text/plain`` "Invalid HTTP request received.". Each is now the
project's error shape, then the connection closes, and everyone else is served. A body
sent a byte at a time used to hold its connection for as long as the client liked; now
it has ``STEERGATE_BODY_TIMEOUT_S``."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.gateway.conftest import FakeEngine, installed_gateway, make_tenant
from tests.gateway.ops_env import chat_body
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


# ------------------------------------------------------------------ slow bodies

BODY_TIMEOUT_S = 1.5


@pytest.fixture()
def impatient_gateway(redis_url: str, fake_engine: FakeEngine) -> Iterator[GatewayProcess]:
    gw = installed_gateway(
        redis_url, fake_engine.url, STEERGATE_BODY_TIMEOUT_S=str(BODY_TIMEOUT_S)
    )
    yield gw
    gw.stop()


def _head(key: str | None, length: int) -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"{auth}Content-Length: {length}\r\n\r\n"
    ).encode()


def _trickle(port: int, head: bytes, body: bytes, every_s: float) -> tuple[bytes, float]:
    """Send the head, then the body a byte every ``every_s`` while reading; return what
    came back by the time the server closed, and when it closed (seconds after the head)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        t0 = time.monotonic()
        sock.settimeout(every_s)
        out, sent = b"", 0
        while time.monotonic() - t0 < 10:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                chunk = None
            except ConnectionResetError:
                break
            if chunk == b"":
                break
            out += chunk or b""
            if sent < len(body):
                try:
                    sock.sendall(body[sent : sent + 1])
                except OSError:
                    break
                sent += 1
        return out, time.monotonic() - t0


def test_a_body_sent_a_byte_at_a_time_gets_408_and_the_connection_closes(
    impatient_gateway: GatewayProcess, redis_url: str
) -> None:
    """The attack: a valid key, a head that promises 400 bytes, then one byte every
    0.2 s (80 s in all). Without a body bound the gateway held the connection (and a
    task) for as long as the client liked; now it answers 408 and closes."""
    key = make_tenant(redis_url, "acme")
    body = orjson.dumps(chat_body(padding="x" * 300))
    out, closed_after = _trickle(impatient_gateway.port, _head(key, len(body)), body, 0.2)
    head, _, payload = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), out[:200]
    assert BODY_TIMEOUT_S - 0.1 <= closed_after < BODY_TIMEOUT_S + 2, closed_after
    error = orjson.loads(payload)["error"]
    assert (error["code"], error["type"]) == ("request_timeout", "invalid_request_error")
    assert b"x-should-retry: true" in head and b"connection: close" in head
    # The gateway serves the same tenant at once, and nothing of the request ran.
    r = httpx.post(
        impatient_gateway.url + "/v1/chat/completions",
        json=chat_body(),
        headers={"Authorization": f"Bearer {key}"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    # The app saw a client that left while it read the body: not a server error (it was
    # logged as an unhandled ClientDisconnect with a traceback, and answered 500).
    log = impatient_gateway.log_tail(100_000)
    assert "client left before its request body was read" in log
    assert "Traceback" not in log and " ERROR " not in log, log[-2000:]


def test_an_early_answer_does_not_hold_the_connection_for_the_rest_of_the_body(
    impatient_gateway: GatewayProcess,
) -> None:
    """No key: 401 at once, before the body. The client then trickles the body it
    promised; the connection closes at the body bound, not when the client stops."""
    body = orjson.dumps(chat_body(padding="x" * 300))
    out, closed_after = _trickle(impatient_gateway.port, _head(None, len(body)), body, 0.2)
    assert out.startswith(b"HTTP/1.1 401 "), out[:200]
    assert out.count(b"HTTP/1.1 ") == 1
    assert closed_after < BODY_TIMEOUT_S + 2, closed_after


def test_a_slow_but_timely_body_and_a_long_answer_are_served(
    impatient_gateway: GatewayProcess, redis_url: str
) -> None:
    """The bound is on the body only: a body in three pieces within it is served, and
    an answer that takes twice the bound (the engine's ``fake_delay``) is not cut."""
    key = make_tenant(redis_url, "acme")
    body = orjson.dumps(chat_body(fake_delay=2 * BODY_TIMEOUT_S))
    with socket.create_connection(("127.0.0.1", impatient_gateway.port), timeout=15) as sock:
        sock.sendall(_head(key, len(body)))
        third = len(body) // 3
        for piece in (body[:third], body[third : 2 * third], body[2 * third :]):
            time.sleep(BODY_TIMEOUT_S / 5)
            sock.sendall(piece)
        t0 = time.monotonic()
        out = b""
        while b"\r\n\r\n" not in out or not out.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            out += chunk
    assert out.startswith(b"HTTP/1.1 200 "), out[:300]
    assert time.monotonic() - t0 >= BODY_TIMEOUT_S
    assert orjson.loads(out.partition(b"\r\n\r\n")[2])["choices"][0]["message"]["content"]


# ------------------------------------------------------------------ large heads


def _send_until_closed(port: int, data: bytes, piece: int = 1 << 20) -> tuple[bytes, int]:
    """Send ``data`` in pieces while the server reads; return what came back and how
    many bytes were sent before the server closed (all of them if it never did)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sent = 0
        try:
            while sent < len(data):
                sock.sendall(data[sent : sent + piece])
                sent += piece
        except OSError:  # the server closed while we were still sending
            pass
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
    return out, min(sent, len(data))


def _refused_431(answer: bytes) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"connection: close" in head
    error = orjson.loads(body)["error"]
    assert (error["code"], error["type"]) == ("headers_too_large", "invalid_request_error")
    assert "128 header fields" in error["message"]


@pytest.mark.parametrize(
    "head",
    [
        # The attack (no key needed): one 64 MiB header held the event loop for seconds
        # (the parser grows a value by appending each piece) and 20 took 800 MB.
        b"GET /healthz HTTP/1.1\r\nHost: gw\r\nX-Big: " + b"a" * (64 << 20) + b"\r\n\r\n",
        # 500,000 tiny headers were all kept and answered 200.
        b"GET /healthz HTTP/1.1\r\nHost: gw\r\n" + b"A: b\r\n" * 500_000 + b"\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: gw\r\n" + b"A: b\r\n" * 128 + b"\r\n",  # 129 fields
        b"GET /healthz HTTP/1.1\r\nHost: gw\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n",
    ],
    ids=["64 MiB header", "500,000 headers", "129 headers", "70 KB of fields"],
)
def test_a_head_past_its_bounds_gets_431_and_is_not_read_further(
    gateway_process: GatewayProcess, head: bytes
) -> None:
    answer, sent = _send_until_closed(gateway_process.port, head)
    _refused_431(answer)
    if len(head) > 8 << 20:  # the server closed long before the client was done
        assert sent < len(head) // 2, sent
    assert httpx.get(gateway_process.url + "/healthz", timeout=10).status_code == 200


def test_heads_within_the_bounds_are_served_also_pipelined_behind_a_body(
    gateway_process: GatewayProcess,
) -> None:
    """128 fields (126 of 500 bytes: 63 KB in all) are served; so is a request whose head
    arrives in the same bytes as the 300 KB body before it (a request line is not
    counted as head bytes of the request before it)."""
    fields = b"".join(b"X-F%d: %s\r\n" % (i, b"v" * 490) for i in range(126))
    ok = b"GET /healthz HTTP/1.1\r\nHost: gw\r\n" + fields + b"\r\n"
    answer = _exchange(gateway_process.port, ok[:-2] + b"Connection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    body = b'{"model": "m", "messages": [], "pad": "' + b"x" * 300_000 + b'"}'
    first = _head(None, len(body)) + body  # no key: 401, and its body is read past
    second = b"GET /healthz HTTP/1.1\r\nHost: gw\r\n" + fields + b"Connection: close\r\n\r\n"
    answer = _exchange(gateway_process.port, first + second)
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
    assert answer.count(b"HTTP/1.1 200 ") == 1, answer[:2000]
