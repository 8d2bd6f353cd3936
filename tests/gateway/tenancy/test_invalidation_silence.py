"""A subscription that dies in silence (found from outside): a proxy between a gateway
and Redis dropped the subscription's packets without closing it, as a NAT or firewall
does to an idle connection. Nothing raised, nothing arrived, and a key revoked on
another replica kept being served from this replica's cache for 28 s (its 30 s life).

The listener now PINGs its subscription: once it hears nothing for ``SILENCE_S`` it
clears the cache, stops caching until it has subscribed again, and reconnects. A real
redis-server, behind a TCP proxy that can freeze subscriptions."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from steergate.gateway.store import key_names as keys
from steergate.gateway.store.connection import connect
from steergate.gateway.tenancy.auth_cache import AuthCache
from steergate.gateway.tenancy.invalidation import SILENCE_S, Invalidations
from tests.harness import RedisProcess


class FreezingProxy:
    """TCP proxy to Redis; while ``frozen``, a connection that sent SUBSCRIBE has its
    bytes dropped both ways, and its socket stays open."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.frozen = False
        self.port = 0

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter,
                    conn: dict[str, bool], to_redis: bool) -> None:  # fmt: skip
        try:
            while data := await r.read(65536):
                if to_redis and b"SUBSCRIBE" in data.upper():
                    conn["subscriber"] = True
                if conn["subscriber"] and self.frozen:
                    continue  # dropped in silence
                w.write(data)
                await w.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            w.close()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        conn = {"subscriber": False}
        await asyncio.gather(self._pipe(cr, sw, conn, True), self._pipe(sr, cw, conn, False))

    @asynccontextmanager
    async def running(self) -> AsyncIterator[FreezingProxy]:
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        async with server:
            yield self
            server.close()


async def _until(check, within_s: float) -> float:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < within_s, "not within the time allowed"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def test_a_silent_subscription_is_noticed_and_the_cache_stops_serving_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    redis = RedisProcess().start()
    try:
        async with FreezingProxy(redis.port).running() as proxy:
            through_proxy = connect(f"redis://127.0.0.1:{proxy.port}/0", 1.0)
            direct = connect(redis.url, 1.0)  # another replica's connection
            cache = AuthCache()
            listener = Invalidations(through_proxy, cache)
            stop = asyncio.Event()
            with caplog.at_level(logging.WARNING, logger="steergate"):
                task = asyncio.create_task(listener.listen(stop))
                while (await direct.pubsub_numsub(keys.EVENTS_CHANNEL))[0][1] < 1:
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.3)  # its "subscribe" is read and applied
                assert cache.put("h1", "acme's key", "key_1", "acme", cache.generation)
                # Alive: PINGs are answered, so a quiet channel is not mistaken for death.
                await asyncio.sleep(3 * SILENCE_S)
                assert cache.get("h1") == "acme's key"
                proxy.frozen = True
                await asyncio.sleep(0.1)
                await direct.publish(keys.EVENTS_CHANNEL, "key:key_1")  # unheard
                took = await _until(lambda: cache.get("h1") is None, SILENCE_S + 2.0)
                assert took < SILENCE_S + 0.6, took  # it was the cache entry's 30 s
                assert cache.paused
                # While it is down, nothing is cached (a lookup would miss a revocation).
                assert not cache.put("h2", "v", "key_2", "acme", cache.generation)
                assert cache.get("h2") is None
                proxy.frozen = False  # the next subscription gets through
                await _until(lambda: not cache.paused, 5.0)
                assert cache.put("h2", "v", "key_2", "acme", cache.generation)
                await direct.publish(keys.EVENTS_CHANNEL, "key:key_2")
                await _until(lambda: cache.get("h2") is None, 1.0)
                stop.set()
                await asyncio.wait_for(task, 5)
            await through_proxy.aclose()
            await direct.aclose()
    finally:
        redis.stop()
    lost = [r.getMessage() for r in caplog.records if "subscription lost" in r.getMessage()]
    assert lost and "silent: no reply to its PINGs" in lost[0], lost
