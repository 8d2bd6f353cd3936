"""The pieces of ``steergate up`` that need no engine: process-group shutdown, the
tiny-model cache, secrets, the demo vector and the printed curl command."""

from __future__ import annotations

import io
import json
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from steergate.cli import up
from steergate.shared.settings import GatewaySettings
from tests.harness import steergate_run

# A leader that starts two grandchildren, one of which ignores SIGTERM (as a
# wedged vLLM worker might), then waits.
TREE = """
import signal, subprocess, sys, time
stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
subprocess.Popen([sys.executable, "-c", stubborn])
print("ready", flush=True)
time.sleep(600)
"""


def _spawn_tree() -> tuple[subprocess.Popen[bytes], list[psutil.Process]]:
    proc = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE,
                            start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    deadline = time.monotonic() + 10
    members: list[psutil.Process] = []
    while time.monotonic() < deadline:
        members = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        if len(members) == 3:
            break
        time.sleep(0.05)
    assert len(members) == 3
    return proc, members


def _gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_stop_process_group_leaves_no_member_alive_even_one_ignoring_sigterm() -> None:
    proc, members = _spawn_tree()
    started = time.monotonic()
    up.stop_process_group(proc, grace_s=1.0)
    assert time.monotonic() - started < 10
    assert all(_gone(p) for p in members)
    assert proc.returncode is not None


def test_secrets_come_from_env_when_set_and_are_random_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("STEERGATE_ENGINE_TOKEN", "STEERGATE_ADMIN_KEY", "STEERGATE_KEY_PEPPER"):
        monkeypatch.delenv(name, raising=False)
    a, b = up.resolve_secrets(GatewaySettings()), up.resolve_secrets(GatewaySettings())
    assert a.engine_token != b.engine_token and a.admin_key != b.admin_key
    assert a.key_pepper != b.key_pepper and len(a.key_pepper) >= 43  # 256 bits, base64url
    assert set(a.generated) == {
        "STEERGATE_ENGINE_TOKEN", "STEERGATE_ADMIN_KEY", "STEERGATE_KEY_PEPPER"}

    monkeypatch.setenv("STEERGATE_ADMIN_KEY", "my-admin-key")
    c = up.resolve_secrets(GatewaySettings())
    assert c.admin_key == "my-admin-key" and "STEERGATE_ADMIN_KEY" not in c.generated


def test_demo_vector_is_deterministic_unit_norm_and_sized_to_the_model() -> None:
    v = up.demo_vector(128)
    assert v == up.demo_vector(128) and len(v) == 128
    assert np.linalg.norm(v) == pytest.approx(1.0, rel=1e-5)
    assert v != up.demo_vector(128, name="other")


def test_curl_command_is_one_shell_command_that_steers_with_the_named_vector_and_latches() -> None:
    cmd = up.curl_command("http://127.0.0.1:8080", "sk-sg-abc", "/models/it's tiny")
    argv = shlex.split(cmd.replace("\\\n", " "))
    assert argv[:4] == ["curl", "-sS", "-i", "http://127.0.0.1:8080/v1/chat/completions"]
    assert argv[argv.index("-H") + 1] == "Authorization: Bearer sk-sg-abc"
    body = json.loads(argv[argv.index("-d") + 1])
    assert body["model"] == "/models/it's tiny"
    assert body["conversation_id"] == up.DEMO_CONVERSATION
    assert body["steering"] == {"vectors": [{"name": "calm", "scale": 4}], "latch": True}


def test_unknown_up_flags_are_passed_to_the_engine() -> None:
    args, engine_args = up._parse(["--model", "org/m", "--port", "9000", "--max-model-len", "4096"])
    assert (args.model, args.port) == ("org/m", 9000)
    assert engine_args == ["--max-model-len", "4096"]


def test_wait_ready_reports_an_engine_that_exits_while_starting(tmp_path: Path) -> None:
    engine = up.Engine(model="m", port=up.free_port(), token="t", log_path=tmp_path / "engine.log")
    engine.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    engine.proc.wait(10)
    with pytest.raises(up.EngineFailed, match=r"exited with status 3.*engine\.log"):
        engine.wait_ready(30, up.Progress("test", stream=io.StringIO()))


def test_up_refuses_a_taken_port_before_starting_the_engine(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        out = steergate_run(
            ["up", "--port", str(port)], {"STEERGATE_HOME": str(tmp_path)},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert out.returncode == 1
    assert f"127.0.0.1:{port} is in use" in out.stderr
    assert time.monotonic() - started < 30
    assert list(tmp_path.iterdir()) == []  # no model generated, no engine log


def test_up_reads_the_gateways_port_setting_and_refuses_bad_binds(tmp_path: Path) -> None:
    """`up` took neither STEERGATE_PORT nor STEERGATE_HOST (it said 8080 was in use
    with STEERGATE_PORT set to a free port), an out-of-range port was an OverflowError
    traceback, and a host that does not resolve was reported "in use"."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"STEERGATE_HOME": str(tmp_path), "STEERGATE_PORT": str(port)}
        out = steergate_run(["up"], env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and f"127.0.0.1:{port} is in use" in out.stderr
    for argv, code, says in [
        (["up", "--port", "99999"], 2, "not a port"),
        (["up", "--host", "no.such.host.invalid"], 2, "cannot bind"),
    ]:
        out = steergate_run(argv, {"STEERGATE_HOME": str(tmp_path)},
                            capture_output=True, text=True, timeout=60)  # fmt: skip
        assert out.returncode == code and says in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    assert list(tmp_path.iterdir()) == []  # nothing started
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    out = steergate_run(["tiny-model", str(a_file)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "not a folder" in out.stderr  # a FileExistsError before


def test_the_default_model_is_served_in_float32_unless_a_dtype_is_given() -> None:
    assert up.default_model_engine_args([]) == ["--dtype", "float32"]
    assert up.default_model_engine_args(["--max-model-len", "4096"]) == [
        "--dtype", "float32", "--max-model-len", "4096"]
    assert up.default_model_engine_args(["--dtype", "bfloat16"]) == ["--dtype", "bfloat16"]
    assert up.default_model_engine_args(["--dtype=half"]) == ["--dtype=half"]


@pytest.mark.parametrize(
    ("env", "args", "said"),
    [
        ({"STEERGATE_MAX_LATCHED_CONVERSATIONS": "abc"}, [], "STEERGATE_MAX_LATCHED_CONVERSATIONS"),
        ({"REDIS_URL": "foo://bar"}, [], "REDIS_URL: must start with one of redis://"),
        ({"REDIS_URL": "redis://127.0.0.1:1/0"}, [], "cannot reach Redis at REDIS_URL"),
        # it printed everything after the `@`, a query's password included (found from
        # outside); `?password=` is how a unix:// URL gives one
        ({"REDIS_URL": "redis://127.0.0.1:1/0?password=SuperSecretPW"}, [],
         "cannot reach Redis at REDIS_URL (redis://127.0.0.1:1/0)"),
        ({"REDIS_URL": "unix:///nonexistent/redis.sock?db=0&password=SuperSecretPW"}, [],
         "cannot reach Redis at REDIS_URL (unix:///nonexistent/redis.sock)"),
        ({}, ["--model", "/nonexistent/model"], "no such file or directory"),
        ({}, ["--model", "EMPTY"], "not a model directory (it has no config.json)"),
    ],
)
def test_up_refuses_bad_settings_redis_and_model_paths_before_starting_the_engine(
    tmp_path: Path, env: dict[str, str], args: list[str], said: str
) -> None:
    """Found from outside: each of these cost an engine start (10-150 s) and then ended
    in an error that did not name the cause (a worker's traceback, a 503 from the demo
    tenant's creation, the last line of vLLM's log)."""
    empty = tmp_path / "empty-model"
    empty.mkdir()
    home = tmp_path / "home"
    args = [str(empty) if a == "EMPTY" else a for a in args]
    started = time.monotonic()
    out = steergate_run(
        ["up", "--port", str(up.free_port()), *args], {"STEERGATE_HOME": str(home), **env},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert said in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "SuperSecretPW" not in out.stderr + out.stdout
    assert time.monotonic() - started < 30
    assert not home.exists() or not (home / "logs").exists()  # no engine was started


def test_up_says_it_ignores_engine_urls_instead_of_refusing_a_stale_one(tmp_path: Path) -> None:
    """`up` serves its own engine, yet a stale STEERGATE_ENGINE_URLS in the shell refused
    its start. Now it says the variable is ignored and goes on (here to the next check,
    the model path, so that no engine starts)."""
    out = steergate_run(
        ["up", "--port", str(up.free_port()), "--model", "/nonexistent/model"],
        {"STEERGATE_HOME": str(tmp_path / "home"), "STEERGATE_ENGINE_URLS": "nope"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "steergate up: STEERGATE_ENGINE_URLS is ignored: up starts and serves its own engine",
        "steergate up: --model '/nonexistent/model': no such file or directory",
    ]


def test_engine_refuses_a_bad_engine_setting_before_vllm_starts(tmp_path: Path) -> None:
    out = steergate_run(
        ["engine", "--model", str(tmp_path)],
        {"STEERGATE_ENGINE_TOKEN": "t", "STEERGATE_MAX_VECTORS": "0"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "STEERGATE_MAX_VECTORS" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_failed_start_names_the_last_error_and_keeps_the_earlier_runs_log(
    tmp_path: Path,
) -> None:
    """Found from outside: the error showed vLLM's last log line (a pydantic docs URL),
    not the cause above it, and each start overwrote the last run's log."""
    log = tmp_path / "engine.log"
    for run in ("first", "second"):
        engine = up.Engine(model=run, port=up.free_port(), token="t", log_path=log)
        script = (
            "import sys; print('loading'); print('ValueError: Invalid repository ID or local "
            "directory'); print('For further information visit https://errors.pydantic.dev');"
            " sys.exit(1)"
        )
        engine.proc = subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        drain = threading.Thread(target=engine._drain, args=(engine.proc.stdout,))
        drain.start()
        engine.proc.wait(10)
        drain.join(10)
        with pytest.raises(up.EngineFailed) as failed:
            engine.wait_ready(30, up.Progress("test", stream=io.StringIO()))
        assert "last error in its log: 'ValueError: Invalid repository ID" in str(failed.value)
    text = log.read_text()
    assert text.count("steergate up: engine start") == 2
    assert "(first)" in text and "(second)" in text and text.count("ValueError") == 2
