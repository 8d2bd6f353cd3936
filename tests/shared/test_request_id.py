"""Request ids: validation, and every log line written while a request is served ends
with its id -- uvicorn's access line (whose formatter ignores the message) included."""

from __future__ import annotations

import io
import logging

import pytest
from uvicorn.logging import AccessFormatter

from steergate.shared import request_id


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("req_abc", True),
        ("a" * 128, True),
        ("Ticket:42.a_b-C", True),
        ("a" * 129, False),
        ("", False),
        ("two words", False),
        ("semi;colon", False),
        ("percent%s", False),
        (None, False),
    ],
)
def test_valid_ids(value: str | None, ok: bool) -> None:
    assert request_id.valid(value) is ok


def test_generated_ids_look_like_openais() -> None:
    rid = request_id.new()
    assert rid.startswith("req_") and len(rid) == 36 and request_id.valid(rid)
    assert rid != request_id.new()


def _capture(
    logger: logging.Logger, formatter: logging.Formatter
) -> tuple[io.StringIO, logging.Handler]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return out, handler


def test_log_lines_during_a_request_end_with_its_id() -> None:
    request_id.install_log_records()
    plain = logging.getLogger("steergate.test.request_id")
    plain.propagate = False
    text, _ = _capture(plain, logging.Formatter("%(message)s"))
    access = logging.getLogger("uvicorn.access")
    before = access.propagate
    access.propagate = False
    line, handler = _capture(
        access, AccessFormatter('%(client_addr)s - "%(request_line)s" %(status_code)s')
    )
    try:
        plain.info("outside %s", "any request")
        token = request_id._current.set("ticket-7")
        try:
            plain.info("serving %s", "/v1/chat/completions")
            access.info(
                '%s - "%s %s HTTP/%s" %d', "127.0.0.1:5000", "POST", "/v1/responses", "1.1", 200
            )
        finally:
            request_id._current.reset(token)
    finally:
        access.removeHandler(handler)
        access.propagate = before
    assert text.getvalue().splitlines() == [
        "outside any request",
        "serving /v1/chat/completions [request_id=ticket-7]",
    ]
    assert "127.0.0.1:5000 [request_id=ticket-7]" in line.getvalue()
    assert line.getvalue().count("request_id") == 1
