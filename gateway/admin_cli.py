"""``steergate tenant|key|usage``: the admin API from a terminal.

A thin HTTP client: every decision (validation, overcommit, who may do what) is
the gateway's, so the CLI and the API can never disagree. The admin key comes from
``STEERGATE_ADMIN_KEY`` only — a ``--admin-key`` flag would leak it into shell
history and ``ps``. The only secret ever printed is a key just created, once.

Exit codes: 0 ok, 1 the gateway refused or could not be reached, 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from gateway.admin_tables import (
    capacity_table,
    key_table,
    print_tenant_usage,
    show_tenant,
    tenant_table,
    usage_table,
)
from gateway.units import parse_bytes

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
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {admin_key}"},
            timeout=timeout,
        )

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.close()

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise CLIError(
                f"cannot reach the gateway at {self._http.base_url}: {type(exc).__name__}"
                " (set STEERGATE_GATEWAY_URL or --url)"
            ) from exc
        if response.status_code >= 400:
            raise CLIError(_describe_error(response))
        if response.status_code == 204 or not response.content:
            return None
        return response.json()


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
        help="gateway base URL (env STEERGATE_GATEWAY_URL, default %(default)s)",
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
    lst = sub.add_parser("list", help="list a tenant's keys (masked)")
    lst.add_argument("tenant", help="tenant id")
    revoke = sub.add_parser("revoke", help="revoke a key by its key id")
    revoke.add_argument("key_id", help="the key id (key_...), from `steergate key list`")
    for p in (create, lst, revoke):
        _common(p)
    return parser


def _usage_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="steergate usage", description="Current use against quotas, per tenant."
    )
    parser.add_argument("tenant", nargs="?", help="one tenant in detail (default: every tenant)")
    _common(parser)
    return parser


# ---------------------------------------------------------------------------- entry points


def tenant_main(argv: Sequence[str]) -> int:
    return _run(_tenant_parser(), argv, _tenant_action)


def key_main(argv: Sequence[str]) -> int:
    return _run(_key_parser(), argv, _key_action)


def usage_main(argv: Sequence[str]) -> int:
    return _run(_usage_parser(), argv, _usage_action)


def _run(
    parser: argparse.ArgumentParser,
    argv: Sequence[str],
    action: Callable[[AdminClient, argparse.Namespace, Console], None],
) -> int:
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:  # argparse already printed why
        return int(exc.code or 0)
    # Not a terminal (a pipe, a file, CI): no width to fit, so tables are never cut or
    # wrapped at rich's default of 80 columns.
    out = Console(highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 10_000)
    err = Console(stderr=True, highlight=False)
    admin_key = os.environ.get("STEERGATE_ADMIN_KEY", "")
    if not admin_key:
        err.print("error: set STEERGATE_ADMIN_KEY to the gateway's admin key", markup=False)
        return 2
    try:
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
        tenant = client.call("GET", f"/admin/tenants/{args.id}")
        keys = _rows(client.call("GET", f"/admin/tenants/{args.id}/keys"), "keys")
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
        tenant = client.call("PATCH", f"/admin/tenants/{args.id}", json=body)
        _emit(out, args, tenant, lambda: tenant_table([tenant], f"updated tenant {args.id}"))
    elif args.action == "delete":
        _confirm(args.yes, f"delete tenant {args.id!r} with its keys, latches and vectors?")
        client.call("DELETE", f"/admin/tenants/{args.id}")
        _emit(out, args, {"deleted": args.id}, lambda: f"deleted tenant {args.id}")


def _key_action(client: AdminClient, args: argparse.Namespace, out: Console) -> None:
    if args.action == "create":
        created = client.call("POST", f"/admin/tenants/{args.tenant}/keys", json={})
        if args.key_only:
            print(created["key"])
            return
        if args.json:
            out.print_json(data=created)
            return
        out.print(
            f"key id {created['key_id']} for tenant {args.tenant} "
            "(shown once; store it now — the gateway keeps only a hash):",
            markup=False,
        )
        out.print(created["key"], markup=False, soft_wrap=True)
    elif args.action == "list":
        keys = _rows(client.call("GET", f"/admin/tenants/{args.tenant}/keys"), "keys")
        _emit(out, args, keys, lambda: key_table(keys, f"keys of {args.tenant}"))
    elif args.action == "revoke":
        client.call("DELETE", f"/admin/keys/{args.key_id}")
        _emit(out, args, {"revoked": args.key_id}, lambda: f"revoked key {args.key_id}")


def _usage_action(client: AdminClient, args: argparse.Namespace, out: Console) -> None:
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
    if input(f"{question} [y/N] ").strip().lower() not in {"y", "yes"}:
        raise CLIError("cancelled", exit_code=1)


def _rows(doc: Any, field: str) -> list[dict[str, Any]]:
    """The list under ``field`` (``{"tenants": [...]}``), or ``doc`` if it is a list."""
    return list(doc.get(field, []) if isinstance(doc, dict) else doc or [])
