"""Real processes for tests: a Redis server and a vLLM CPU engine on free loopback
ports. Tests can stop and restart them to prove failure behaviour. Every steergate
command a test starts (gateway, engine, up, the admin CLI) is started here, as installed
(see "The installed product" below)."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("STEERGATE_TEST_CACHE", ROOT / ".cache" / "tests"))
ENGINE_TOKEN = "test-engine-token-0123456789abcdef"


#: ``STEERGATE_TEST_REDIS=cluster`` runs the suite against a local Redis Cluster
#: (``tests/cluster_harness.py``) instead of one redis-server.
CLUSTER = os.environ.get("STEERGATE_TEST_REDIS", "") == "cluster"


T = TypeVar("T")


def redis_client(url: str, **kwargs: object):  # -> redis.Redis | redis.RedisCluster
    """A synchronous client for a test's ``redis_url``: single server or cluster."""
    import redis

    kwargs.setdefault("decode_responses", True)
    if "+cluster://" in url:
        return redis.RedisCluster.from_url(url.replace("+cluster", "", 1), **kwargs)
    return redis.Redis.from_url(url, **kwargs)


def aredis_client(url: str, **kwargs: object):  # -> redis.asyncio.Redis | RedisCluster
    """The asyncio twin of :func:`redis_client`."""
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import RedisCluster

    kwargs.setdefault("decode_responses", True)
    if "+cluster://" in url:
        return RedisCluster.from_url(url.replace("+cluster", "", 1), **kwargs)
    return aioredis.Redis.from_url(url, **kwargs)


# -- The installed product ------------------------------------------------------------
#
# The end-to-end, browser and CLI tests start what a user starts: the console script
# ``steergate`` installed beside this interpreter, from a temporary folder outside the
# checkout, without the test run's PYTHONPATH. From inside the checkout (pytest's cwd,
# or the checkout on PYTHONPATH) everything in the source tree is importable, so a file
# found only there works in tests and fails for every user (issue 23: the dashboard read
# ``resources.files("gateway")``, a package that existed only in the checkout, a 500 once
# installed).
#
# Which code the commands run: CI installs the clone under test (``make install``,
# editable), so the installed package *is* this checkout and the child gets no
# PYTHONPATH at all. A developer's second checkout (a git worktree sharing that venv)
# is not what the venv's editable install points at: running it as is would test the
# other checkout's code, and putting this checkout on PYTHONPATH would hide the bug
# again. So, only when the installed ``steergate`` is not this checkout's, the child's
# PYTHONPATH is a temporary folder holding nothing but a ``steergate`` symlink to this
# checkout's package: ``steergate.*`` resolves to this checkout's ``steergate/`` (path =
# import name), and nothing else of the checkout (tests, bench, scripts) is importable.


def steergate_bin() -> str:
    """The installed console script (``<venv>/bin/steergate``)."""
    exe = Path(sysconfig.get_path("scripts")) / "steergate"
    if not exe.is_file():
        raise RuntimeError(f"{exe} is missing: install the project first (make install)")
    return str(exe)


@functools.cache
def run_dir() -> str:
    """The working folder of every started command: empty, outside the checkout."""
    return tempfile.mkdtemp(prefix="sg-run-")


@functools.cache
def _installed_is_this_checkout() -> bool:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", "import os, steergate; print(os.path.realpath(steergate.__file__))"],
        env=env, cwd=run_dir(), capture_output=True, text=True, check=True,
    )  # fmt: skip
    return Path(out.stdout.strip()).parent.parent == ROOT


@functools.cache
def _source_shim() -> str:
    shim = Path(tempfile.mkdtemp(prefix="sg-src-"))
    (shim / "steergate").symlink_to(ROOT / "steergate", target_is_directory=True)
    return str(shim)


def installed_env(
    extra: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of a started command: ``base`` (default: this process's) minus
    PYTHONPATH (see above), plus ``extra``."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k != "PYTHONPATH"}
    if not _installed_is_this_checkout():
        env["PYTHONPATH"] = _source_shim()
    env.update(extra or {})
    return env


def steergate_popen(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    base_env: Mapping[str, str] | None = None,
    **kw: object,
) -> subprocess.Popen:
    """``steergate <argv>`` as installed, from :func:`run_dir`; ``env``, ``base_env``:
    :func:`installed_env`'s ``extra`` and ``base``; ``kw``: ``subprocess.Popen``'s."""
    return subprocess.Popen(  # type: ignore[call-overload, no-any-return]
        [steergate_bin(), *argv], cwd=run_dir(), env=installed_env(env, base_env), **kw
    )


def steergate_run(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    base_env: Mapping[str, str] | None = None,
    **kw: object,
) -> subprocess.CompletedProcess:
    """:func:`steergate_popen`, run to completion (``subprocess.run``'s keywords)."""
    return subprocess.run(  # type: ignore[call-overload, no-any-return]
        [steergate_bin(), *argv], cwd=run_dir(), env=installed_env(env, base_env), **kw
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all bound at once, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_for(
    check: Callable[[], T], timeout: float, what: str = "condition not reached in time"
) -> T:
    """Poll ``check`` until it returns something truthy (returned), or fail after
    ``timeout`` seconds with ``what``."""
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return found


def wait_port(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False


@dataclass
class RedisProcess:
    """``redis-server`` on its own port and folder; ``stop()``/``start()`` keep the port.
    With ``appendonly``, a restart (``stop()`` is a SIGKILL) reloads the AOF from the
    same folder, like a production Redis after a crash. ``pause()``/``resume()`` hang
    it (SIGSTOP/SIGCONT): connections are accepted by the kernel, nothing answers."""

    port: int = field(default_factory=free_port)
    dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="sg-redis-"))
    proc: subprocess.Popen | None = None
    appendonly: bool = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProcess:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (.ci/run installs it)")
        self.proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes" if self.appendonly else "no",
                "--appendfsync",
                "everysec",
                "--dir",
                self.dir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if not wait_port(self.port, 10):
            raise RuntimeError("redis-server did not start")
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Until it answers PING (an AOF restart answers LOADING first)."""
        import redis

        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if client.ping():
                    return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.02)

    def flush(self) -> None:
        import redis

        redis.Redis(port=self.port).flushall()


def tiny_model_dir() -> Path:
    """The tiny model, generated once per cache folder (deterministic)."""
    path = CACHE / "tiny-model"
    if not (path / "config.json").exists():
        steergate_run(["tiny-model", str(path)], check=True)
    return path


def real_model_dir() -> Path:
    """SmolLM2-135M-Instruct, converted (see ``steergate/engine/real_model.py``): already in the
    user cache after ``make install``; fetched and converted here otherwise."""
    from steergate.engine.real_model import ensure_real_model

    return ensure_real_model()


# The real model's engine: float32 (the tests compare with a float32 transformers
# reference), a 2048-token context and a 1 GiB KV cache so it stays small next to
# the tiny engine on a shared machine (the weights are 0.54 GB in float32).
REAL_ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "2048"]
REAL_ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


@dataclass
class EngineProcess:
    """``steergate engine`` serving a model (the tiny one unless told) on CPU."""

    model: Path
    env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    token: str = ENGINE_TOKEN
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    #: Seconds an engine may take to answer after launch: 75 s on an idle machine, but
    #: ``make test`` runs two engine streams side by side (tests/run_suite.sh).
    START_TIMEOUT_S = 900.0

    def start(self, timeout: float = START_TIMEOUT_S) -> EngineProcess:
        return self.launch().wait_ready(timeout)

    def launch(self) -> EngineProcess:
        """Start the process and return at once (:meth:`wait_ready` waits for it)."""
        env = {"STEERGATE_ENGINE_TOKEN": self.token, "VLLM_CPU_KVCACHE_SPACE": "1", **self.env}
        CACHE.mkdir(parents=True, exist_ok=True)
        self.log_path = CACHE / f"engine-{self.port}.log"
        log = open(self.log_path, "ab")  # a restart appends
        self.proc = steergate_popen(
            ["engine", "--model", str(self.model), "--port", str(self.port), *self.extra_args],
            env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> EngineProcess:
        """Until the launched engine answers its info route; stopped and raised if it
        exits or is not ready within ``timeout`` seconds."""
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited early; log: {self.log_tail()}")
            try:
                r = httpx.get(f"{self.url}/v1/steering/info", headers=self.headers, timeout=2)
                if r.status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"engine not ready in {timeout}s; log: {self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path else ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None


@dataclass
class GatewayProcess:
    """``steergate gateway`` in its own process (``env``: its settings)."""

    env: dict[str, str]
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> GatewayProcess:
        CACHE.mkdir(parents=True, exist_ok=True)
        self.log_path = CACHE / f"gateway-{self.port}.log"
        log = open(self.log_path, "ab")
        self.proc = steergate_popen(
            ["gateway", "--port", str(self.port)],
            self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited early; log: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"gateway not ready in {timeout}s; log: {self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path else ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
