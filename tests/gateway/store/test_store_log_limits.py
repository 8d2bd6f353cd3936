"""While Redis is down every request fails with 503 store_unavailable, and each failure
was logged: found from outside, 5,964 "redis unavailable" lines from one replica in
35 s of outage, a rate set by the clients' retries (a log that can fill a disk). It is
said once per 10 s now, with the count of what was held back."""

from __future__ import annotations

import asyncio
import logging

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from steergate.gateway.store.connection import connect, store_errors
from steergate.shared.errors import APIError
from tests.harness import free_port


async def test_an_outage_is_logged_once_per_interval_not_once_per_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = connect(f"redis://127.0.0.1:{free_port()}/0", 0.2)  # nothing listens there
    codes = []
    with caplog.at_level(logging.WARNING, logger="steergate"):
        for _ in range(200):
            try:
                async with store_errors():
                    await client.get("k")
            except APIError as exc:
                codes.append(exc.code)
        await asyncio.sleep(0)
    await client.aclose()
    assert codes == ["store_unavailable"] * 200  # every request is still told
    said = [r.getMessage() for r in caplog.records if "redis unavailable" in r.getMessage()]
    assert len(said) <= 1, said
    with pytest.raises(APIError):  # the class of failure is named when it is said
        async with store_errors():
            raise RedisConnectionError("down")
