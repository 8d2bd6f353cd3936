"""The audit log: every admin write, who made it, when, and what changed.

One Redis stream, ``keys.AUDIT_STREAM`` (``sg:audit``), global and only ever used one
key per command. Each entry is its stream id (``time`` is the id's milliseconds: the
Redis server's clock, which ``since`` is compared with), ``actor``
(the admin key id, or ``bootstrap`` for ``STEERGATE_ADMIN_KEY``), ``role``, ``action``
(``tenant.create`` ...), ``target`` (a tenant id or a key id), ``fields`` (JSON: what
the write set or changed) and ``request_id``. Entries never hold a secret or a key
hash: callers pass only public fields, and :func:`clean` drops any field whose name
says secret, for defence in depth.

Bounded: ``XADD MAXLEN ~ MAXLEN`` keeps about the last 100 000 entries (Redis trims
whole stream nodes, so the length may exceed the cap by up to one node, 100 entries
by default). At a few hundred bytes an entry that is a few tens of MiB at most.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

from steergate.gateway.store import key_names as keys
from steergate.gateway.store.connection import Redis, store_errors

#: Approximate cap on the stream's length (XADD MAXLEN ~).
MAXLEN = 100_000
#: ``GET /admin/audit``: default and largest ``limit``.
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000

ACTIONS = (
    "tenant.create",
    "tenant.update",
    "tenant.delete",
    "key.create",
    "key.revoke",
    "key.rotate",
    "admin_key.create",
    "admin_key.revoke",
)
#: Field names never written (whatever a caller passes): secrets and key hashes.
_SECRET_NAMES = frozenset({"key", "secret", "cache_salt", "pepper", "password"})


def clean(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` without anything that could be key material (recursively)."""
    out: dict[str, Any] = {}
    for name, value in fields.items():
        lowered = str(name).lower()
        if lowered in _SECRET_NAMES or lowered.endswith("hash"):
            continue
        out[name] = clean(value) if isinstance(value, dict) else value
    return out


class AuditLog:
    def __init__(self, redis: Redis, maxlen: int = MAXLEN) -> None:
        self.redis = redis
        self.maxlen = maxlen

    async def record(
        self,
        *,
        actor: str,
        role: str,
        action: str,
        target: str,
        fields: dict[str, Any] | None = None,
        request_id: str | None = None,
    ) -> str:
        """Append one entry; returns its stream id."""
        assert action in ACTIONS, action
        entry = {
            "actor": actor,
            "role": role,
            "action": action,
            "target": target,
            "fields": orjson.dumps(clean(fields or {})).decode(),
            "request_id": request_id or "",
        }
        async with store_errors():
            return str(
                await self.redis.xadd(
                    keys.AUDIT_STREAM, entry, maxlen=self.maxlen, approximate=True
                )
            )

    async def read(self, *, since: float | None, limit: int) -> list[dict[str, Any]]:
        """Newest first: at most ``limit`` entries at or after ``since`` (unix seconds)."""
        # (Clamped: a since far in the future simply finds nothing.)
        low = "-" if since is None else str(max(0, math.ceil(min(since, 1e13) * 1000)))
        async with store_errors():
            rows = await self.redis.xrevrange(keys.AUDIT_STREAM, max="+", min=low, count=limit)
        return [decode(stream_id, data) for stream_id, data in rows]


def decode(stream_id: str, data: dict[str, str]) -> dict[str, Any]:
    try:
        fields = orjson.loads(data.get("fields") or "{}")
    except orjson.JSONDecodeError:
        fields = {}
    return {
        "id": stream_id,
        "time": int(stream_id.split("-", 1)[0]) / 1000.0,
        "actor": data.get("actor", ""),
        "role": data.get("role", ""),
        "action": data.get("action", ""),
        "target": data.get("target", ""),
        "fields": fields,
        "request_id": data.get("request_id") or None,
    }
