"""A tenant's usage, read from the keys the limiter scripts keep (see
``steergate/gateway/store/key_names.py``).

Nothing here keeps its own counters for requests, tokens or statuses: the numbers
are the limiter's own state, so what ``/v1/usage``, the dashboard and ``/metrics``
show is exactly what admission decides on, and it is the same on every replica.

* requests/min and tokens/min ``used``: the *bucket fill*, how much of the GCRA window
  is taken (named so in the API's schema; requests *made* are ``requests_made``), i.e.
  ``ceil((TAT - now) / interval)`` with ``interval = 60 s / limit``. It drains
  continuously at ``limit`` per minute; at ``used == limit`` the next request is
  refused. (Tokens include reservations of requests still running.)
* concurrency: unexpired leases; latches: the latch ZSET and byte total; vectors:
  the vector hash (count and Σ ``bytes``).
* responses and history: the per-minute hashes ``usage:<minute>`` (fields
  ``requests`` — admitted —, ``tokens``, ``2xx``, ``4xx``, ``429``, ``5xx``).
  ``429`` is kept apart from ``4xx``. These count what the limiter admits and
  settles: inference requests and vector uploads, not reads or admin calls.
* rejections: the cause of each 429 is not in the limiter's minute and total hashes;
  :func:`record_rejection` (called by the metrics middleware for every 429 a tenant
  gets) adds ``429:<cause>`` fields (``gateway/refusals.py``; shown by error code).
  Inference 429s the limiter counted without a recorded cause are shown as
  ``unattributed`` rather than hidden. Vector uploads
  are admitted and settled like inference requests, so their 429s count too.
* budget and export (billing): the daily and monthly rollup hashes
  (``usage:day:<day>``, ``usage:month:<month>``: ``keys.ROLLUP_COUNTERS`` and
  ``429:<cause>``) that settlement and admission keep; see the "rollups" section below.
"""

from __future__ import annotations

import csv
import datetime
import io
import math
import re
import time
from collections.abc import Sequence
from typing import Any, Literal

import orjson
from pydantic import BaseModel, Field

from steergate.gateway.admission import refusals
from steergate.gateway.admission.refusals import Refusal
from steergate.gateway.store import key_names as keys
from steergate.gateway.store.connection import Redis, store_errors
from steergate.gateway.tenancy.records import Limits, Tenant
from steergate.shared.errors import InvalidField

HISTORY_MINUTES = 60
STATUS_CLASSES = ("2xx", "4xx", "429", "5xx")
PERIOD_MS = 60_000


class QuotaUse(BaseModel):
    used: int
    limit: int


class UsageMinute(BaseModel):
    """One minute of a tenant's traffic; ``minute`` is its start (unix seconds)."""

    minute: int
    requests: int = 0
    tokens: int = 0
    counts: dict[str, int] = Field(default_factory=dict, description="2xx, 4xx, 429, 5xx")


class RequestsMade(BaseModel):
    """Requests the limiter admitted (made, whatever their answer), not bucket fill."""

    this_minute: int = Field(description="since the start of the current clock minute")
    window: int = Field(description="in the last window_minutes")
    total: int = Field(description="since the tenant was created")


QUOTAS_DESCRIPTION = (
    "used/limit per quota. requests_per_minute and tokens_per_minute: the rate "
    "limiter's bucket fill, i.e. how much of the one-minute allowance is taken now (it "
    "drains continuously; at used == limit the next request gets 429) -- not a count of "
    "requests made (see requests_made). concurrency: requests in flight. latch_count, "
    "latch_bytes, vector_count, vector_bytes: what is stored."
)


class BudgetUse(BaseModel):
    """The tenant's token budget (``limits.token_budget``) in the current UTC period."""

    tokens: int = Field(description="tokens per period (the limit)")
    period: Literal["day", "month"]
    used: int = Field(description="tokens charged in the current period (prompt + completion)")
    remaining: int = Field(description="max(0, tokens - used)")
    resets_at: int = Field(description="unix seconds: start of the next UTC day or month")


class TenantUsage(BaseModel):
    tenant_id: str
    name: str = ""
    limits: Limits
    quotas: dict[str, QuotaUse] = Field(description=QUOTAS_DESCRIPTION)
    requests_made: RequestsMade = Field(
        default_factory=lambda: RequestsMade(this_minute=0, window=0, total=0),
        description="requests admitted: inference, vector uploads, models and tokenizer calls",
    )
    window_minutes: int = HISTORY_MINUTES
    responses: dict[str, int] = Field(description="2xx/4xx/429/5xx in the last window_minutes")
    responses_total: dict[str, int] = Field(
        description="2xx/4xx/429/5xx since the tenant was created"
    )
    tokens_total: int = Field(default=0, description="tokens charged since the tenant was created")
    rejections: dict[str, int] = Field(description="429s by error code in the last window_minutes")
    history: list[UsageMinute] | None = Field(
        default=None, description="oldest first, one per minute"
    )
    budget: BudgetUse | None = Field(
        default=None, description="the token budget in its current period; null: none set"
    )


def gcra_used(tat_ms: float | None, now_ms: int, limit: int) -> int:
    """How much of a GCRA's one-minute window is taken at ``now_ms``."""
    if tat_ms is None or tat_ms <= now_ms or limit <= 0:
        return 0
    interval = PERIOD_MS / limit
    return min(limit, math.ceil((tat_ms - now_ms) / interval - 1e-9))


def now_ms() -> int:
    """The gateway's clock, as the scripts see it (they take ``now`` from the caller)."""
    return int(time.time() * 1000)


def _int(value: Any) -> int:
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return 0


def _vector_totals(rows: Sequence[str]) -> tuple[int, int]:
    total = 0
    for raw in rows:
        try:
            total += _int(orjson.loads(raw).get("bytes"))
        except (orjson.JSONDecodeError, AttributeError):
            continue
    return len(rows), total


def _counts(row: dict[str, Any]) -> dict[str, int]:
    return {c: _int(row.get(c)) for c in STATUS_CLASSES}


def _rejections(row: dict[str, Any]) -> dict[str, int]:
    """429s by error code: every ``429:<cause>`` field (and the older ``429:<code>``
    naming), causes this version does not know included."""
    out = dict.fromkeys(refusals.CODES, 0)
    for field, value in row.items():
        code = refusals.code_of_field(field)
        if code is not None:
            out[code] = out.get(code, 0) + _int(value)
    attributed = sum(out.values())
    unattributed = _int(row.get("429")) - attributed
    if unattributed > 0:
        out["unattributed"] = unattributed
    return out


async def read_usage(
    redis: Redis,
    tenant: Tenant,
    now_ms: int,
    *,
    history: bool = True,
    minutes: int = HISTORY_MINUTES,
) -> TenantUsage:
    """One tenant's usage in one pipelined round trip (all keys share its slot)."""
    tid, lim = tenant.id, tenant.limits
    current = now_ms // PERIOD_MS
    window = list(range(current - minutes + 1, current + 1))
    async with store_errors():
        pipe = redis.pipeline(transaction=False)
        pipe.get(keys.gcra_requests(tid))
        pipe.get(keys.gcra_tokens(tid))
        pipe.zcount(keys.leases(tid), f"({now_ms}", "+inf")
        pipe.zcard(keys.latches(tid))
        pipe.get(keys.latch_bytes(tid))
        pipe.hvals(keys.vectors(tid))
        pipe.hgetall(keys.usage_total(tid))
        for minute in window:
            pipe.hgetall(keys.usage_minute(tid, minute))
        budget_key, resets_at = (
            budget_period(tid, lim.token_budget.period, now_ms) if lim.token_budget else ("", 0)
        )
        if budget_key:
            pipe.hget(budget_key, "tokens")
        r = await pipe.execute()
    tat_req, tat_tok, inflight, latch_count, latch_bytes, vector_rows, total = r[:7]
    minute_rows: list[dict[str, Any]] = [row or {} for row in r[7 : 7 + len(window)]]
    budget = None
    if lim.token_budget is not None:
        spent = max(0, _int(r[7 + len(window)]))
        budget = BudgetUse(
            tokens=lim.token_budget.tokens,
            period=lim.token_budget.period,
            used=spent,
            remaining=max(0, lim.token_budget.tokens - spent),
            resets_at=resets_at,
        )
    vector_count, vector_bytes = _vector_totals(vector_rows)
    quotas = {
        "requests_per_minute": QuotaUse(
            used=gcra_used(_float(tat_req), now_ms, lim.rpm), limit=lim.rpm
        ),
        "tokens_per_minute": QuotaUse(
            used=gcra_used(_float(tat_tok), now_ms, lim.tpm), limit=lim.tpm
        ),
        "concurrency": QuotaUse(used=_int(inflight), limit=lim.max_concurrency),
        "latch_count": QuotaUse(used=_int(latch_count), limit=lim.latch_count),
        "latch_bytes": QuotaUse(used=max(0, _int(latch_bytes)), limit=lim.latch_bytes),
        "vector_count": QuotaUse(used=vector_count, limit=lim.vector_count),
        "vector_bytes": QuotaUse(used=vector_bytes, limit=lim.vector_bytes),
    }
    summed: dict[str, int] = {}
    for row in minute_rows:
        for field, value in row.items():
            summed[field] = summed.get(field, 0) + _int(value)
    return TenantUsage(
        tenant_id=tid,
        name=tenant.name,
        limits=lim,
        quotas=quotas,
        window_minutes=minutes,
        responses=_counts(summed),
        requests_made=RequestsMade(
            this_minute=_int(minute_rows[-1].get("requests")) if minute_rows else 0,
            window=summed.get("requests", 0),
            total=_int((total or {}).get("requests")),
        ),
        responses_total=_counts(total or {}),
        tokens_total=_int((total or {}).get("tokens")),
        rejections=_rejections(summed),
        history=[
            UsageMinute(
                minute=m * 60,
                requests=_int(row.get("requests")),
                tokens=_int(row.get("tokens")),
                counts=_counts(row),
            )
            for m, row in zip(window, minute_rows, strict=True)
        ]
        if history
        else None,
        budget=budget,
    )


def _float(value: Any) -> float | None:
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


async def record_rejection(redis: Redis, tenant_id: str, refusal: Refusal, now_ms: int) -> None:
    """Count one 429's cause (``refusal.field``) next to the ``429`` field (minute and
    total) that the limiter script or settlement counts.

    Those count every 429 but not why; the metrics middleware calls this with the
    refusal the request state carries, so the dashboard can show 429s by cause."""
    minute_key = keys.usage_minute(tenant_id, now_ms // PERIOD_MS)
    async with store_errors():
        pipe = redis.pipeline(transaction=False)
        pipe.hincrby(minute_key, refusal.field, 1)
        pipe.expire(minute_key, keys.USAGE_MINUTE_TTL_S)
        pipe.hincrby(keys.usage_total(tenant_id), refusal.field, 1)
        await pipe.execute()


# ---------------------------------------------------------------------------- rollups
#
# Daily and monthly rollups (``keys.usage_day`` / ``keys.usage_month``, fields
# ``keys.ROLLUP_COUNTERS``) are written by admission (requests, and each 429 as
# ``429:<cause>``) and by settlement (tokens and status classes); the same per API key as
# ``k:<key_id>:<field>`` (day hashes only). A month hash holds the tenant's totals and
# is what a ``"month"`` token budget reads; a day hash, a ``"day"`` one.

_EPOCH = datetime.date(1970, 1, 1)


def budget_period(tenant_id: str, period: str, now_ms: int) -> tuple[str, int]:
    """The rollup hash a ``period`` budget reads now, and when that period ends (unix s)."""
    now_s = now_ms / 1000
    rollup = (
        keys.usage_day(tenant_id, keys.utc_day(now_s))
        if period == "day"
        else keys.usage_month(tenant_id, keys.utc_month(now_s))
    )
    return rollup, keys.period_end_s(now_s, period)


# ---------------------------------------------------------------------------- export

EXPORT_DEFAULT_DAYS = 30
EXPORT_MAX_DAYS = 400
GROUP_BY = ("day", "key")
FORMATS = ("json", "csv")
#: Every export row's counter columns: the rollup counters, all 429s, then 429s by cause.
EXPORT_COUNTERS = (
    *keys.ROLLUP_COUNTERS,
    "429",
    *(f"429_{cause}" for cause in refusals.LIMITER_CAUSES),
)
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def day_of(text: str, param: str) -> int:
    """A ``YYYY-MM-DD`` (UTC) date as a rollup day; 400 invalid_request naming ``param``."""
    if not _DATE.fullmatch(text):
        raise InvalidField(param, f"'{param}' must be a date YYYY-MM-DD (UTC)")
    try:
        date = datetime.date.fromisoformat(text)
    except ValueError:
        raise InvalidField(param, f"'{param}' is not a valid date") from None
    if date < _EPOCH:
        raise InvalidField(param, f"'{param}' must be 1970-01-01 or later")
    return (date - _EPOCH).days


def date_of(day: int) -> str:
    return (_EPOCH + datetime.timedelta(days=day)).isoformat()


def export_range(start: str | None, end: str | None, now_s: float) -> tuple[int, int]:
    """``(first_day, last_day)``, both inclusive, of an export request. Defaults: ``end``
    today (UTC), ``start`` 29 days before ``end`` (30 days), never before 1970-01-01.
    At most 400 days."""
    last = day_of(end, "end") if end is not None else keys.utc_day(now_s)
    first = (
        day_of(start, "start") if start is not None else max(0, last - EXPORT_DEFAULT_DAYS + 1)
    )
    if last < first:
        raise InvalidField("end", "'end' is before 'start'")
    if last - first + 1 > EXPORT_MAX_DAYS:
        raise InvalidField(
            "start", f"at most {EXPORT_MAX_DAYS} days per export (start to end, inclusive)"
        )
    return first, last


def check_choice(value: str | None, choices: Sequence[str], param: str) -> str:
    if value is None:
        return choices[0]
    if value not in choices:
        raise InvalidField(param, f"'{param}' must be one of: {', '.join(choices)}")
    return value


#: Day hashes per round trip of an export's read.
ROLLUP_DAYS_PER_TRIP = 31


async def read_rollup_days(
    redis: Redis, tenant_id: str, first_day: int, last_day: int
) -> list[dict[str, Any]]:
    """The day hashes ``first_day..last_day`` (oldest first), :data:`ROLLUP_DAYS_PER_TRIP`
    per pipelined round trip: the client parses each reply on the event loop, and a
    400-day reply in one piece held it for ~55 ms (one tenant's keys share a slot, so
    this works on Redis Cluster too)."""
    rows: list[dict[str, Any]] = []
    async with store_errors():
        for lo in range(first_day, last_day + 1, ROLLUP_DAYS_PER_TRIP):
            pipe = redis.pipeline(transaction=False)
            for day in range(lo, min(lo + ROLLUP_DAYS_PER_TRIP, last_day + 1)):
                pipe.hgetall(keys.usage_day(tenant_id, day))
            rows.extend(row or {} for row in await pipe.execute())
    return rows


def _split_rollup(row: dict[str, Any]) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """A rollup hash -> (tenant fields, {key_id: that key's fields})."""
    tenant: dict[str, int] = {}
    per_key: dict[str, dict[str, int]] = {}
    for field, value in row.items():
        if field.startswith(keys.ROLLUP_KEY_PREFIX):
            key_id, sep, rest = field[len(keys.ROLLUP_KEY_PREFIX) :].partition(":")
            if key_id and sep and rest:
                per_key.setdefault(key_id, {})[rest] = _int(value)
        else:
            tenant[field] = _int(value)
    return tenant, per_key


def _counter_row(fields: dict[str, int]) -> dict[str, int]:
    row = {name: fields.get(name, 0) for name in keys.ROLLUP_COUNTERS}
    # Every 429:<cause> counts in "429", causes this version does not name included.
    row["429"] = sum(v for f, v in fields.items() if f.startswith(refusals.FIELD_PREFIX))
    for cause in refusals.LIMITER_CAUSES:
        row[f"429_{cause}"] = fields.get(refusals.BY_CAUSE[cause].field, 0)
    return row


def export_columns(group_by: str) -> list[str]:
    return ["date", *(["key_id"] if group_by == "key" else []), *EXPORT_COUNTERS]


def export_doc(
    tenant_id: str,
    first_day: int,
    rollups: Sequence[dict[str, Any]],
    group_by: str,
) -> dict[str, Any]:
    """The export's JSON. ``group_by="day"``: one row per day of the range, zeros
    included. ``"key"``: one row per (day, API key) with traffic that day, by date then
    key id. ``totals``: the tenant's totals over the range (either grouping)."""
    rows: list[dict[str, Any]] = []
    totals = dict.fromkeys(EXPORT_COUNTERS, 0)
    for offset, rollup in enumerate(rollups):
        date = date_of(first_day + offset)
        tenant_fields, per_key = _split_rollup(rollup)
        day_row = _counter_row(tenant_fields)
        for name, value in day_row.items():
            totals[name] += value
        if group_by == "day":
            rows.append({"date": date, **day_row})
        else:
            for key_id in sorted(per_key):
                rows.append({"date": date, "key_id": key_id, **_counter_row(per_key[key_id])})
    return {
        "object": "usage_export",
        "tenant_id": tenant_id,
        "start": date_of(first_day),
        "end": date_of(first_day + len(rollups) - 1),
        "group_by": group_by,
        "columns": export_columns(group_by),
        "rows": rows,
        "totals": totals,
    }


def export_csv(doc: dict[str, Any]) -> str:
    """The export's rows as CSV: a header row (``doc["columns"]``), then one line per row."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    columns = doc["columns"]
    writer.writerow(columns)
    for row in doc["rows"]:
        writer.writerow([row[c] for c in columns])
    return out.getvalue()
