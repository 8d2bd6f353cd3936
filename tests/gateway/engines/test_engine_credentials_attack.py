"""An engine URL may carry credentials (``http://user:password@engine:8100``, for an
engine behind a proxy that wants basic auth). The installed gateway never shows them:
not on ``/admin/engines``, not in ``/metrics`` and not in its log, where every engine
warning used to print the URL as configured (``engine http://ops:…@…:1 unavailable``)."""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx

from tests.gateway.conftest import FakeEngine, installed_gateway, make_tenant
from tests.gateway.ops_env import ADMIN, chat_body
from tests.harness import free_port

LIVE_SECRET = "live-engine-s3cret"
DEAD_SECRET = "dead-engine-s3cret"


def test_engine_credentials_never_reach_the_log_admin_pages_or_metrics(
    redis_url: str, fake_engine: FakeEngine
) -> None:
    live = urlsplit(fake_engine.url).netloc
    dead = f"127.0.0.1:{free_port()}"
    urls = f"http://ops:{LIVE_SECRET}@{live},http://ops:{DEAD_SECRET}@{dead}"
    gw = installed_gateway(redis_url, urls)
    try:
        key = make_tenant(redis_url, "creds")
        with httpx.Client(base_url=gw.url, timeout=30) as client:
            # Requests spread over both engines: the dead one is marked down (a warning).
            for _ in range(6):
                client.post(
                    "/v1/chat/completions",
                    json=chat_body(),
                    headers={"authorization": f"Bearer {key}"},
                )
            engines = client.get("/admin/engines", headers=ADMIN)
            metrics = client.get("/metrics", headers=ADMIN)
        assert engines.status_code == 200 and metrics.status_code == 200
        shown = {e["url"] for e in engines.json()["engines"]}
        assert shown == {f"http://{live}", f"http://{dead}"}
        log = gw.log_tail(1_000_000)
        # the dead engine was logged, by the address an operator can act on
        assert f"engine http://{dead} unavailable" in log
        for text in (engines.text, metrics.text, log):
            assert LIVE_SECRET not in text and DEAD_SECRET not in text
    finally:
        gw.stop()
