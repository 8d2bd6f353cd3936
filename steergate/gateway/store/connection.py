"""The Redis connection: which client for which URL, its timeouts, and how store
failures become ``503 store_unavailable``.

``REDIS_URL`` unset -> fakeredis in this process (the embedded store of
``steergate up``): the same Lua scripts run on it, but it is per-process, so it is
logged loudly as single-replica only. ``redis+cluster://`` -> ``RedisCluster``.
Short socket timeouts bound every call, so an unreachable Redis answers 503 within
about a second instead of hanging a request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from steergate.shared.errors import APIError
from steergate.shared.log_limits import RateLimitedWarning

log = logging.getLogger("steergate.gateway.store")

Redis = Any  # redis.asyncio.Redis | RedisCluster | fakeredis.FakeAsyncRedis (same command API)

#: What a store call raises when Redis is down, hung or electing: a cluster client
#: raises RedisClusterException (not a RedisError) when no node is reachable.
STORE_FAILURES = (RedisError, RedisClusterException, OSError)


def connect(url: str | None, timeout_s: float, health_check_interval_s: float = 5.0) -> Redis:
    """A client for ``url``; nothing is contacted until the first command.

    A command that fails with a *connection* error (a pooled connection the server has
    closed, e.g. after a Redis restart) is sent once more on a fresh connection; a
    timeout never is (that would double the 503 bound). A resend only happens when the
    reply was lost, and everything the gateway sends survives one: reads, writes that
    set a value, and the scripts, which are idempotent (admit_request.lua by lease id,
    settle_request.lua by its lease). Idle connections are PINGed before reuse."""
    if not url:
        import fakeredis

        log.warning(
            "REDIS_URL is not set: using the EMBEDDED in-process store. Limits, keys and latch "
            "accounting are NOT shared with other gateway processes; use it for one process only."
        )
        return fakeredis.FakeAsyncRedis(decode_responses=True)
    common: dict[str, Any] = {
        # One immediate resend on a connection error only: redis-py's default (3 retries
        # with backoff, timeouts included) would turn a 0.5 s timeout into seconds.
        "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        "decode_responses": True,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
    }
    if url.startswith("redis+cluster://") or url.startswith("rediss+cluster://"):
        plain = url.replace("+cluster", "", 1)
        # No resend on a cluster: after a failed call the client reloads its slot map
        # (asking each known node in turn), which already costs up to a timeout per
        # unreachable node; a resend on top would double the time to the 503.
        common["retry"] = Retry(NoBackoff(), 0)
        cluster = BoundedRedisCluster.from_url(plain, **common)
        cluster.bound_s = 1.5 * timeout_s
        return cluster
    return aioredis.Redis.from_url(
        url, health_check_interval=health_check_interval_s, max_connections=256, **common
    )


class BoundedRedisCluster(RedisCluster):
    """A cluster client whose every command ends within ``bound_s``. A plain client
    is bounded by its socket timeout; a cluster client that loses a node also reloads
    its slot map, asking each known node in turn, so a hung cluster or an election
    could hold a request for a timeout per node. Past the bound the call raises
    redis' TimeoutError, which the request path answers as 503 store_unavailable."""

    bound_s: float = 1.5
    _ready: bool = False
    _first_use: asyncio.Lock | None = None

    async def _initialize_once(self) -> None:
        """Concurrent first commands on a fresh cluster client race in redis-py (each
        starts loading the slot map and opening connections; some fail with a
        ConnectionError): the first one loads it while the others wait."""
        if self._first_use is None:
            self._first_use = asyncio.Lock()
        async with self._first_use:
            if not self._ready:
                await self.initialize()
                self._ready = True

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            if not self._ready:
                await asyncio.wait_for(self._initialize_once(), self.bound_s)
            return await asyncio.wait_for(super().execute_command(*args, **kwargs), self.bound_s)
        except asyncio.TimeoutError as exc:
            raise RedisTimeoutError(f"cluster command over {self.bound_s:.1f} s") from exc
        except (AttributeError, TypeError) as exc:
            # A connection torn down under a command (a failover disconnects a dead
            # node's connections while other calls use them) leaks from redis-py as a
            # transport-internal error instead of ConnectionError (redis-py #4287):
            # it is a connection failure, the next call reconnects.
            raise RedisConnectionError(f"connection lost ({type(exc).__name__})") from exc


def is_cluster(redis: Redis) -> bool:
    """Whether ``redis`` is a Redis Cluster client (no multi-slot pipelines, sharded
    pub/sub)."""
    return isinstance(redis, RedisCluster)


#: Said once per interval, with a count: it was one line per failed request (found from
#: outside: 5,964 lines in 35 s of outage), which grows with the clients' retry rate.
_unavailable = RateLimitedWarning(interval=10.0, logger=log)


def store_unavailable() -> APIError:
    return APIError("store_unavailable", "The rate-limit store is unavailable; try again shortly.")


@asynccontextmanager
async def store_errors() -> AsyncIterator[None]:
    """Turn any Redis failure into 503 store_unavailable (never a 500 or a hang)."""
    try:
        yield
    except STORE_FAILURES as exc:
        _unavailable.warn("redis unavailable: %s", type(exc).__name__)
        raise store_unavailable() from exc
