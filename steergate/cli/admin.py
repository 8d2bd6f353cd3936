"""``steergate tenant|key|admin-key|audit|usage``: the admin API from a terminal.

A thin HTTP client: every decision (validation, overcommit, who may do what) is
the gateway's, so the CLI and the API can never disagree. The admin key comes from
``STEERGATE_ADMIN_KEY`` only — a ``--admin-key`` flag would leak it into shell
history and ``ps``. The only secret ever printed is a key just created, once.

Exit codes: 0 ok, 1 the gateway refused or could not be reached, 2 bad usage.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote

import httpx
from rich.console import Console
from rich.table import Table

from steergate.cli.tables import (
    admin_key_table,
    audit_table,
    capacity_table,
    console,
    fmt_time,
    key_table,
    print_tenant_usage,
    show_tenant,
    tenant_table,
    usage_table,
)
from steergate.gateway.admission.units import parse_bytes
from steergate.shared.settings import display_url

DEFAULT_URL = "http://127.0.0.1:8080"
LIMIT_FLAGS: dict[str, tuple[str, Callable[[str], int | str]]] = {
    # flag -> (limits field, parser)
    "--rpm": ("rpm", int),
    "--tpm": ("tpm", int),
    "--max-concurrency": ("max_concurrency", int),
    "--latch-count": ("latch_count", int),
    "--latch-bytes": ("latch_bytes", parse_bytes),
    "--vector-count": ("vector_count", int),
    "--vector-bytes": ("vector_bytes", parse_bytes),
    "--latch-policy": ("latch_policy", str),
}


class CLIError(Exception):
    """Something to tell the operator on stderr, with the exit code to return."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class AdminClient:
    """The admin API over HTTP; turns transport and API errors into :class:`CLIError`."""

    def __init__(self, base_url: str, admin_key: str, timeout: float = 10.0) -> None:
        try:
            self._http = httpx.Client(
                base_url=base_url.rstrip("/"),
                headers={"Authorization": f"Bearer {admin_key}"},
                timeout=timeout,
            )
        except httpx.InvalidURL as exc:
            raise CLIError(
                f"not a gateway URL: {display_url(base_url)!r} ({exc})", exit_code=2
            ) from None

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.close()

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._send(method, path, **kwargs)
        if response.status_code == 204 or not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            raise CLIError(
                f"{display_url(str(self._http.base_url))} answered {response.status_code} with "
                "something "
                "that is not JSON: is it the gateway? (set STEERGATE_GATEWAY_URL or --url)"
            ) from None

    def call_text(self, method: str, path: str, **kwargs: Any) -> str:
        """Like :meth:`call`, for an answer that is not JSON (a CSV export)."""
        return self._send(method, path, **kwargs).text

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise CLIError(
                f"cannot reach the gateway at {display_url(str(self._http.base_url))}: "
                f"{type(exc).__name__}"
                " (set STEERGATE_GATEWAY_URL or --url)"
            ) from exc
        if response.status_code >= 400:
            raise CLIError(_describe_error(response))
        return response


def path_segment(value: str, what: str) -> str:
    """``value`` as one path segment. An id given on the command line is put in a URL
    path: unquoted, ``key revoke ../tenants/acme`` was sent (the client resolves dot
    segments) as ``DELETE /admin/tenants/acme``, a tenant deleted without its prompt.
    No id holds a ``/``, and the server routes on the decoded path (``%2F`` splits a
    segment too), so one is refused rather than quoted."""
    if value in ("", ".", "..") or "/" in value:
        raise CLIError(f"not a {what}: {value!r}", exit_code=2)
    return quote(value, safe="")


def check_key(key: str, variable: str) -> None:
    """A key must travel in an HTTP header: printable ASCII. Anything else (a pasted
    "é", a line break) is the user's typo; say which variable, never print the key."""
    if not key.isascii() or not key.isprintable() or " " in key:
        raise CLIError(
            f"{variable} holds characters no API key has (keys are printable ASCII)",
            exit_code=2,
        )


def _describe_error(response: httpx.Response) -> str:
    try:
        err = response.json()["error"]
        message, code, param = err["message"], err.get("code"), err.get("param")
    except (ValueError, KeyError, TypeError):
        return f"gateway answered {response.status_code}"
    detail = f"{code}" + (f", field {param}" if param else "")
    hint = " (is STEERGATE_ADMIN_KEY the admin key?)" if response.status_code in (401, 403) else ""
    return f"{message} [{response.status_code} {detail}]{hint}"


# ---------------------------------------------------------------------------- parsing


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=os.environ.get("STEERGATE_GATEWAY_URL", DEFAULT_URL),
        help=f"gateway base URL (default: env STEERGATE_GATEWAY_URL, else {DEFAULT_URL})",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the API's JSON instead of tables"
    )


def _limit_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("limits (sizes accept 4096, 64KiB, 256MiB, 1GiB)")
    for flag, (field, kind) in LIMIT_FLAGS.items():
        group.add_argument(
            flag,
            dest=field,
            type=kind,
            metavar="SIZE" if kind is parse_bytes else ("POLICY" if kind is str else "N"),
            choices=["evict_oldest", "reject"] if field == "latch_policy" else None,
        )
    parser.add_argument(
        "--allow-overcommit",
        action="store_true",
        help="accept limits whose sum over tenants exceeds the engine's latch caps",
    )


def _limits_from(args: argparse.Namespace) -> dict[str, Any]:
    return {
        field: getattr(args, field)
        for field, _ in LIMIT_FLAGS.values()
        if getattr(args, field, None) is not None
    }


def _tenant_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="steergate tenant",
        description="Manage tenants. Each action has its own --help.",
        epilog="STEERGATE_ADMIN_KEY must hold the admin key.",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    create = sub.add_parser("create", help="create a tenant")
    create.add_argument("id", help="tenant id: 1-32 characters of [a-z0-9-]")
    create.add_argument("--name", help="display name")
    _limit_flags(create)
    lst = sub.add_parser("list", help="list tenants")
    show = sub.add_parser("show", help="show one tenant, its keys (masked) and usage")
    show.add_argument("id", help="tenant id")
    update = sub.add_parser("update", help="change a tenant's name or limits")
    update.add_argument("id", help="tenant id")
    update.add_argument("--name", help="display name")
    _limit_flags(update)
    delete = sub.add_parser(
        "delete",
        help="delete a tenant with its keys, latches and vectors (asks first; --yes to skip, "
        "required when stdin is not a terminal)",
    )
    delete.add_argument("id", help="tenant id")
    delete.add_argument(
        "--yes",
        action="store_true",
        help="do not ask for confirmation (required when stdin is not a terminal)",
    )
    for p in (create, lst, show, update, delete):
        _common(p)
    return parser


def _key_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="steergate key",
        description="Manage tenant API keys. Each action has its own --help.",
        epilog="STEERGATE_ADMIN_KEY must hold the admin key.",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    create = sub.add_parser("create", help="create a key (printed once, never again)")
    create.add_argument("tenant", help="tenant id")
    create.add_argument(
        "--key-only",
        action="store_true",
        help="print only the key, for scripts: export KEY=$(steergate key create ID --key-only)",
    )
    create.add_argument("--name", help="a label for the key")
    when = create.add_mutually_exclusive_group()
    when.add_argument(
        "--expires-at", type=finite_number, metavar="UNIX", help="expiry time, unix seconds"
    )
    when.add_argument(
        "--expires-in", type=parse_duration, metavar="DURATION", help="expiry, e.g. 3600, 12h, 30d"
    )
    create.add_argument(
        "--scope",
        dest="scopes",
        action="append",
        choices=KEY_SCOPES,
        help="what the key may do; repeat for several (default: all)",
    )
    create.add_argument("--rpm", type=int, metavar="N", help="the key's own requests/min")
    create.add_argument(
        "--max-concurrency", type=int, metavar="N", help="the key's own requests in flight"
    )
    lst = sub.add_parser("list", help="list a tenant's keys (masked)")
    lst.add_argument("tenant", help="tenant id")
    revoke = sub.add_parser("revoke", help="revoke a key by its key id")
    revoke.add_argument("key_id", help="the key id (key_...), from `steergate key list`")
    rotate = sub.add_parser(
        "rotate", help="give a key a new secret; the old one works for --grace, then 401"
    )
    rotate.add_argument("key_id", help="the key id (key_...)")
    rotate.add_argument(
        "--grace",
        type=parse_duration,
        metavar="DURATION",
        help="how long the old secret keeps working: 0 to 7d (default 1h)",
    )
    rotate.add_argument("--key-only", action="store_true", help="print only the new key")
    for p in (create, lst, revoke, rotate):
        _common(p)
    return parser


def _admin_key_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="steergate admin-key",
        description="Manage admin keys: role admin (everything) or viewer (reads only). "
        "Each action has its own --help.",
        epilog="STEERGATE_ADMIN_KEY must hold an admin key with role admin.",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    create = sub.add_parser("create", help="create an admin key (printed once, never again)")
    create.add_argument("--role", required=True, choices=["admin", "viewer"], help="its role")
    create.add_argument("--name", help="a label for the key")
    create.add_argument("--key-only", action="store_true", help="print only the key")
    lst = sub.add_parser("list", help="list admin keys (masked)")
    revoke = sub.add_parser("revoke", help="revoke an admin key by its id")
    revoke.add_argument("key_id", help="the key id (adm_...), from `steergate admin-key list`")
    for p in (create, lst, revoke):
        _common(p)
    return parser


def _audit_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="steergate audit",
        description="The audit log: every admin write (who, what, when, which fields), "
        "newest first.",
    )
    parser.add_argument(
        "--since",
        type=parse_since,
        metavar="WHEN",
        help="only entries from then on: unix seconds, a duration ago (90m, 24h, 7d) or a "
        "UTC date/time (2026-12-01, 2026-12-01T12:00)",
    )
    parser.add_argument(
        "--limit", type=int, default=100, metavar="N", help="at most N entries (1-1000; 100)"
    )
    _common(parser)
    return parser


def _usage_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="steergate usage",
        description="Current use against quotas, per tenant; with --since, one tenant's "
        "billable usage per UTC day (or per day and API key) from the daily rollups.",
        epilog="Export: steergate usage --tenant acme --since 2026-11-01 [--until 2026-11-30] "
        "[--group-by key] [--csv > usage.csv]. Dates are UTC days, both inclusive; at most "
        "400 days (the rollups' retention).",
    )
    parser.add_argument("tenant", nargs="?", help="one tenant in detail (default: every tenant)")
    export = parser.add_argument_group("export (GET /admin/tenants/{id}/usage/export)")
    export.add_argument("--tenant", dest="export_tenant", metavar="ID", help="tenant id")
    export.add_argument("--since", metavar="YYYY-MM-DD", help="first UTC day: selects the export")
    export.add_argument("--until", metavar="YYYY-MM-DD", help="last UTC day (default: today)")
    export.add_argument(
        "--group-by", choices=["day", "key"], help="one row per day (default) or day and key"
    )
    export.add_argument("--csv", action="store_true", help="print the CSV export as it is")
    _common(parser)
    return parser


# ---------------------------------------------------------------------------- entry points


def tenant_main(argv: Sequence[str]) -> int:
    return _run(_tenant_parser(), argv, _tenant_action)


def key_main(argv: Sequence[str]) -> int:
    return _run(_key_parser(), argv, _key_action)


def usage_main(argv: Sequence[str]) -> int:
    return _run(_usage_parser(), argv, _usage_action)


def admin_key_main(argv: Sequence[str]) -> int:
    return _run(_admin_key_parser(), argv, _admin_key_action)


def audit_main(argv: Sequence[str]) -> int:
    return _run(_audit_parser(), argv, _audit_action)


def _run(
    parser: argparse.ArgumentParser,
    argv: Sequence[str],
    action: Callable[[AdminClient, argparse.Namespace, Console], None],
) -> int:
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:  # argparse already printed why
        return int(exc.code or 0)
    out, err = console(), console(stderr=True)
    admin_key = os.environ.get("STEERGATE_ADMIN_KEY", "")
    if not admin_key:
        err.print("error: set STEERGATE_ADMIN_KEY to the gateway's admin key", markup=False)
        return 2
    try:
        check_key(admin_key, "STEERGATE_ADMIN_KEY")
        with AdminClient(args.url, admin_key) as client:
            action(client, args, out)
    except CLIError as exc:
        err.print(f"error: {exc}", markup=False)
        return exc.exit_code
    return 0


def _tenant_action(client: AdminClient, args: argparse.Namespace, out: Console) -> None:
    if args.action == "create":
        body: dict[str, Any] = {"id": args.id, "limits": _limits_from(args)}
        if args.name is not None:
            body["name"] = args.name
        if args.allow_overcommit:
            body["allow_overcommit"] = True
        tenant = client.call("POST", "/admin/tenants", json=body)
        _emit(out, args, tenant, lambda: tenant_table([tenant], f"created tenant {args.id}"))
    elif args.action == "list":
        tenants = _rows(client.call("GET", "/admin/tenants"), "tenants")
        _emit(out, args, tenants, lambda: tenant_table(tenants, "tenants"))
    elif args.action == "show":
        path = f"/admin/tenants/{path_segment(args.id, 'tenant id')}"
        tenant = client.call("GET", path)
        keys = _rows(client.call("GET", f"{path}/keys"), "keys")
        usage = _rows(client.call("GET", "/admin/usage", params={"tenant": args.id}), "tenants")
        if args.json:
            out.print_json(
                data={"tenant": tenant, "keys": keys, "usage": usage[0] if usage else None}
            )
        else:
            show_tenant(out, tenant, keys, usage)
    elif args.action == "update":
        body = {"limits": _limits_from(args)} if _limits_from(args) else {}
        if args.name is not None:
            body["name"] = args.name
        if args.allow_overcommit:
            body["allow_overcommit"] = True
        if not body:
            raise CLIError("nothing to update: pass --name or a limit flag", exit_code=2)
        path = f"/admin/tenants/{path_segment(args.id, 'tenant id')}"
        tenant = client.call("PATCH", path, json=body)
        _emit(out, args, tenant, lambda: tenant_table([tenant], f"updated tenant {args.id}"))
    elif args.action == "delete":
        path = f"/admin/tenants/{path_segment(args.id, 'tenant id')}"
        _confirm(args.yes, f"delete tenant {args.id!r} with its keys, latches and vectors?")
        client.call("DELETE", path)
        _emit(out, args, {"deleted": args.id}, lambda: f"deleted tenant {args.id}")


def _key_action(client: AdminClient, args: argparse.Namespace, out: Console) -> None:
    if args.action == "create":
        body: dict[str, Any] = {}
        if args.name is not None:
            body["name"] = args.name
        if args.expires_at is not None:
            body["expires_at"] = args.expires_at
        elif args.expires_in is not None:
            body["expires_at"] = time.time() + args.expires_in
        if args.scopes:
            body["scopes"] = sorted(set(args.scopes), key=KEY_SCOPES.index)
        limits = {
            field: value
            for field, value in (("rpm", args.rpm), ("max_concurrency", args.max_concurrency))
            if value is not None
        }
        if limits:
            body["limits"] = limits
        path = f"/admin/tenants/{path_segment(args.tenant, 'tenant id')}/keys"
        created = client.call("POST", path, json=body)
        _print_secret(out, args, created, f"key id {created['key_id']} for tenant {args.tenant}")
    elif args.action == "list":
        path = f"/admin/tenants/{path_segment(args.tenant, 'tenant id')}/keys"
        keys = _rows(client.call("GET", path), "keys")
        _emit(out, args, keys, lambda: key_table(keys, f"keys of {args.tenant}"))
    elif args.action == "revoke":
        client.call("DELETE", f"/admin/keys/{path_segment(args.key_id, 'key id')}")
        _emit(out, args, {"revoked": args.key_id}, lambda: f"revoked key {args.key_id}")
    elif args.action == "rotate":
        # Whole seconds, rounded up: 0.5 s was 0, which ends the old secret at once.
        body = {} if args.grace is None else {"grace_s": math.ceil(args.grace)}
        path = f"/admin/keys/{path_segment(args.key_id, 'key id')}/rotate"
        rotated = client.call("POST", path, json=body)
        until = rotated.get("previous_expires_at")
        old = f"the old one works until {fmt_time(until)}" if until else "the old one is revoked"
        _print_secret(out, args, rotated, f"new secret for key {args.key_id} ({old})")


def _admin_key_action(client: AdminClient, args: argparse.Namespace, out: Console) -> None:
    if args.action == "create":
        body: dict[str, Any] = {"role": args.role}
        if args.name is not None:
            body["name"] = args.name
        created = client.call("POST", "/admin/keys", json=body)
        _print_secret(out, args, created, f"admin key id {created['key_id']}, role {args.role}")
    elif args.action == "list":
        keys = _rows(client.call("GET", "/admin/keys"), "keys")
        _emit(out, args, keys, lambda: admin_key_table(keys, "admin keys"))
    elif args.action == "revoke":
        client.call("DELETE", f"/admin/keys/{path_segment(args.key_id, 'key id')}")
        _emit(out, args, {"revoked": args.key_id}, lambda: f"revoked key {args.key_id}")


def _audit_action(client: AdminClient, args: argparse.Namespace, out: Console) -> None:
    if not 1 <= args.limit <= 1000:
        raise CLIError("--limit must be from 1 to 1000", exit_code=2)
    params: dict[str, Any] = {"limit": args.limit}
    if args.since is not None:
        params["since"] = args.since
    entries = _rows(client.call("GET", "/admin/audit", params=params), "entries")
    _emit(out, args, entries, lambda: audit_table(entries, "audit log, newest first"))


def _print_secret(out: Console, args: argparse.Namespace, doc: dict[str, Any], what: str) -> None:
    """A just-made secret: the only time the CLI prints one."""
    if getattr(args, "key_only", False):
        print(doc["key"])
        return
    if args.json:
        out.print_json(data=doc)
        return
    out.print(f"{what} (shown once; store it now — the gateway keeps only a hash):", markup=False)
    out.print(doc["key"], markup=False, soft_wrap=True)


KEY_SCOPES = ["inference", "vectors", "latches", "usage"]
_DURATION = re.compile(r"\A(\d+(?:\.\d+)?)([smhd]?)\Z")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


#: Longer than any duration a flag means (a key's expiry, a grace period, an audit window).
MAX_DURATION_S = 100 * 365 * 86400


def parse_duration(text: str) -> float:
    """Seconds from ``3600``, ``90s``, ``15m``, ``12h`` or ``30d`` (at most 100 years:
    400 digits were an ``OverflowError`` traceback)."""
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 3600, 15m, 12h, 30d)")
    seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    if seconds > MAX_DURATION_S:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (at most 100 years)")
    return seconds


def finite_number(text: str) -> float:
    """A finite float (``nan`` and ``inf`` parse as floats, then fail as JSON)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def parse_since(text: str) -> float:
    """Unix seconds from a plain number (unix seconds), a duration ago (``24h``) or a UTC
    date (``2026-12-01``, ``2026-12-01T12:00``)."""
    value = text.strip()
    if re.fullmatch(r"\d+(\.\d+)?", value) and float(value) >= 10**8:
        return float(value)
    if _DURATION.fullmatch(value.lower()):
        return time.time() - parse_duration(value)
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a time: {text!r} (unix seconds, 24h, 2026-12-01 or 2026-12-01T12:00)"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.timestamp()


def _usage_action(client: AdminClient, args: argparse.Namespace, out: Console) -> None:
    if args.since is not None or args.export_tenant is not None:
        _usage_export(client, args, out)
        return
    if args.until is not None or args.group_by is not None or args.csv:
        raise CLIError("--until, --group-by and --csv need --since (an export)", exit_code=2)
    params: dict[str, str] = {"tenant": args.tenant, "history": "true"} if args.tenant else {}
    doc = client.call("GET", "/admin/usage", params=params)
    rows = _rows(doc, "tenants")
    if args.tenant and not rows:
        raise CLIError(f"no tenant {args.tenant!r}")
    if args.json:
        out.print_json(data=doc)
    elif args.tenant:
        print_tenant_usage(out, rows[0])
    else:
        out.print(usage_table(rows))
        capacity = doc.get("capacity") if isinstance(doc, dict) else None
        if capacity:
            out.print(capacity_table(capacity))


def _usage_export(client: AdminClient, args: argparse.Namespace, out: Console) -> None:
    tenant = args.export_tenant or args.tenant
    if args.export_tenant and args.tenant and args.export_tenant != args.tenant:
        raise CLIError("two different tenants: pass one, with --tenant", exit_code=2)
    if not tenant or args.since is None:
        raise CLIError("an export needs --tenant ID and --since YYYY-MM-DD", exit_code=2)
    if args.csv and args.json:
        raise CLIError("--csv and --json exclude each other", exit_code=2)
    params = {"start": args.since, "group_by": args.group_by or "day"}
    if args.until is not None:
        params["end"] = args.until
    path = f"/admin/tenants/{path_segment(tenant, 'tenant id')}/usage/export"
    if args.csv:
        sys.stdout.write(client.call_text("GET", path, params={**params, "format": "csv"}))
        return
    doc = client.call("GET", path, params=params)
    if args.json:
        out.print_json(data=doc)
    else:
        out.print(_export_table(doc))


def _export_table(doc: dict[str, Any]) -> Table:
    by_key = doc.get("group_by") == "key"
    table = Table(
        title=f"usage of {doc['tenant_id']}, {doc['start']} .. {doc['end']} (UTC)"
        + (", per API key" if by_key else "")
    )
    names = ["date", *(["key_id"] if by_key else [])]
    counters = ["requests", "prompt_tokens", "completion_tokens", "tokens", "2xx", "4xx", "5xx"]
    for name in [*names, *counters, "429"]:
        table.add_column(name.replace("_tokens", ""), justify="left" if name in names else "right")
    table.add_column("429 by cause")

    def cells(row: dict[str, Any]) -> list[str]:
        causes = ", ".join(
            f"{field[4:]} {row[field]}" for field in row if field.startswith("429_") and row[field]
        )
        return [*(str(row.get(c, 0)) for c in [*counters, "429"]), causes]

    for row in doc.get("rows", []):
        table.add_row(*(str(row[n]) for n in names), *cells(row))
    totals = doc.get("totals") or {}
    table.add_section()
    table.add_row("total", *([""] if by_key else []), *cells(totals))
    return table


# ---------------------------------------------------------------------------- output


def _emit(
    out: Console, args: argparse.Namespace, data: Any, render: Callable[[], Table | str]
) -> None:
    if args.json:
        out.print_json(data=data)
        return
    rendered = render()
    if isinstance(rendered, str):
        out.print(rendered, markup=False)
    else:
        out.print(rendered)


def _confirm(yes: bool, question: str) -> None:
    if yes:
        return
    if not sys.stdin.isatty():
        raise CLIError("refusing to delete without confirmation: pass --yes", exit_code=2)
    try:
        answer = input(f"{question} [y/N] ")
    except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C: a traceback before
        answer = ""
    if answer.strip().lower() not in {"y", "yes"}:
        raise CLIError("cancelled", exit_code=1)


def _rows(doc: Any, field: str) -> list[dict[str, Any]]:
    """The list under ``field`` (``{"tenants": [...]}``), or ``doc`` if it is a list."""
    return list(doc.get(field, []) if isinstance(doc, dict) else doc or [])
