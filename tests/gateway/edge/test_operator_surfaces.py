"""Issue 9 item 5, as the attack: an outsider on the published port reads nothing an
operator surface knows. ``/metrics`` needs the scrape token or the admin key,
``/openapi.json`` the admin key; ``/docs`` and ``/redoc`` do not exist (no CDN
assets, ever); ``/healthz`` and ``/readyz`` stay public and name no tenant or engine."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from steergate.gateway.edge import openapi
from tests.gateway.conftest import ADMIN_KEY, FakeEngine, make_tenant
from tests.gateway.servers import ServerThread
from tests.harness import ROOT

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SCRAPE_TOKEN = "scrape-only-token-0123456789"
TENANT = "secret-tenant-name"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture()
def gw(start_gateway: Callable[..., ServerThread]) -> ServerThread:
    return start_gateway(metrics_token=SCRAPE_TOKEN)


def is_auth_error(r: httpx.Response, status: int, code: str) -> bool:
    body = r.json()["error"]
    return r.status_code == status and body["code"] == code and set(body) == {
        "message", "type", "param", "code", "request_id"}


@pytest.mark.parametrize("path", ["/metrics", "/openapi.json"])
def test_outsiders_and_tenants_get_401_and_403(gw: ServerThread, redis_url: str, path: str) -> None:
    key = make_tenant(redis_url, TENANT)
    anonymous: list[dict[str, str]] = [
        {}, bearer("sk-sg-guessed"), {"Authorization": "Bearer"}, {"Authorization": "Basic eA=="}]
    for headers in anonymous:
        r = httpx.get(gw.url + path, headers=headers)
        assert is_auth_error(r, 401, "invalid_api_key"), (headers, r.text)
        assert TENANT not in r.text
    assert is_auth_error(httpx.get(gw.url + path, headers=bearer(key)), 403, "permission_denied")
    assert httpx.get(gw.url + path, headers=ADMIN).status_code == 200


def test_the_scrape_token_opens_metrics_and_nothing_else(gw: ServerThread, redis_url: str) -> None:
    make_tenant(redis_url, TENANT)
    r = httpx.get(gw.url + "/metrics", headers=bearer(SCRAPE_TOKEN))
    assert r.status_code == 200 and f'tenant="{TENANT}"' in r.text
    for method, path in [("GET", "/openapi.json"), ("GET", "/admin/tenants"),
                         ("GET", "/admin/usage"), ("GET", "/v1/usage")]:
        r = httpx.request(method, gw.url + path, headers=bearer(SCRAPE_TOKEN))
        assert is_auth_error(r, 401, "invalid_api_key"), (path, r.text)


def test_without_a_scrape_token_metrics_takes_only_the_admin_key(gateway: ServerThread) -> None:
    # `gateway` has no STEERGATE_METRICS_TOKEN: an empty bearer must not match "unset".
    for headers in ({}, {"Authorization": "Bearer"}, bearer("None")):
        assert httpx.get(gateway.url + "/metrics", headers=headers).status_code == 401
    assert httpx.get(gateway.url + "/metrics", headers=ADMIN).status_code == 200


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/docs/oauth2-redirect"])
def test_no_swagger_or_redoc_page_is_served(gw: ServerThread, path: str) -> None:
    for headers in ({}, ADMIN):
        assert httpx.get(gw.url + path, headers=headers).status_code == 404


def test_nothing_served_loads_from_another_origin() -> None:
    """The gateway's own pages (the dashboard) reference no CDN or other origin."""
    for path in (ROOT / "steergate" / "gateway" / "static").iterdir():
        text = path.read_text()
        for url in ("https://", "http://", "//cdn", "unpkg", "jsdelivr"):
            hits = [line for line in text.splitlines() if url in line and "www.w3.org" not in line]
            assert not hits, (path.name, hits)


def test_health_routes_are_public_and_name_no_tenant_or_engine(
    gw: ServerThread, redis_url: str, fake_engine: FakeEngine
) -> None:
    make_tenant(redis_url, TENANT)
    host_port = fake_engine.url.removeprefix("http://")
    port = host_port.rsplit(":", 1)[1]
    for path in ("/healthz", "/readyz"):
        r = httpx.get(gw.url + path)
        assert r.status_code == 200, r.text
        assert TENANT not in r.text and host_port not in r.text and port not in r.text
    assert httpx.get(gw.url + "/readyz").json() == {"status": "ready", "redis": True, "engines": 1}


def test_the_document_gives_every_raw_body_route_a_body_and_ids_their_alphabet(
    gw: ServerThread,
) -> None:
    doc = httpx.get(gw.url + "/openapi.json", headers=ADMIN).json()
    for method, path in openapi.RAW_BODIES:
        assert "requestBody" in doc["paths"][path][method], (method, path)
    put = doc["paths"]["/v1/steering/vectors/{name}"]["put"]
    assert set(put["requestBody"]["content"]) == {"application/json", "application/octet-stream"}
    name = next(p for p in put["parameters"] if p["name"] == "name")
    assert name["schema"]["pattern"] == "^[A-Za-z0-9._-]{1,64}$"
    assert "/metrics" not in doc["paths"] and "/openapi.json" not in doc["paths"]
