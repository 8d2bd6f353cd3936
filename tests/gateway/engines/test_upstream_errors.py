"""How the one upstream boundary maps the HTTP client's failures: an engine that is
down is marked so (and routed around); a busy engine, or our own refusal to send an
ill-formed request, never is."""

from __future__ import annotations

from steergate.gateway.engines import http1
from steergate.gateway.engines.upstream import Engine, EngineUnreachable, _unavailable


def test_connect_failure_marks_the_engine_down_and_may_be_sent_elsewhere() -> None:
    e = Engine("http://127.0.0.1:1")
    err = _unavailable(e, http1.ConnectError("refused"))
    assert isinstance(err, EngineUnreachable) and err.status == 502 and not e.healthy


def test_a_full_connection_pool_is_busy_not_down() -> None:
    e = Engine("http://127.0.0.1:1")
    err = _unavailable(e, http1.PoolExhausted("all busy"))
    assert (err.status, err.code) == (503, "engine_overloaded") and e.healthy
    assert not isinstance(err, EngineUnreachable)


def test_an_ill_formed_request_is_our_500_and_leaves_the_engine_alone() -> None:
    e = Engine("http://127.0.0.1:1")
    err = _unavailable(e, http1.InvalidRequestTarget("bad target"))
    assert err.status == 500 and e.healthy and "bad target" not in err.message


def test_read_timeout_is_504_and_keeps_the_engine() -> None:
    e = Engine("http://127.0.0.1:1")
    err = _unavailable(e, http1.ReadTimeout("slow"))
    assert (err.status, err.code) == (504, "engine_timeout") and e.healthy


async def test_engine_requests_ask_for_no_content_coding() -> None:
    """No Accept-Encoding means any coding is acceptable (RFC 9110): a compressing proxy
    in front of an engine sent gzip, relayed to clients as JSON or SSE they could not
    read, and whose usage could not be metered. Every engine request asks for identity."""
    import asyncio

    from steergate.gateway.engines.upstream import EnginePool

    heads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = EnginePool([f"http://127.0.0.1:{port}"], "t")
    try:
        r = await pool.request("GET", "/v1/models")
        assert r.status == 200
    finally:
        await pool.aclose()
        server.close()
        await server.wait_closed()
    assert b"\r\naccept-encoding: identity\r\n" in heads[0].lower()
