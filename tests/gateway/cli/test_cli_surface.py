"""The CLI documents itself and prints everything: ``--help`` on every command and
action, full tables when stdout is not a terminal, ``--key-only`` for scripts, and
``tenant delete`` that says it needs ``--yes`` when nobody can answer its question."""

# ruff: noqa: F811 - pytest fixtures are imported, then named as parameters
from __future__ import annotations

import json

import pytest

from steergate.cli.main import COMMANDS, main
from tests.gateway.conftest import ADMIN_KEY
from tests.gateway.ops_env import Ops, installed_cli, ops  # noqa: F401 - fixture

ACTIONS = {
    "tenant": ("create", "list", "show", "update", "delete"),
    "key": ("create", "list", "revoke"),
    "vector": ("from-examples",),
}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's --help in the server commands
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def cli(ops: Ops, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """The installed command, its stdout a pipe (tests/harness.py: outside the checkout)."""
    monkeypatch.setenv("STEERGATE_GATEWAY_URL", ops.url)
    monkeypatch.setenv("STEERGATE_ADMIN_KEY", ADMIN_KEY)
    monkeypatch.delenv("COLUMNS", raising=False)  # what a pipe or CI job has
    return installed_cli()


def test_every_command_and_action_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    """In this process (argparse's text; ~25 commands); the installed command's own
    ``--help`` once, below."""
    code, out, err = installed_cli()("--help")
    assert code == 0 and "--yes" in out, err
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "--help" in out and "--yes" in out
    for command in COMMANDS:
        code, out, err = run(capsys, command, "--help")
        assert code == 0, (command, err)
        assert "usage" in (out + err).lower(), command
    for command, actions in ACTIONS.items():
        for action in actions:
            code, out, _ = run(capsys, command, action, "--help")
            assert code == 0 and f"steergate {command} {action}" in out, (command, action)
    assert "--yes" in run(capsys, "tenant", "delete", "--help")[1]
    assert "--key-only" in run(capsys, "key", "create", "--help")[1]


def test_tables_are_never_cut_when_stdout_is_not_a_terminal(cli, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    name = "A tenant with a rather long display name, longer than any terminal default"
    assert cli("tenant", "create", "wide-tenant-id", "--name", name)[0] == 0
    code, out, _ = cli("tenant", "list")
    assert code == 0 and name in out and "latch policy" in out
    code, out, _ = cli("usage")
    assert code == 0
    assert "…" not in out and "5xx" in out and "wide-tenant-id" in out
    assert "req/min bucket" in out  # says what the figure counts
    assert max(len(line) for line in out.splitlines()) > 80


def test_key_only_prints_just_the_key_for_scripts(cli, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    ops.admin("POST", "/admin/tenants", json={"id": "acme"})
    code, out, _ = cli("key", "create", "acme", "--key-only")
    assert code == 0 and out.startswith("sk-sg-") and out.count("\n") == 1


def test_delete_without_a_terminal_asks_for_yes(cli, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    ops.admin("POST", "/admin/tenants", json={"id": "acme"})
    code, _, err = cli("tenant", "delete", "acme")
    assert code == 2 and "--yes" in err
    assert ops.admin("GET", "/admin/tenants/acme").status_code == 200
    code, out, _ = cli("tenant", "delete", "acme", "--yes")
    assert code == 0 and "deleted tenant acme" in out


def test_usage_json_names_requests_made_apart_from_bucket_fill(cli, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    key = ops.tenant("acme")
    assert ops.chat(key).status_code == 200
    ops.wait_for(lambda: ops.get(key, "/v1/usage").json()["requests_made"]["total"] == 1)
    code, out, _ = cli("usage", "acme", "--json")
    row = json.loads(out)["tenants"][0]
    made = row["requests_made"]
    assert (made["window"], made["total"]) == (1, 1) and made["this_minute"] in (0, 1)
    code, out, _ = cli("usage", "acme")
    assert "requests made" in out
