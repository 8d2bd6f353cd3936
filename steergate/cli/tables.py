"""Terminal tables for ``steergate tenant|key|usage`` (rich), kept apart from the
argument parsing and HTTP in ``gateway.admin_cli``.

Only masked key prefixes are ever rendered here; the one full key the CLI prints
(just created) is printed by ``admin_cli`` itself.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from rich.console import Console
from rich.table import Table

from steergate.gateway.admission.units import format_bytes, format_percent


def console(stderr: bool = False) -> Console:
    """Where every ``steergate`` command prints: the gateway's data as text, never rich
    markup or emoji codes ("[/]" in a tenant name crashed a table, "[link=…]" became a
    link), no highlighting. Standard output that is not a terminal (a pipe, a file, CI)
    has no width to fit, so tables are never cut or wrapped at rich's default of 80."""
    if stderr:
        return Console(stderr=True, highlight=False, markup=False, emoji=False)
    return Console(
        highlight=False,
        markup=False,
        emoji=False,
        soft_wrap=False,
        width=None if sys.stdout.isatty() else 10_000,
    )

QUOTAS: tuple[tuple[str, str, bool], ...] = (
    # usage key, column title, is a byte quantity
    # rpm/tpm "used" is the rate limiter's bucket fill, not requests made (see usage.py)
    ("requests_per_minute", "req/min bucket", False),
    ("tokens_per_minute", "tok/min bucket", False),
    ("concurrency", "concurrent", False),
    ("latch_count", "latches", False),
    ("latch_bytes", "latch bytes", True),
    ("vector_count", "vectors", False),
    ("vector_bytes", "vector bytes", True),
)
SPARK = " ▁▂▃▄▅▆▇█"


def fmt_count(value: Any) -> str:
    return "-" if value is None else f"{value:,}" if isinstance(value, int) else str(value)


def tenant_table(tenants: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in (
        "id",
        "name",
        "rpm",
        "tpm",
        "conc",
        "latches",
        "latch bytes",
        "vectors",
        "vector bytes",
        "latch policy",
    ):
        table.add_column(col, no_wrap=col in ("id", "latch policy"))
    for t in tenants:
        lim = t.get("limits", {})
        table.add_row(
            str(t.get("id")),
            str(t.get("name") or ""),
            fmt_count(lim.get("rpm")),
            fmt_count(lim.get("tpm")),
            fmt_count(lim.get("max_concurrency")),
            fmt_count(lim.get("latch_count")),
            format_bytes(lim.get("latch_bytes")),
            fmt_count(lim.get("vector_count")),
            format_bytes(lim.get("vector_bytes")),
            str(lim.get("latch_policy", "-")),
        )
    return table


def key_table(keys: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("key id", "name", "key", "scopes", "limits", "created", "expires", "last used"):
        table.add_column(col, no_wrap=col not in ("name", "scopes"))
    now = time.time()
    for k in keys:
        limits = k.get("limits") or {}
        shown = [
            f"{name} {limits[name]}" for name in ("rpm", "max_concurrency") if limits.get(name)
        ]
        expires = k.get("expires_at")
        expiry = fmt_time(expires) if expires else "never"
        if isinstance(expires, (int, float)) and expires <= now:
            expiry += " (expired)"
        if k.get("previous_expires_at"):
            expiry += f"; old secret until {fmt_time(k['previous_expires_at'])}"
        # Only the display prefix exists server-side; show it masked like OpenAI does.
        table.add_row(
            str(k.get("key_id")),
            str(k.get("name") or ""),
            f"{k.get('prefix', '')}…",
            ", ".join(k.get("scopes") or []) or "-",
            ", ".join(shown) or "tenant's",
            fmt_time(k.get("created_at")),
            expiry,
            fmt_time(k.get("last_used_at")) if k.get("last_used_at") else "never",
        )
    return table


def admin_key_table(keys: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("key id", "name", "role", "key", "created", "created by"):
        table.add_column(col, no_wrap=col != "name")
    for k in keys:
        table.add_row(
            str(k.get("key_id")),
            str(k.get("name") or ""),
            str(k.get("role")),
            f"{k.get('prefix', '')}…",
            fmt_time(k.get("created_at")),
            str(k.get("created_by") or "-"),
        )
    return table


def audit_table(entries: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("time", "actor", "action", "target", "fields"):
        table.add_column(col, no_wrap=col != "fields")
    for e in entries:
        fields = e.get("fields") or {}
        table.add_row(
            fmt_time(e.get("time")),
            f"{e.get('actor')} ({e.get('role')})" if e.get("role") else str(e.get("actor")),
            str(e.get("action")),
            str(e.get("target")),
            json.dumps(fields, separators=(",", ":"), sort_keys=True) if fields else "",
        )
    return table


def fmt_time(ts: Any) -> str:
    if not isinstance(ts, (int, float)):
        return "-"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def quota_cell(quota: dict[str, Any] | None, is_bytes: bool) -> str:
    if not quota:
        return "-"
    fmt = format_bytes if is_bytes else fmt_count
    used, limit = quota.get("used", 0), quota.get("limit")
    return f"{format_percent(used, limit)} {fmt(used)}/{fmt(limit)}"


def usage_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="usage: percent of limit, used/limit", title_justify="left")
    table.add_column("tenant", no_wrap=True)
    for _, title, _ in QUOTAS:
        table.add_column(title)
    for col in ("2xx", "4xx", "429", "5xx"):
        table.add_column(col, justify="right")
    for row in rows:
        quotas = row.get("quotas", {})
        responses = row.get("responses", {})
        table.add_row(
            str(row.get("tenant_id")),
            *(quota_cell(quotas.get(key), is_bytes) for key, _, is_bytes in QUOTAS),
            *(fmt_count(responses.get(c, 0)) for c in ("2xx", "4xx", "429", "5xx")),
        )
    return table


def capacity_table(capacity: dict[str, Any]) -> Table:
    table = Table(title="latch capacity: sum of tenant quotas vs engine caps", title_justify="left")
    for col in ("resource", "sum of quotas", "engine cap", "state"):
        table.add_column(col)
    for resource, info in capacity.items():
        fmt = format_bytes if resource.endswith("bytes") else fmt_count
        table.add_row(
            resource,
            fmt(info.get("allocated")),
            fmt(info.get("engine_cap")),
            "OVERCOMMITTED" if info.get("overcommitted") else "ok",
        )
    return table


def sparkline(values: Sequence[int]) -> str:
    """One character per minute, scaled to the busiest minute."""
    peak = max(values, default=0)
    if peak <= 0:
        return SPARK[0] * len(values)
    return "".join(SPARK[min(len(SPARK) - 1, round(v / peak * (len(SPARK) - 1)))] for v in values)


def print_tenant_usage(out: Console, row: dict[str, Any]) -> None:
    table = Table(title=f"usage of {row.get('tenant_id')}", title_justify="left")
    for col in ("quota", "used", "limit", "use"):
        table.add_column(col, justify="left" if col == "quota" else "right")
    quotas = row.get("quotas", {})
    for key, title, is_bytes in QUOTAS:
        q = quotas.get(key) or {}
        fmt = format_bytes if is_bytes else fmt_count
        table.add_row(
            title,
            fmt(q.get("used", 0)),
            fmt(q.get("limit")),
            format_percent(q.get("used", 0), q.get("limit")),
        )
    out.print(table)
    minutes = row.get("window_minutes", 60)
    responses = row.get("responses", {})
    out.print(
        f"responses, last {minutes} min: "
        + "  ".join(f"{c} {fmt_count(responses.get(c, 0))}" for c in ("2xx", "4xx", "429", "5xx")),
        markup=False,
    )
    rejections = row.get("rejections", {})
    if rejections:
        out.print(
            "429s by cause: " + "  ".join(f"{k} {fmt_count(v)}" for k, v in rejections.items()),
            markup=False,
        )
    made = row.get("requests_made") or {}
    if made:
        out.print(
            f"requests made: this minute {fmt_count(made.get('this_minute', 0))}  "
            f"last {minutes} min {fmt_count(made.get('window', 0))}  "
            f"total {fmt_count(made.get('total', 0))}",
            markup=False,
        )
    history = row.get("history") or []
    if history:
        spark = sparkline([h.get("requests", 0) for h in history])
        out.print(f"requests/min, last {len(history)} min: {spark}", markup=False)


def show_tenant(
    out: Console, tenant: dict[str, Any], keys: list[dict[str, Any]], usage: list[dict[str, Any]]
) -> None:
    out.print(tenant_table([tenant], f"tenant {tenant.get('id')}"))
    out.print(key_table(keys, "keys"))
    if usage:
        print_tenant_usage(out, usage[0])
