"""``Authorization`` may appear once (RFC 9110). With two, the gateway and the engine
read the first while a proxy in front may read the last, so the two could authorise
different credentials (found from outside, on the engine: valid then wrong was 200).
A repeated header is now no credential at all: 401, on tenant, admin and engine routes."""

from __future__ import annotations

import httpx

from tests.gateway.conftest import ADMIN_KEY, make_tenant
from tests.gateway.servers import ServerThread


def test_a_repeated_authorization_header_is_401_whatever_the_copies_hold(
    gateway: ServerThread, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme")
    cases = [
        ("GET", "/v1/models", key),
        ("GET", "/admin/tenants", ADMIN_KEY),
    ]
    for method, path, good in cases:
        alone = httpx.request(method, gateway.url + path,
                              headers=[("Authorization", f"Bearer {good}")])  # fmt: skip
        assert alone.status_code == 200, alone.text
        for pair in ((good, good), (good, "sk-wrong"), ("sk-wrong", good)):
            r = httpx.request(
                method, gateway.url + path,
                headers=[("Authorization", f"Bearer {pair[0]}"),
                         ("Authorization", f"Bearer {pair[1]}")],
            )  # fmt: skip
            assert r.status_code == 401, (path, pair, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
