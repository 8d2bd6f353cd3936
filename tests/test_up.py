"""``steergate up`` end to end: start it as a user would, run the curl command it
prints, and stop it with SIGTERM without leaving a single child process behind.

One ``up`` process (one real engine, ~75 s on CPU) serves every test in this
module; the tests run in file order and the last one stops it."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import psutil
import pytest

from steergate.engine.real_model import MODEL_NAME
from tests.harness import CACHE, free_port, real_model_dir, steergate_popen

pytestmark = pytest.mark.engine

READY_LINE = "Ctrl-C stops everything."
START_TIMEOUT_S = 900  # two engine streams run side by side (tests/run_suite.sh)


@dataclass
class Up:
    proc: subprocess.Popen[str]
    port: int
    stderr_path: Path
    lines: list[str] = field(default_factory=list)

    @property
    def stdout(self) -> str:
        return "\n".join(self.lines)

    def value(self, label: str) -> str:
        m = re.search(rf"^\s+{label}\s+(\S+)", self.stdout, re.M)
        assert m, f"no {label!r} line in the quick start:\n{self.stdout}"
        return m.group(1)

    def curl(self) -> str:
        """The printed curl command, continuation lines included."""
        m = re.search(r"^curl .*?(?=\n\n)", self.stdout, re.M | re.S)
        assert m, f"no curl command in the quick start:\n{self.stdout}"
        return m.group(0)

    def diagnostics(self) -> str:
        return f"stdout:\n{self.stdout}\nstderr:\n{self.stderr_path.read_text()[-4000:]}"


def _start(tmp: Path) -> Up:
    # A fixed home that reuses the converted default model (what a second `up` on the
    # same machine does); a stable model path also lets vLLM reuse its compile cache.
    home = CACHE / "up-home"
    (home / "models").mkdir(parents=True, exist_ok=True)
    link = home / "models" / MODEL_NAME
    if not link.exists():
        link.unlink(missing_ok=True)  # a dangling link from an older cache folder
        link.symlink_to(real_model_dir(), target_is_directory=True)
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("STEERGATE_") or k == "REDIS_URL")}
    env["STEERGATE_HOME"] = str(home)
    port = free_port()
    stderr_path = tmp / "up.stderr"
    proc = steergate_popen(
        ["up", "--port", str(port)], base_env=env,
        stdout=subprocess.PIPE, stderr=open(stderr_path, "w"), text=True,
    )  # fmt: skip
    handle = Up(proc, port, stderr_path)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            handle.lines.append(line.rstrip("\n"))

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while READY_LINE not in handle.lines:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"`steergate up` did not print its quick start\n{handle.diagnostics()}")
        time.sleep(0.5)
    return handle


@pytest.fixture(scope="module")
def up_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    handle = _start(tmp_path_factory.mktemp("up"))
    descendants = psutil.Process(handle.proc.pid).children(recursive=True)
    yield handle
    if handle.proc.poll() is None:  # a test failed before the stop test ran
        handle.proc.send_signal(signal.SIGTERM)
        try:
            handle.proc.wait(60)
        except subprocess.TimeoutExpired:
            handle.proc.kill()
    for p in descendants:
        if _alive(p):
            p.kill()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _split_http(raw: str) -> tuple[int, dict[str, str], str]:
    """curl -i output: status, lower-cased headers, body."""
    head, _, body = raw.replace("\r\n", "\n").partition("\n\n")
    status_line, *header_lines = head.split("\n")
    headers = {k.strip().lower(): v.strip() for k, v in
               (ln.split(":", 1) for ln in header_lines if ":" in ln)}
    return int(status_line.split()[1]), headers, body


def test_quick_start_prints_urls_keys_and_a_curl(up_process: Up) -> None:
    assert up_process.value("gateway") == f"http://127.0.0.1:{up_process.port}"
    assert up_process.value("dashboard") == f"http://127.0.0.1:{up_process.port}/dashboard"
    assert up_process.value("admin key")
    assert up_process.value("demo key").startswith("sk-sg-")
    assert up_process.value("demo key") in up_process.curl()
    assert up_process.value("model") == "SmolLM2-135M-Instruct"  # the default, no --model


def test_printed_curl_steers_with_calm_and_latches(up_process: Up) -> None:
    out = subprocess.run(["bash", "-c", up_process.curl()], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    status, headers, body = _split_http(out.stdout)
    assert status == 200, out.stdout
    assert headers["x-steering-latch"] == "latched"
    answer = orjson.loads(body)
    assert answer["steering"] == {"applied": True, "latch": "latched"}
    assert isinstance(answer["choices"][0]["message"]["content"], str)
    assert answer["usage"]["completion_tokens"] > 0


def test_next_turn_without_steering_is_bridged_by_the_latch(up_process: Up) -> None:
    argv = shlex.split(up_process.curl().replace("\\\n", " "))
    body = orjson.loads(argv[argv.index("-d") + 1])
    del body["steering"]
    r = httpx.post(f"http://127.0.0.1:{up_process.port}/v1/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {up_process.value('demo key')}"},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-steering-latch"] == "bridged"
    assert r.json()["steering"] == {"applied": True, "latch": "bridged"}


def test_printed_dashboard_url_answers(up_process: Up) -> None:
    r = httpx.get(up_process.value("dashboard"), timeout=10)
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]


def test_sigterm_stops_up_and_every_child_process(up_process: Up) -> None:
    proc = up_process.proc
    descendants = psutil.Process(proc.pid).children(recursive=True)
    assert descendants, "the engine should be a child of `up`"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(90) == 0, up_process.diagnostics()
    deadline = time.monotonic() + 10
    alive = descendants
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.2)
    assert not alive, f"left behind: {[(p.pid, p.name()) for p in alive]}"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{up_process.port}/healthz", timeout=2)
