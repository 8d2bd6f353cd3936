"""Fixtures for the operator-surface tests (admin API, usage, metrics, CLI): a gateway
in front of the stub engine (the real endpoint plugin), real Redis. ``ops``: the gateway
under uvicorn in this process (tests may reach into its state); ``installed_ops``: the
installed ``steergate gateway`` (the browser tests). ``cli``: the installed
``steergate`` command (both as tests/harness.py starts them: outside the checkout)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import ADMIN_KEY, installed_gateway, start_stub_engine
from tests.gateway.servers import ServerThread
from tests.gateway.stub_engine import StubEngine
from tests.harness import GatewayProcess, steergate_run

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

    gw: ServerThread | GatewayProcess
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


@contextmanager
def _ops(start: Callable[[str], ServerThread | GatewayProcess]) -> Iterator[Ops]:
    engine = start_stub_engine()
    try:
        ops = Ops(start(engine.url), engine.state, engine.url)
        try:
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
            if isinstance(ops.gw, GatewayProcess):
                ops.gw.stop()
    finally:
        engine.server.stop()


@pytest.fixture()
def ops(start_gateway: Callable[..., ServerThread]) -> Iterator[Ops]:
    with _ops(lambda url: start_gateway(engine_urls=url)) as o:
        yield o


@pytest.fixture()
def installed_ops(redis_url: str) -> Iterator[Ops]:
    with _ops(lambda url: installed_gateway(redis_url, url)) as o:
        yield o


def installed_cli(**env: str) -> Callable[..., tuple[int, str, str]]:
    """``steergate ...`` as installed, with this process's environment at each call
    (tests change the admin key with ``monkeypatch``) plus ``env``: a function of the
    arguments, giving (exit code, stdout, stderr)."""

    def run(*argv: str) -> tuple[int, str, str]:
        done = steergate_run(argv, env, capture_output=True, text=True, timeout=60)
        return done.returncode, done.stdout, done.stderr

    return run


@pytest.fixture()
def cli(ops: Ops, monkeypatch: pytest.MonkeyPatch) -> Callable[..., tuple[int, str, str]]:
    """The installed ``steergate`` against ``ops``' gateway, as the admin."""
    monkeypatch.setenv("STEERGATE_GATEWAY_URL", ops.url)
    monkeypatch.setenv("STEERGATE_ADMIN_KEY", ADMIN_KEY)
    monkeypatch.setenv("COLUMNS", "250")  # rich: keep table rows on one line
    return installed_cli()
