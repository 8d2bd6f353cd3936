"""``steergate tenant|key|usage`` against a live gateway (uvicorn thread), through the
real entry point ``steergate.cli.main``."""

# ruff: noqa: F811 - pytest fixtures are imported, then named as parameters
from __future__ import annotations

import json
import re
import time

import pytest

from steergate.gateway.admission.units import format_bytes, parse_bytes
from tests.gateway.conftest import ADMIN_KEY
from tests.gateway.ops_env import Ops, cli, ops  # noqa: F401 - fixtures
from tests.harness import free_port


def test_tenant_create_list_show_update_delete_round_trip(cli, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    code, out, err = cli(
        "tenant",
        "create",
        "acme",
        "--name",
        "Acme",
        "--rpm",
        "30",
        "--latch-bytes",
        "1MiB",
        "--latch-count",
        "8",
        "--latch-policy",
        "reject",
    )
    assert code == 0, err
    assert "acme" in out and "1 MiB" in out
    t = ops.admin("GET", "/admin/tenants/acme").json()
    assert t["limits"]["rpm"] == 30 and t["limits"]["latch_bytes"] == 1048576
    assert t["limits"]["latch_policy"] == "reject" and t["name"] == "Acme"

    code, out, _ = cli("tenant", "list")
    assert code == 0 and re.search(r"acme\s.*Acme", out)

    code, out, _ = cli("tenant", "update", "acme", "--tpm", "5000", "--vector-bytes", "64KiB")
    assert code == 0
    t = ops.admin("GET", "/admin/tenants/acme").json()
    assert t["limits"]["tpm"] == 5000 and t["limits"]["vector_bytes"] == 65536
    assert t["limits"]["rpm"] == 30  # untouched

    code, out, _ = cli("tenant", "show", "acme")
    assert code == 0 and "req/min" in out and "keys" in out

    code, out, _ = cli("tenant", "list", "--json")
    assert [x["id"] for x in json.loads(out)] == ["acme"]

    code, out, err = cli("tenant", "delete", "acme")
    assert code == 2 and "--yes" in err  # no tty to confirm on
    assert ops.admin("GET", "/admin/tenants/acme").status_code == 200
    code, out, _ = cli("tenant", "delete", "acme", "--yes")
    assert code == 0 and "deleted" in out
    assert ops.admin("GET", "/admin/tenants/acme").status_code == 404


def test_key_create_prints_the_key_once_list_masks_it_and_revoke_works(cli, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    cli("tenant", "create", "acme")
    code, out, _ = cli("key", "create", "acme")
    assert code == 0
    key = re.search(r"sk-sg-[A-Za-z0-9_-]{43}", out).group(0)  # type: ignore[union-attr]
    key_id = re.search(r"key_[0-9a-f]{16}", out).group(0)  # type: ignore[union-attr]
    assert ops.get(key, "/v1/usage").status_code == 200

    code, out, _ = cli("key", "list", "acme")
    assert code == 0 and key_id in out and key[:12] + "…" in out
    assert key not in out and key[12:] not in out
    code, out, _ = cli("tenant", "show", "acme")
    assert key not in out and key[12:] not in out

    # A grace under a second is one second, not 0 (which ends the old secret at once).
    code, out, _ = cli("key", "rotate", key_id, "--grace", "0.5", "--json")
    assert code == 0 and json.loads(out)["grace_s"] == 1, out
    assert ops.get(key, "/v1/usage").status_code == 200

    code, out, _ = cli("key", "revoke", key_id)
    assert code == 0 and "revoked" in out
    assert ops.get(key, "/v1/usage").status_code == 401
    code, _, err = cli("key", "revoke", key_id)
    assert code == 1 and "key_not_found" in err


def test_usage_tables_for_all_tenants_and_one(cli, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    key = ops.tenant("acme", rpm=10, latch_bytes=2 * 1024 * 1024)
    ops.tenant("beta")
    for _ in range(3):
        assert ops.chat(key).status_code == 200
    code, out, _ = cli("usage")
    assert code == 0
    row = next(line for line in out.splitlines() if "acme" in line)
    assert "30% 3/10" in row and "0% 0 B/2 MiB" in row
    assert any("beta" in line for line in out.splitlines())
    assert "latch capacity" in out and "ok" in out

    ops.wait_for(
        lambda: (
            ops.admin("GET", "/admin/usage?tenant=acme").json()["tenants"][0]["responses"]["2xx"]
            == 3
        )
    )
    code, out, _ = cli("usage", "acme")
    assert code == 0 and "usage of acme" in out and "2xx 3" in out
    assert "requests/min, last 60 min" in out and "beta" not in out

    code, out, _ = cli("usage", "acme", "--json")
    assert json.loads(out)["tenants"][0]["quotas"]["requests_per_minute"]["limit"] == 10


def test_gateway_refusals_are_clear_errors_with_exit_1(cli, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    code, _, _ = cli("tenant", "create", "acme", "--latch-count", "2000")
    assert code == 0  # overcommit is allowed by default (it costs restores, not latches)
    code, _, err = cli("tenant", "create", "acme")
    assert code == 1 and "tenant_exists" in err and "field id" in err
    code, _, err = cli("tenant", "create", "Bad_Id")
    assert code == 1 and "invalid_tenant_id" in err and "field id" in err
    code, _, err = cli("tenant", "show", "ghost")
    assert code == 1 and "tenant_not_found" in err
    code, _, err = cli("tenant", "update", "acme")
    assert code == 2 and "nothing to update" in err


def test_bad_flags_are_usage_errors_with_exit_2(cli) -> None:  # type: ignore[no-untyped-def]
    assert cli("tenant", "create", "acme", "--latch-bytes", "lots")[0] == 2
    assert cli("tenant", "create", "acme", "--latch-policy", "lru")[0] == 2
    assert cli("tenant", "frobnicate")[0] == 2
    assert cli("key")[0] == 2


def test_odd_flags_and_urls_are_messages_not_tracebacks(cli) -> None:  # type: ignore[no-untyped-def]
    """Each of these ended in a Python traceback (exit 1) before."""
    for argv, says in [
        (("tenant", "list", "--url", "http://localhost:8o80"), "not a gateway URL"),
        (("key", "create", "acme", "--expires-at", "nan"), "not a finite number"),
        (("key", "rotate", "key_x", "--grace", "9" * 400), "at most 100 years"),
    ]:
        code, _, err = cli(*argv)
        assert code == 2 and says in err and "Traceback" not in err, (argv, err)


def test_an_answer_that_is_not_json_is_a_message(cli) -> None:  # type: ignore[no-untyped-def]
    """A URL that is not the gateway's but answers 200 with HTML: a JSONDecodeError
    traceback before."""
    import http.server
    import threading

    class Html(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            body = b"<html>not a gateway</html>"
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Html)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        code, _, err = cli("tenant", "list", "--url", url)
    finally:
        server.shutdown()
    assert code == 1 and "not JSON" in err and "Traceback" not in err, err


def test_missing_or_wrong_admin_key_and_unreachable_gateway(
    cli, ops: Ops, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    tenant_key = ops.tenant("acme")
    monkeypatch.setenv("STEERGATE_ADMIN_KEY", tenant_key)
    code, out, err = cli("tenant", "list")
    assert code == 1 and "permission_denied" in err and "STEERGATE_ADMIN_KEY" in err
    assert tenant_key not in out + err
    monkeypatch.delenv("STEERGATE_ADMIN_KEY")
    code, _, err = cli("tenant", "list")
    assert code == 2 and "STEERGATE_ADMIN_KEY" in err
    monkeypatch.setenv("STEERGATE_ADMIN_KEY", ADMIN_KEY)
    dead = f"http://127.0.0.1:{free_port()}"
    code, _, err = cli("tenant", "list", "--url", dead)
    assert code == 1 and "cannot reach the gateway" in err and dead in err


def test_sizes_parse_and_format_in_binary_units() -> None:
    assert parse_bytes("4096") == 4096
    assert parse_bytes("64KiB") == parse_bytes("64k") == 65536
    assert parse_bytes("256MiB") == 268435456
    assert parse_bytes("1GB") == 10**9 and parse_bytes("1.5KiB") == 1536
    assert parse_bytes("64 KiB") == 65536  # as format_bytes writes it
    # a space only before a unit ("64 " was taken as 64: the property test found it)
    for bad in ("", "lots", "1.3B", "-5", "5 parsecs", "64 ", "0 ", " 64", "64  KiB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    assert format_bytes(268435456) == "256 MiB"
    assert format_bytes(1536) == "1.5 KiB" and format_bytes(10) == "10 B"


def test_an_id_with_dot_segments_cannot_reach_another_route(cli, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    """The attack: ``key revoke ../tenants/beta``. The id went into the URL path as it
    was, the client resolved ``..``, and ``DELETE /admin/tenants/beta`` deleted the
    tenant, without the prompt ``tenant delete`` asks for, and printed "revoked key"."""
    cli("tenant", "create", "beta")
    # No id holds a "/": refused before any request (the server routes on the decoded
    # path, so even a quoted "%2F" split the segment: found from outside).
    for ident in ("../tenants/beta", "beta/keys", "a/b"):
        code, _, err = cli("key", "revoke", ident)
        assert code == 2 and "not a key id" in err and "Traceback" not in err, err
        code, _, err = cli("admin-key", "revoke", ident)
        assert code == 2 and "not a" in err and "Traceback" not in err, err
    assert ops.admin("GET", "/admin/tenants/beta").status_code == 200
    # and the other way: a tenant "id" that walks to an admin key's route
    code, _, err = cli("tenant", "delete", "../keys/adm_0000", "--yes")
    assert code == 2 and "not a tenant id" in err
    for bare in (".", ".."):
        code, _, err = cli("key", "revoke", bare)
        assert code == 2 and "not a key id" in err
    assert ops.admin("GET", "/admin/tenants/beta").status_code == 200


def test_a_key_no_header_can_carry_is_a_message_not_a_traceback(
    cli, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Found from outside: ``STEERGATE_ADMIN_KEY='ké€y'`` ended in a UnicodeEncodeError
    traceback (httpx cannot put it in a header)."""
    for bad in ("ké€y", "sk-sg-abc\n", "two words"):
        monkeypatch.setenv("STEERGATE_ADMIN_KEY", bad)
        code, out, err = cli("tenant", "list")
        assert code == 2 and "STEERGATE_ADMIN_KEY holds characters" in err, err
        assert "Traceback" not in err and "ké€y" not in out + err


def test_names_are_printed_as_they_are_never_read_as_markup(cli, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    """The attack: a tenant named ``ACME [/]`` made ``tenant list`` (and ``audit``, for
    as long as the entry lasted) crash with rich's MarkupError, and ``[link=…]`` in a
    name became a hyperlink in the operator's terminal."""
    cli("tenant", "create", "acme", "--name", "ACME [/] [link=https://evil.example]x[/link]")
    cli("key", "create", "acme", "--name", "[bold]k[/bold] :smile:")
    for argv in (("tenant", "list"), ("tenant", "show", "acme"), ("key", "list", "acme")):
        code, out, err = cli(*argv)
        assert code == 0, err
        assert "Traceback" not in err
    code, out, _ = cli("tenant", "list")
    assert "ACME [/] [link=https://evil.example]x[/link]" in out and "\x1b]8;" not in out
    code, out, _ = cli("key", "list", "acme")
    assert "[bold]k[/bold] :smile:" in out
    code, out, err = cli("audit")
    assert code == 0 and "[link=https://evil.example]" in out, err


def test_a_gateway_url_with_credentials_is_never_printed(  # type: ignore[no-untyped-def]
    cli, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """Found from outside: an unreachable gateway was named with its URL whole, user,
    password and query included, and ``--help`` showed STEERGATE_GATEWAY_URL's value."""
    dead = f"http://ops:SuperSecretPW@127.0.0.1:{free_port()}/?token=SuperSecretPW"
    code, out, err = cli("tenant", "list", "--url", dead)
    assert code == 1 and "cannot reach the gateway at http://127.0.0.1:" in err, err
    assert "SuperSecretPW" not in out + err
    (tmp_path / "pos.txt").write_text("calm\n")
    (tmp_path / "neg.txt").write_text("angry\n")
    monkeypatch.setenv("STEERGATE_API_KEY", "sk-sg-" + "a" * 43)
    code, out, err = cli("vector", "from-examples", "calm", "--url", dead,
                         "--positive", str(tmp_path / "pos.txt"),
                         "--negative", str(tmp_path / "neg.txt"))  # fmt: skip
    assert code == 1 and "cannot reach the gateway at http://127.0.0.1:" in err, err
    assert "SuperSecretPW" not in out + err
    monkeypatch.setenv("STEERGATE_GATEWAY_URL", dead)
    for argv in (("tenant", "list", "--help"), ("vector", "from-examples", "--help")):
        code, out, err = cli(*argv)
        assert code == 0 and "SuperSecretPW" not in out + err, (argv, out)


def test_ctrl_d_or_ctrl_c_at_the_delete_prompt_cancels_without_a_traceback(
    ops: Ops,
) -> None:
    """The ``[y/N]`` prompt of ``tenant delete`` (a terminal's stdin) ended in an
    EOFError or KeyboardInterrupt traceback."""
    import os
    import pty
    import select
    import signal
    import subprocess

    from tests.harness import steergate_popen

    ops.tenant("acme")
    env = {"STEERGATE_GATEWAY_URL": ops.url, "STEERGATE_ADMIN_KEY": ADMIN_KEY}
    for press in ("ctrl-d", "ctrl-c"):
        main, terminal = pty.openpty()
        # SIGINT as a terminal's process gets it (a test run in the background has it
        # ignored, and a child inherits that)
        default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
        proc = steergate_popen(["tenant", "delete", "acme"], env, stdin=terminal,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               preexec_fn=default_sigint)  # fmt: skip
        os.close(terminal)
        assert proc.stdout is not None
        shown, deadline = b"", time.monotonic() + 30
        while b"[y/N]" not in shown and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 1)[0]:
                shown += os.read(proc.stdout.fileno(), 4096)
        assert b"[y/N]" in shown, shown
        # As a person would: after the prompt's read has begun (a signal that lands
        # between the prompt's flush and the read is seen only when the read returns).
        time.sleep(0.5)
        if press == "ctrl-d":
            os.write(main, b"\x04")  # the terminal's end of input
        else:
            proc.send_signal(signal.SIGINT)  # what the terminal sends its foreground
        _, err = proc.communicate(timeout=30)
        os.close(main)
        assert proc.returncode == 1 and b"cancelled" in err and b"Traceback" not in err, err
    assert ops.admin("GET", "/admin/tenants/acme").status_code == 200
