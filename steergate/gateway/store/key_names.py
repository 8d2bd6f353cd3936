"""Every Redis key and channel name the gateway uses, built in one place.

Per-tenant keys carry the tenant id inside a ``{t:<id>}`` hash tag, so all of one
tenant's keys live in one Redis Cluster slot and a Lua script may touch any of
them atomically. Global keys (the tenant index, the API-key lookup) are only ever
used one at a time, never together with tenant keys in one script.
"""

from __future__ import annotations

import calendar
import functools
import time
from dataclasses import dataclass

PREFIX = "sg"

#: Pub/sub channel for auth-cache invalidation ("key:<key_id>", "tenant:<id>").
EVENTS_CHANNEL = f"{PREFIX}:events"
#: Set of every tenant id.
TENANT_INDEX = f"{PREFIX}:tenants"

#: How long a per-minute usage hash lives: the dashboard shows >= 60 minutes.
USAGE_MINUTE_TTL_S = 2 * 3600 + 120


def tag(tenant_id: str) -> str:
    """The Cluster hash tag that pins a tenant's keys to one slot."""
    return f"{{t:{tenant_id}}}"


def _t(tenant_id: str, suffix: str) -> str:
    return f"{PREFIX}:{tag(tenant_id)}:{suffix}"


def tenant_record(tenant_id: str) -> str:
    """String: the tenant's JSON record (incl. the secret cache salt)."""
    return _t(tenant_id, "tenant")


def tenant_keys(tenant_id: str) -> str:
    """Hash key_id -> JSON {prefix, created_at, hash}: the tenant's API keys (masked)."""
    return _t(tenant_id, "keys")


def key_lookup(key_hash: str) -> str:
    """String: HMAC(pepper, key) hex -> "<tenant_id> <key_id>". Global: the raw key
    does not say which tenant it belongs to."""
    return f"{PREFIX}:key:{key_hash}"


def key_owner(key_id: str) -> str:
    """String: key_id -> "<tenant_id> <key_hash>", so revoke needs only the id."""
    return f"{PREFIX}:keyid:{key_id}"


def gcra_requests(tenant_id: str) -> str:
    """String: theoretical arrival time (ms) of the requests/min GCRA."""
    return _t(tenant_id, "gcra:req")


def gcra_tokens(tenant_id: str) -> str:
    """String: theoretical arrival time (ms) of the tokens/min GCRA."""
    return _t(tenant_id, "gcra:tok")


def leases(tenant_id: str) -> str:
    """ZSET lease_id -> expiry ms: in-flight requests (crash-safe concurrency)."""
    return _t(tenant_id, "leases")


def usage_minute(tenant_id: str, minute: int) -> str:
    """Hash for one minute (unix seconds // 60): requests, tokens, 2xx/4xx/429/5xx."""
    return _t(tenant_id, f"usage:{minute}")


def usage_total(tenant_id: str) -> str:
    """Hash: all-time counters, same fields as a minute."""
    return _t(tenant_id, "usage:total")


def latches(tenant_id: str) -> str:
    """ZSET client conversation_id -> last use (ms): the tenant's latches by recency."""
    return _t(tenant_id, "latches")


#: Daily and monthly rollups (billing) are kept this long: 400 days and a margin.
USAGE_DAY_TTL_S = 401 * 86400
#: Counters of a rollup hash (usage_day / usage_month): admitted requests, the tokens and
#: status classes of settled ones (``tokens`` = prompt + completion: what a token budget
#: counts).
ROLLUP_COUNTERS = ("requests", "prompt_tokens", "completion_tokens", "tokens", "2xx", "4xx", "5xx")
#: Admission refusals are counted as ``429:<cause>`` (``steergate/gateway/admission/refusals.py``).
#: A day hash holds the tenant's fields, then the same per API key as ``k:<key_id>:<field>``.
ROLLUP_KEY_PREFIX = "k:"


def usage_day(tenant_id: str, day: int) -> str:
    """Hash for one UTC day (unix seconds // 86400): the rollup counters and refusals,
    the tenant's and each key's, kept 400 days."""
    return _t(tenant_id, f"usage:day:{day}")


def usage_month(tenant_id: str, month: int) -> str:
    """Hash for one UTC calendar month (year * 12 + month - 1): the rollup counters,
    tenant totals only; what a ``"month"`` token budget reads."""
    return _t(tenant_id, f"usage:month:{month}")


def key_gcra(tenant_id: str, key_id: str) -> str:
    """String: TAT (ms) of one API key's own requests/min GCRA (per-key ``rpm``)."""
    return _t(tenant_id, f"key:{key_id}:gcra")


def leases_done(tenant_id: str) -> str:
    """ZSET lease_id -> expiry ms: leases of finished requests, released from
    :func:`leases` (no longer counted against concurrency) before their settlement
    reached Redis; the settlement still finds them there to charge exactly once."""
    return _t(tenant_id, "leases:done")


def budget_held(tenant_id: str) -> str:
    """String: Σ tokens reserved by the tenant's admitted requests that count against its
    token budget and have not settled (their lease ids end in ``~<tokens>``,
    ``steergate/gateway/admission/limits.py``). Lives exactly as long as :func:`leases`."""
    return _t(tenant_id, "budget:held")


def key_leases(tenant_id: str, key_id: str) -> str:
    """ZSET lease_id -> expiry ms: one API key's in-flight requests (per-key
    ``max_concurrency``)."""
    return _t(tenant_id, f"key:{key_id}:leases")


def latch_info(tenant_id: str) -> str:
    """Hash client conversation_id -> :class:`LatchEntry` (the digest and names are
    written once the engine has stored the latch, with its spec)."""
    return _t(tenant_id, "latch:info")


@dataclass(frozen=True)
class LatchEntry:
    """One value of :func:`latch_info`: ``"<bytes>:<kind>:<digest>[:<names>]"`` once the
    latch is recorded, ``"<bytes>:<kind>[;<names>]"`` while a turn is storing it (pending).

    ``names``: the tenant's vectors the latch steers with (comma-separated client names,
    which never hold ``:``, ``;`` or ``,``), so admission returns their current digests
    in its one call and the engine is told what content to bridge with. A pending entry
    names those of the latch being stored and of the one before it: an engine may hold
    either while the turn runs. The Lua scripts read it with their own patterns (a
    recorded entry matches ``^%d+:%a+:``, a pending one does not); Python reads it only
    here."""

    nbytes: int = 0
    kind: str = "ref"
    #: "" until the engine has stored the latch and the gateway recorded it.
    digest: str = ""
    #: The named vectors the latch references (adds and clamps), in first-use order.
    names: tuple[str, ...] = ()

    @classmethod
    def parse(cls, info: str | None) -> LatchEntry:
        """The entry ``info`` holds; ``None`` or "" (no latch) is zero bytes."""
        head, _, rest = (info or "").partition(":")
        rest, _, pending_names = rest.partition(";")
        kind, _, rest = rest.partition(":")
        digest, _, names = rest.partition(":")
        return cls(
            int(head) if head.isdigit() else 0,
            kind or "ref",
            digest,
            tuple(n for n in (names or pending_names).split(",") if n),
        )

    def __str__(self) -> str:
        out = f"{self.nbytes}:{self.kind}"
        names = ",".join(self.names)
        if self.digest:
            return out + f":{self.digest}" + (f":{names}" if names else "")
        return out + (f";{names}" if names else "")


def latch_bytes(tenant_id: str) -> str:
    """String: Σ bytes of the tenant's latches (kept by the scripts)."""
    return _t(tenant_id, "latch:bytes")


def latch_specs(tenant_id: str) -> str:
    """Hash client conversation_id -> the latch's spec (``shared.latch_spec``, engine-side
    names): what restores the latch on any engine. The system of record for latches."""
    return _t(tenant_id, "latch:specs")


def vectors(tenant_id: str) -> str:
    """Hash client vector name -> JSON metadata {digest, bytes, layers, hook, ...}."""
    return _t(tenant_id, "vectors")


def vector_data(tenant_id: str) -> str:
    """Hash client vector name -> JSON body of the engine's vector PUT ({hook, packed,
    description?}): what installs the vector on any engine. The system of record."""
    return _t(tenant_id, "vectors:data")


def utc_day(now_s: float) -> int:
    """The rollup day of a unix time: days since 1970-01-01 UTC."""
    return int(now_s // 86400)


def utc_month(now_s: float) -> int:
    """The rollup month of a unix time: year * 12 + month - 1 (UTC)."""
    t = time.gmtime(now_s)
    return t.tm_year * 12 + t.tm_mon - 1


def period_end_s(now_s: float, period: str) -> int:
    """When the UTC day (``"day"``) or calendar month (``"month"``) holding ``now_s``
    ends, in unix seconds: where a token budget renews."""
    if period == "day":
        return (utc_day(now_s) + 1) * 86400
    year, index = divmod(utc_month(now_s) + 1, 12)  # the next month
    return calendar.timegm((year, index + 1, 1, 0, 0, 0))


@functools.lru_cache(maxsize=4096)
def admit_keys(tenant_id: str, minute: int, key_id: str = "") -> tuple[str, ...]:
    """KEYS of admit_request.lua and settle_request.lua, in their order (the day and
    month are those of ``minute``). Cached: every request of a tenant's key in the same
    minute names the same keys, twice (admission and settlement)."""
    now_s = minute * 60
    return (
        gcra_requests(tenant_id),
        gcra_tokens(tenant_id),
        leases(tenant_id),
        usage_minute(tenant_id, minute),
        usage_total(tenant_id),
        latches(tenant_id),
        latch_info(tenant_id),
        latch_bytes(tenant_id),
        latch_specs(tenant_id),
        vectors(tenant_id),
        usage_day(tenant_id, utc_day(now_s)),
        usage_month(tenant_id, utc_month(now_s)),
        key_gcra(tenant_id, key_id),
        key_leases(tenant_id, key_id),
        leases_done(tenant_id),
        budget_held(tenant_id),
    )


def latch_keys(tenant_id: str) -> list[str]:
    """KEYS of drop_latch.lua and keep_latch.lua, in their order."""
    return [
        latches(tenant_id),
        latch_info(tenant_id),
        latch_bytes(tenant_id),
        latch_specs(tenant_id),
    ]


def vector_keys(tenant_id: str) -> list[str]:
    """KEYS of put_vector.lua and drop_vector.lua, in their order."""
    return [vectors(tenant_id), vector_data(tenant_id)]


def tenant_state_keys(tenant_id: str, now_minute: int) -> list[str]:
    """Every key a tenant can own except its record, for delete and for a create over
    what an earlier tenant of the id left (usage minutes: the TTL window)."""
    window = USAGE_MINUTE_TTL_S // 60 + 2
    fixed = [
        key_last_used(tenant_id),
        tenant_keys(tenant_id),
        gcra_requests(tenant_id),
        gcra_tokens(tenant_id),
        leases(tenant_id),
        leases_done(tenant_id),
        budget_held(tenant_id),
        usage_total(tenant_id),
        latches(tenant_id),
        latch_info(tenant_id),
        latch_bytes(tenant_id),
        latch_specs(tenant_id),
        vectors(tenant_id),
        vector_data(tenant_id),
    ]
    minutes = [usage_minute(tenant_id, m) for m in range(now_minute - window, now_minute + 2)]
    # Rollups go with the tenant (a recreated id starts with no history); per-key GCRA
    # and lease sets expire on their own.
    today, month = utc_day(now_minute * 60), utc_month(now_minute * 60)
    days = [usage_day(tenant_id, d) for d in range(today - USAGE_DAY_TTL_S // 86400, today + 2)]
    months = [usage_month(tenant_id, m) for m in range(month - 14, month + 2)]
    return fixed + minutes + days + months


# -- keys, admin keys and audit (issue 13) ---------------------------------------------


def key_last_used(tenant_id: str) -> str:
    """Hash key_id -> unix seconds of the key's last authenticated use. Written only by
    the replicas' batched background flush (``steergate.gateway.tenancy.key_last_use``),
    never per request."""
    return _t(tenant_id, "keys:used")


#: Hash admin key_id -> JSON {prefix, role, name, created_at, created_by, hash}. Global.
ADMIN_KEYS = f"{PREFIX}:admin:keys"


def admin_key_lookup(key_hash: str) -> str:
    """String: HMAC(pepper, admin key) hex -> admin key_id. Global."""
    return f"{PREFIX}:admin:key:{key_hash}"


#: Stream of admin writes (``steergate.gateway.tenancy.audit``), capped with XADD MAXLEN ~.
#: Global, one key per command.
AUDIT_STREAM = f"{PREFIX}:audit"
