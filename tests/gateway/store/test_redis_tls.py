"""The gateway on a TLS Redis (``rediss://``) with an ACL user and a self-signed
certificate (issue 14): inference, limits and revocation work through it; a wrong
password fails closed with 503 and the password appears in no log and no answer."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.cluster_harness import TLSRedisProcess
from tests.gateway.conftest import ADMIN_KEY, make_tenant

pytestmark = pytest.mark.own_redis

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture()
def tls_redis() -> Iterator[TLSRedisProcess]:
    server = TLSRedisProcess().start()
    yield server
    server.stop()


def chat(url: str, key: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions", json=BODY, headers={"Authorization": f"Bearer {key}"}
    )


def test_gateway_serves_limits_and_revokes_over_tls_with_an_acl_user(
    tls_redis: TLSRedisProcess, start_gateway: Any
) -> None:
    assert tls_redis.url.startswith("rediss://steergate:")
    gateway = start_gateway(redis_url=tls_redis.url)
    key = make_tenant(tls_redis.url, "tls", rpm=3, max_concurrency=10)
    codes = [chat(gateway.url, key).status_code for _ in range(5)]
    assert codes == [200, 200, 200, 429, 429], codes  # the Lua limits run on the TLS server

    # Revocation travels over the ACL user's pub/sub channel (&sg:*) to the auth cache.
    other = make_tenant(tls_redis.url, "tls2", rpm=1000, max_concurrency=10)
    assert chat(gateway.url, other).status_code == 200  # now cached
    listed = httpx.get(gateway.url + "/admin/tenants/tls2/keys", headers=ADMIN).json()
    key_id = listed["keys"][0]["key_id"]
    revoked = httpx.delete(gateway.url + f"/admin/keys/{key_id}", headers=ADMIN)
    assert revoked.status_code == 204, revoked.text
    t0 = time.monotonic()
    while chat(gateway.url, other).status_code != 401:
        assert time.monotonic() - t0 < 1.0, "revocation did not reach the cache within 1 s"
        time.sleep(0.05)


def test_wrong_acl_password_fails_closed_and_is_never_shown(
    tls_redis: TLSRedisProcess, start_gateway: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    key = make_tenant(tls_redis.url, "tls", rpm=100, max_concurrency=10)
    wrong = "wrong-password-9f8e7d"
    bad_url = tls_redis.url.replace(tls_redis.password, wrong)
    gateway = start_gateway(redis_url=bad_url)
    r = chat(gateway.url, key)
    assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable", r.text
    assert wrong not in r.text and tls_redis.password not in r.text
    assert wrong not in caplog.text and tls_redis.password not in caplog.text
