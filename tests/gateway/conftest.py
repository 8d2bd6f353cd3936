"""Gateway test fixtures: a stub engine (the real endpoint plugin in front of a stub of
vLLM's routes, tests/gateway/stub_engine.py) and gateways, each under uvicorn in a
thread, sharing the session's real redis-server, plus tenants and keys made directly
in the data layer."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from steergate.gateway.app import create_app
from steergate.gateway.tenancy.tenants import TenantStore
from steergate.shared.settings import GatewaySettings
from tests.gateway.servers import ServerThread
from tests.gateway.stub_engine import StubEngine
from tests.harness import GatewayProcess, aredis_client

ENGINE_TOKEN = "fake-engine-token"
PEPPER = "gateway-test-pepper"
ADMIN_KEY = "admin-test-key-0123456789"


@dataclass
class FakeEngine:
    """A running stub engine: ``state`` is the StubEngine (its latches, vectors, the
    requests it received), ``server`` the uvicorn thread serving it."""

    state: StubEngine
    server: ServerThread

    @property
    def url(self) -> str:
        return self.server.url


def start_stub_engine(**caps: Any) -> FakeEngine:
    state = StubEngine(ENGINE_TOKEN, **caps)
    return FakeEngine(state, ServerThread(state.app).start())


@pytest.fixture()
def fake_engine() -> Iterator[FakeEngine]:
    engine = start_stub_engine()
    yield engine
    engine.server.stop()


#: The production default Redis timeout, for the tests that prove "503 within 1 s".
DEFAULT_REDIS_TIMEOUT_S: float = GatewaySettings.model_fields["redis_timeout_s"].default
#: Every other test's gateway gets a generous Redis timeout: on a busy 2-core CI box a
#: load test's Redis call can take longer than the 0.5 s default, and a test that is not
#: about timeouts must not fail with 503 store_unavailable because of that.
TEST_REDIS_TIMEOUT_S = 3.0


def gateway_settings(redis_url: str | None, engine_urls: str, **kw: Any) -> GatewaySettings:
    kw.setdefault("engine_token", ENGINE_TOKEN)
    kw.setdefault("redis_timeout_s", TEST_REDIS_TIMEOUT_S)
    return GatewaySettings(
        redis_url=redis_url, engine_urls=engine_urls, admin_key=ADMIN_KEY, key_pepper=PEPPER, **kw
    )


@pytest.fixture()
def start_gateway(redis_url: str, fake_engine: FakeEngine) -> Iterator[Callable[..., ServerThread]]:
    started: list[ServerThread] = []

    def start(**kw: Any) -> ServerThread:
        engine_urls = kw.pop("engine_urls", fake_engine.url)
        url = kw.pop("redis_url", redis_url)
        app = create_app(gateway_settings(url, engine_urls, **kw))
        server = ServerThread(app).start()
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()


@pytest.fixture()
def gateway(start_gateway: Callable[..., ServerThread]) -> ServerThread:
    return start_gateway()


def installed_gateway(redis_url: str, engine_urls: str, **env: str) -> GatewayProcess:
    """The installed ``steergate gateway`` (tests/harness.py: from a temporary folder,
    without the checkout), with this suite's settings; ``env``: more of them."""
    return GatewayProcess(
        {
            "REDIS_URL": redis_url,
            "STEERGATE_ENGINE_URLS": engine_urls,
            "STEERGATE_ENGINE_TOKEN": ENGINE_TOKEN,
            "STEERGATE_ADMIN_KEY": ADMIN_KEY,
            "STEERGATE_KEY_PEPPER": PEPPER,
            "STEERGATE_REDIS_TIMEOUT_S": str(TEST_REDIS_TIMEOUT_S),
            **env,
        }
    ).start()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def make_tenant(redis_url: str, tenant_id: str, **limits: Any) -> str:
    """Create a tenant with ``limits`` (overcommit allowed) and return a fresh key."""

    async def go() -> str:
        client = aredis_client(redis_url)
        try:
            store = TenantStore(client, PEPPER)
            await store.create(tenant_id, limits=limits, allow_overcommit=True)
            return (await store.create_key(tenant_id))[1]
        finally:
            await client.aclose()

    return run(go())


@pytest.fixture()
def captured_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG)
    return caplog
