"""The auth-invalidation listener while Redis is away: it keeps retrying (so revocations
resume within a second of Redis's return) but says so once, not four times a second
(found from outside: 57 warnings in 15 s, for as long as Redis was down)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from steergate.gateway.store.connection import connect
from steergate.gateway.tenancy.auth_cache import AuthCache
from steergate.gateway.tenancy.invalidation import Invalidations
from tests.harness import free_port


async def test_a_lost_subscription_is_retried_often_but_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = connect(f"redis://127.0.0.1:{free_port()}/0", 0.2)  # nothing listens there
    listener = Invalidations(client, AuthCache())
    stop = asyncio.Event()
    attempts = 0
    real_pubsub = client.pubsub

    def counting_pubsub() -> object:
        nonlocal attempts
        attempts += 1
        return real_pubsub()

    client.pubsub = counting_pubsub  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="steergate"):
        task = asyncio.create_task(listener.listen(stop))
        await asyncio.sleep(2.0)
        stop.set()
        await asyncio.wait_for(task, 5)
    await client.aclose()
    lost = [r for r in caplog.records if "subscription lost" in r.getMessage()]
    assert attempts >= 4  # still retried every 0.25 s
    assert len(lost) == 1, [r.getMessage() for r in lost]
