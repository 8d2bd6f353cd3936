"""The auth cache: key hash -> what the key resolved to, per gateway replica, so an
ordinary request resolves its key with no Redis call. Entries are dropped by the
invalidation events (``steergate/gateway/tenancy/invalidation.py``) and expire after a TTL that
bounds staleness even if pub/sub were silently broken; a lookup that overlapped an
invalidation never caches (``generation``)."""

from __future__ import annotations

import time
from typing import Any


class AuthCache:
    """Replica-local key-hash -> resolved key cache with TTL and targeted drops.

    An entry is a tenant key (:class:`KeyMatch`: the tenant, the key's scopes, limits
    and expiry) or an admin key (:class:`AdminKey`). Expiry (``expires_at``, a rotated
    secret's grace end) is not an invalidation event: it is checked against the clock
    on every use of a cached entry, so it holds on every replica to the second.

    ``generation`` counts invalidations (drops and clears). A resolver reads it
    *before* its Redis lookup and hands it back to ``put``, which stores nothing if
    any invalidation arrived in between: the lookup may have read the key just
    before it was revoked, while the revocation's drop found no entry to remove, and
    storing it then would keep a revoked key alive for the whole TTL. The counter is
    cache-wide rather than per key because invalidations are rare and a skipped
    write costs only one more Redis read."""

    def __init__(self, ttl_s: float = 30.0) -> None:
        self.ttl_s = ttl_s
        self.generation = 0
        #: Set while the invalidation subscription is known dead (it went silent): the
        #: cache then neither answers nor stores, until the next subscribe resumes it.
        self.paused = False
        # key hash -> (KeyMatch | AdminKey, key_id, tenant_id ("" for admin keys), deadline)
        self._by_hash: dict[str, tuple[Any, str, str, float]] = {}

    def get(self, key_hash: str) -> Any:
        if self.paused:
            return None
        hit = self._by_hash.get(key_hash)
        if hit is None:
            return None
        if hit[3] < time.monotonic():
            self._by_hash.pop(key_hash, None)
            return None
        return hit[0]

    def put(self, key_hash: str, value: Any, key_id: str, tenant_id: str, generation: int) -> bool:
        """Store the entry unless an invalidation arrived since ``generation`` was
        read (before the lookup that produced it). Returns whether it was stored."""
        if generation != self.generation or self.paused:
            return False
        self._by_hash[key_hash] = (value, key_id, tenant_id, time.monotonic() + self.ttl_s)
        return True

    def drop_key(self, key_id: str) -> None:
        self.generation += 1
        for h in [h for h, entry in self._by_hash.items() if entry[1] == key_id]:
            self._by_hash.pop(h, None)

    def drop_tenant(self, tenant_id: str) -> None:
        self.generation += 1
        for h in [h for h, entry in self._by_hash.items() if entry[2] == tenant_id]:
            self._by_hash.pop(h, None)

    def clear(self) -> None:
        self.generation += 1
        self._by_hash.clear()

    def pause(self) -> None:
        """The invalidation subscription is known dead: forget every entry and cache
        nothing until :meth:`resume` (a revocation may be happening unheard)."""
        self.clear()
        self.paused = True

    def resume(self) -> None:
        """Subscribed again: events arrive from here on, so an entry cached from an
        earlier read may have missed its revocation; start empty."""
        self.clear()
        self.paused = False

    def __len__(self) -> int:
        return len(self._by_hash)
