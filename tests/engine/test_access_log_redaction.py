"""The engine's access log never records a tenant-scoped id (issue 9, item 9):
``PUT /v1/steering/vectors/alpha~calm`` named the tenant and its vector in vLLM's log."""

from __future__ import annotations

import logging

import pytest
from uvicorn.logging import AccessFormatter

from steergate.engine.http.plugin import ScopedIdRedactor, redact_access_log
from tests.engine.test_engine_http_unit import make_app


def access_record(path: str, method: str = "PUT", status: int = 200) -> logging.LogRecord:
    """Shaped like uvicorn's: ``'%s - "%s %s HTTP/%s" %d'`` with
    ``(client_addr, method, full_path, http_version, status)``."""
    return logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("10.0.0.7:51234", method, path, "1.1", status),
        None,
    )


def logged(redactor: ScopedIdRedactor, path: str) -> str:
    record = access_record(path)
    assert redactor.filter(record) is True  # rewritten, never dropped
    fmt = AccessFormatter('%(client_addr)s - "%(request_line)s" %(status_code)s', use_colors=False)
    return fmt.format(record)  # what uvicorn's handler writes


@pytest.mark.parametrize(
    "path",
    [
        "/v1/steering/vectors/alpha~calm",
        "/v1/steering/vectors/alpha~calm?include=data",
        "/v1/steering/latches/alpha~chat-1",
        "/engine/v1/steering/latches/alpha~user@example.com:42",
        "/v1/steering/latches?prefix=alpha~",
        "/v1/steering/vectors?x=1&prefix=alpha~ca",
    ],
)
def test_scoped_ids_and_prefixes_never_reach_the_access_log(path: str) -> None:
    line = logged(ScopedIdRedactor(), path)
    assert "alpha" not in line and "calm" not in line and "chat-1" not in line
    assert "example.com" not in line and "id:" in line
    assert "10.0.0.7:51234" in line and "200" in line  # the rest of the line is kept


def test_the_tag_is_stable_within_a_run_and_differs_by_id_and_by_run() -> None:
    r = ScopedIdRedactor()
    a1, a2 = (r.redact("/v1/steering/vectors/alpha~calm") for _ in range(2))
    b = r.redact("/v1/steering/vectors/beta~calm")
    other_run = ScopedIdRedactor().redact("/v1/steering/vectors/alpha~calm")
    assert a1 == a2 != b and a1 != other_run
    assert a1.startswith("/v1/steering/vectors/id:") and len(a1.rsplit(":", 1)[1]) == 8


def test_other_paths_pass_unchanged() -> None:
    r = ScopedIdRedactor()
    for path in [
        "/v1/chat/completions",
        "/v1/steering/info",
        "/v1/steering/latches",
        "/v1/steering/status",
        "/health",
    ]:
        assert r.redact(path) == path


def test_records_of_another_shape_are_left_alone() -> None:
    r = ScopedIdRedactor()
    record = logging.LogRecord(
        "uvicorn.access", logging.INFO, __file__, 1, "plain %s", ("message",), None
    )
    assert r.filter(record) and record.getMessage() == "plain message"


async def test_the_plugin_installs_the_redactor_once_on_uvicorn_access() -> None:
    access = logging.getLogger("uvicorn.access")
    before = list(access.filters)
    try:
        for f in [f for f in access.filters if isinstance(f, ScopedIdRedactor)]:
            access.removeFilter(f)
        await make_app()
        redact_access_log()  # idempotent: a second install adds nothing
        ours = [f for f in access.filters if isinstance(f, ScopedIdRedactor)]
        assert len(ours) == 1
        record = access_record("/v1/steering/latches/alpha~chat-1", method="DELETE")
        assert access.filter(record) and "alpha" not in record.getMessage()
    finally:
        access.filters[:] = before
