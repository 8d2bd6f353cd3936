"""Auth-cache invalidation over Redis pub/sub (``keys.EVENTS_CHANNEL``): revocations,
rotations, limit changes and deletes are published as ``key:<id>`` / ``tenant:<id>``,
and a delete also as ``deleted:<id>``, on which every replica forgets what else it
keeps per tenant (``on_tenant_deleted``: its metric series). Every replica drops the
affected cache entries as the message arrives (well under 1 s), and clears its whole
cache whenever its subscription (re)connects, because messages sent while it was away
are lost. An expiry (a key's ``expires_at``, a rotated secret's grace end) is not an
event: it is checked against the clock on every use of a cached entry.

A subscription can also die in silence (a NAT or firewall that drops an idle
connection's packets without a reset, a partition of that one socket): nothing raises,
nothing arrives, and a revoked key was served for the rest of its 30 s cache life
(found from outside). So the listener PINGs its own subscription every
:data:`HEARTBEAT_S`; when nothing at all has arrived for :data:`SILENCE_S` it clears
the cache, stops caching until it has subscribed again, and reconnects. A healthy
subscription applies each event as it arrives (well under 1 s); a silent one is
noticed within about 2.5 s."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from steergate.gateway.store import key_names as keys
from steergate.gateway.store.connection import Redis, is_cluster
from steergate.gateway.tenancy.auth_cache import AuthCache

log = logging.getLogger("steergate.gateway.invalidation")


#: While the subscription stays lost, its warning is repeated at most this often.
LOST_LOG_INTERVAL_S = 30.0
#: The listener PINGs its subscription this often; every PONG proves it alive.
HEARTBEAT_S = 0.5
#: Nothing heard for this long (four PINGs unanswered): the subscription is dead, and a
#: revocation published after the silence began is applied (the cache cleared) within
#: about 2.5 s, not the 30 s of a cache entry's life. Shorter mistook a loaded machine
#: for a dead link (0.7 s did, on 2 busy cores: a cleared cache and a reconnect), and a
#: false alarm costs every cached key one Redis read.
SILENCE_S = 2.0


class SubscriptionSilent(Exception):
    """No PONG nor message for SILENCE_S on a connection that raised nothing."""


class Invalidations:
    """Publishes invalidation events and applies everyone's to ``cache``."""

    def __init__(self, redis: Redis, cache: AuthCache) -> None:
        self.redis = redis
        self.cache = cache
        #: Called with a deleted tenant's id, on every replica (set by the lifespan).
        self.on_tenant_deleted: list[Callable[[str], None]] = []

    async def publish(self, message: str) -> None:
        await self.redis.publish(keys.EVENTS_CHANNEL, message)

    def apply(self, message: str) -> None:
        kind, _, ident = message.partition(":")
        if kind == "key":
            self.cache.drop_key(ident)
        elif kind == "tenant":
            self.cache.drop_tenant(ident)
        elif kind == "deleted":
            self.cache.drop_tenant(ident)
            for forget in self.on_tenant_deleted:
                forget(ident)

    async def listen(self, stop: asyncio.Event) -> None:
        """Run until ``stop``: apply invalidation events; on every (re)subscribe clear
        the whole cache, since events published while disconnected are lost."""
        lost_since: float | None = None  # while the subscription is down
        warned_at = 0.0
        while not stop.is_set():
            pubsub = None
            try:
                if is_cluster(self.redis):
                    # A cluster client routes SUBSCRIBE by the channel's slot, which
                    # needs its slot map (loaded by its first command, or here).
                    await self.redis.initialize()
                pubsub = self.redis.pubsub()
                await pubsub.subscribe(keys.EVENTS_CHANNEL)
                self.cache.clear()
                heard = pinged = time.monotonic()
                while not stop.is_set():
                    msg = await pubsub.get_message(timeout=0.2)
                    now = time.monotonic()
                    if msg:
                        heard = now
                    elif now - heard > SILENCE_S:
                        raise SubscriptionSilent
                    if now - pinged >= HEARTBEAT_S:
                        await pubsub.ping()
                        pinged = now
                    kind = msg.get("type") if msg else None
                    if kind == "subscribe":
                        self.cache.resume()
                        if lost_since is not None:
                            log.warning(
                                "auth invalidation subscription back after %.0f s",
                                time.monotonic() - lost_since,
                            )
                            lost_since = None
                    elif kind == "message":
                        data = msg["data"]  # type: ignore[index]
                        self.apply(data.decode() if isinstance(data, bytes) else str(data))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # transport failure: reconnect (clears on resubscribe)
                # Entries stay usable meanwhile: no revocation can happen while Redis is
                # unreachable, and with fail-open set the cached keys keep serving. Not
                # after a silence: Redis may well be reachable, revoking, and unheard.
                if isinstance(exc, SubscriptionSilent):
                    self.cache.pause()
                # Retried every 0.25 s (revocations resume within a second of Redis's
                # return), but said once, then every LOST_LOG_INTERVAL_S: it was four
                # warnings a second for as long as Redis was down.
                now = time.monotonic()
                if lost_since is None or now - warned_at >= LOST_LOG_INTERVAL_S:
                    down = "" if lost_since is None else f" for {now - lost_since:.0f} s"
                    log.warning(
                        "auth invalidation subscription lost%s (%s); retrying",
                        down,
                        "silent: no reply to its PINGs" if isinstance(exc, SubscriptionSilent)
                        else type(exc).__name__,
                    )
                    warned_at = now
                lost_since = now if lost_since is None else lost_since
                if is_cluster(self.redis):  # the node may be gone: reload the slot map
                    with contextlib.suppress(Exception):
                        await self.redis.nodes_manager.initialize()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.25)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        await pubsub.aclose()
