"""Fixtures for the operator-surface tests (admin API, usage, metrics, CLI): a gateway
under uvicorn in front of the stub engine (the real endpoint plugin), real Redis."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import ADMIN_KEY, start_stub_engine
from tests.gateway.servers import ServerThread
from tests.gateway.stub_engine import StubEngine

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat_body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "fake",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **extra,
    }


@dataclass
class Ops:
    """A running gateway + fake engine, with small admin/tenant HTTP helpers."""

    gw: ServerThread
    engine: StubEngine
    engine_url: str

    @property
    def url(self) -> str:
        return self.gw.url

    def admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(method, self.url + path, headers=ADMIN, timeout=10, **kw)

    def tenant(self, tenant_id: str, **limits: Any) -> str:
        """Create a tenant through the admin API and return a new key for it."""
        r = self.admin(
            "POST",
            "/admin/tenants",
            json={"id": tenant_id, "limits": limits, "allow_overcommit": True},
        )
        assert r.status_code == 201, r.text
        r = self.admin("POST", f"/admin/tenants/{tenant_id}/keys", json={})
        assert r.status_code == 201, r.text
        return str(r.json()["key"])

    def chat(self, key: str, **extra: Any) -> httpx.Response:
        return httpx.post(
            self.url + "/v1/chat/completions",
            json=chat_body(**extra),
            headers=bearer(key),
            timeout=10,
        )

    def get(self, key: str, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers=bearer(key), timeout=10)

    def wait_for(self, check: Callable[[], bool], timeout: float = 5.0) -> None:
        """Settlement is asynchronous (batched off the hot path): poll briefly."""
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError("condition not reached in time")
            time.sleep(0.05)


@pytest.fixture()
def ops(start_gateway: Callable[..., ServerThread]) -> Iterator[Ops]:
    engine = start_stub_engine()
    try:
        gw = start_gateway(engine_urls=engine.url)
        ops = Ops(gw, engine.state, engine.url)
        # The gateway learns the engine's caps from its first poll.
        ops.wait_for(
            lambda: (
                ops.admin("GET", "/admin/usage").json()["capacity"]["latch_count"][
                    "engine_cap_source"
                ]
                == "engines"
            )
        )
        yield ops
    finally:
        engine.server.stop()


@pytest.fixture()
def cli(ops: Ops, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):  # type: ignore[no-untyped-def]
    """``steergate ...`` through its real entry point against ``ops``' gateway, as the
    admin: (exit code, stdout, stderr)."""
    from steergate.cli.main import main

    monkeypatch.setenv("STEERGATE_GATEWAY_URL", ops.url)
    monkeypatch.setenv("STEERGATE_ADMIN_KEY", ADMIN_KEY)
    monkeypatch.setenv("COLUMNS", "250")  # rich: keep table rows on one line

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run

