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
