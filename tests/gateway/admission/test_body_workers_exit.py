"""The body-parse workers (``admission/bodies.py``) exit with their gateway. A gateway
killed outright (the OOM killer, SIGKILL after a grace period) left them running,
reparented to init, for good (found from outside: six of them from earlier runs,
each using CPU). The installed gateway, as an operator runs it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import orjson

from steergate.gateway.admission.bodies import OFF_LOOP_BYTES, PARENT_POLL_S
from tests.gateway.conftest import FakeEngine, installed_gateway, make_tenant


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"multiprocessing" in cmdline:
            out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_body_workers_exit_when_their_gateway_is_killed(
    redis_url: str, fake_engine: FakeEngine
) -> None:
    gw = installed_gateway(redis_url, fake_engine.url)
    assert gw.proc is not None
    try:
        key = make_tenant(redis_url, "acme")
        body = {"messages": [{"role": "user", "content": "x" * (OFF_LOOP_BYTES + 1024)}]}
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            content=orjson.dumps(body),
            headers={"Authorization": f"Bearer {key}", "content-type": "application/json"},
            timeout=60,
        )
        assert r.status_code == 200, r.text  # parsed in a worker: the workers exist
        workers = _children(gw.proc.pid)
        assert workers, "no body-parse worker was started"
        os.kill(gw.proc.pid, signal.SIGKILL)
        gw.proc.wait(10)
        deadline = time.monotonic() + 10 * PARENT_POLL_S
        while any(_alive(p) for p in workers):
            assert time.monotonic() < deadline, f"workers outlived their gateway: {workers}"
            time.sleep(0.1)
    finally:
        gw.stop()
