"""Real processes for tests: a Redis server and a vLLM CPU engine on free loopback
ports. Tests can stop and restart them to prove failure behaviour."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
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
        subprocess.run(
            [sys.executable, "-m", "steergate.cli", "tiny-model", str(path)],
            check=True,
            cwd=ROOT,
        )
    return path


def real_model_dir() -> Path:
    """SmolLM2-135M-Instruct, converted (see ``engine/real_model.py``): already in the
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

    def start(self, timeout: float = 400.0) -> EngineProcess:
        env = {
            **os.environ,
            "STEERGATE_ENGINE_TOKEN": self.token,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            **self.env,
        }
        CACHE.mkdir(parents=True, exist_ok=True)
        self.log_path = CACHE / f"engine-{self.port}.log"
        log = open(self.log_path, "ab")  # a restart appends
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "steergate.cli",
                "engine",
                "--model",
                str(self.model),
                "--port",
                str(self.port),
                *self.extra_args,
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
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
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "steergate.cli", "gateway", "--port", str(self.port)],
            cwd=ROOT,
            env={**os.environ, **self.env},
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
