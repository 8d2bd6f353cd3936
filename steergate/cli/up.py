"""``steergate up``: the engine, the gateway and a demo tenant in one command.

The engine runs as a child process in its own process group (vLLM spawns its own
workers; killing the group is the only way to be sure none outlives us). The
gateway runs in this process under uvicorn. Secrets are generated per run unless
the environment sets them, so a bare ``steergate up`` is safe to leave running on
a laptop, and ``REDIS_URL`` switches from the embedded store to Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NoReturn, TypeVar

import httpx
import numpy as np
from pydantic import SecretStr, ValidationError
from pydantic_settings import BaseSettings

from steergate.shared.settings import (
    EngineSettings,
    GatewaySettings,
    display_url,
    port_argument,
    settings_error,
)

S = TypeVar("S", bound=BaseSettings)

DEMO_TENANT = "demo"
DEMO_VECTOR = "calm"
DEMO_CONVERSATION = "demo-1"
# Deliberately small next to the engine's default caps (1024 latches, 256 MiB),
# so the demo tenant never makes a later tenant's limits an overcommit.
DEMO_LIMITS: dict[str, Any] = {
    "rpm": 600,
    "tpm": 200_000,
    "max_concurrency": 8,
    "latch_count": 64,
    "latch_bytes": 16 * 1024 * 1024,
    "vector_count": 32,
    "vector_bytes": 16 * 1024 * 1024,
    "latch_policy": "evict_oldest",
}
STOP_GRACE_S = 20.0


@dataclass(frozen=True)
class Secrets:
    engine_token: str
    admin_key: str
    key_pepper: str
    generated: tuple[str, ...]  # env names we made up for this run


def resolve_secrets(env: GatewaySettings) -> Secrets:
    """The environment's secrets where set, fresh random ones (256 bits) otherwise."""
    made: list[str] = []

    def pick(value: Any, env_name: str, prefix: str = "") -> str:
        if value is not None and value.get_secret_value():
            return str(value.get_secret_value())
        made.append(env_name)
        return prefix + secrets.token_urlsafe(32)

    return Secrets(
        engine_token=pick(env.engine_token, "STEERGATE_ENGINE_TOKEN"),
        admin_key=pick(env.admin_key, "STEERGATE_ADMIN_KEY", "sg-admin-"),
        key_pepper=pick(env.key_pepper, "STEERGATE_KEY_PEPPER"),
        generated=tuple(made),
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    """Checked before the engine starts, so a taken port fails in a second, not after
    the engine's minute of start-up. A host that does not resolve raises
    ``socket.gaierror`` (it is not "in use")."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except socket.gaierror:
            raise
        except OSError:
            return False
    return True


def demo_vector(hidden_size: int, name: str = DEMO_VECTOR) -> list[float]:
    """A unit-norm direction, random but identical on every run (seeded by the name),
    so re-registering it on a persistent Redis keeps its digest and its latches."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    v = np.random.default_rng(seed).standard_normal(hidden_size).astype(np.float32)
    v /= np.linalg.norm(v)
    return [float(x) for x in v]


def demo_request_body(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me about your day."}],
        "max_tokens": 16,
        "conversation_id": DEMO_CONVERSATION,
        "steering": {"vectors": [{"name": DEMO_VECTOR, "scale": 4}], "latch": True},
    }


def curl_command(gateway_url: str, key: str, model: str) -> str:
    """The copy-paste quick-start request (``-i`` so the latch header shows)."""
    body = json.dumps(demo_request_body(model), separators=(",", ":"))
    return " \\\n  ".join([
        f"curl -sS -i {shlex.quote(gateway_url + '/v1/chat/completions')}",
        f"-H {shlex.quote('Authorization: Bearer ' + key)}",
        "-H 'Content-Type: application/json'",
        f"-d {shlex.quote(body)}",
    ])


# ----------------------------------------------------------------------------- engine


def stop_process_group(proc: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the child's whole process group, wait, SIGKILL what is left.

    Waits for the group to be empty, not just for the leader: vLLM's engine-core
    and worker processes share the group and may outlive the API server briefly."""
    pgid = proc.pid  # start_new_session=True makes the child its group leader

    def group_alive() -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # pragma: no cover - the group is ours
            return True
        return True

    def signal_group(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)

    signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader so it stops counting as a group member
        if proc.returncode is not None and not group_alive():
            return
        time.sleep(0.1)
    signal_group(signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 10
    while group_alive() and time.monotonic() < deadline:
        time.sleep(0.1)


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if ``up`` itself dies (even by
    SIGKILL), so a crashed ``up`` does not leave an engine holding the CPU."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Engine:
    """``steergate engine`` as a child process whose output goes to a log file;
    the last line is kept for the progress display."""

    model: str
    port: int
    token: str
    log_path: Path
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    last_line: str = ""
    last_error: str = ""  # the last line that names an exception (the cause, usually)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env, "STEERGATE_ENGINE_TOKEN": self.token}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "steergate.cli", "engine", "--model", self.model,
             "--port", str(self.port), *self.extra_args],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_die_with_parent,
        )
        threading.Thread(target=self._drain, args=(self.proc.stdout,), daemon=True).start()

    def _drain(self, stream: IO[bytes] | None) -> None:
        # Keep reading for the engine's whole life: a full pipe would block it.
        if stream is None:
            return
        # Appended, under a header per start: a failed restart must not wipe the log of
        # the run before it.
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== steergate up: engine start, {time.strftime('%Y-%m-%d %H:%M:%S')}"
                      f" ({self.model}) ====\n".encode())
            for raw in iter(stream.readline, b""):
                log.write(raw)
                log.flush()
                line = raw.decode(errors="replace").strip()
                if line:
                    self.last_line = line
                    if _ERROR_LINE.search(line):
                        self.last_error = line

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def wait_ready(self, timeout_s: float, progress: Progress) -> dict[str, Any]:
        """Poll ``/v1/steering/info`` (with the token) until it answers; its body."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                code = self.exited()
                if code is not None:
                    raise EngineFailed(f"the engine exited with status {code} while starting", self)
                with contextlib.suppress(httpx.HTTPError):
                    r = client.get(f"{self.url}/v1/steering/info", headers=self.headers)
                    if r.status_code == 200:
                        return dict(r.json())
                progress.tick(self.last_line)
                time.sleep(1.0)
        raise EngineFailed(f"the engine was not ready after {timeout_s:.0f} s", self)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc)
            self.proc = None


class EngineFailed(RuntimeError):
    def __init__(self, message: str, engine: Engine) -> None:
        error = engine.last_error
        cause = f"last error in its log: {error!r}; " if error and error != engine.last_line else ""
        super().__init__(f"{message}; {cause}last engine log line: {engine.last_line!r}; "
                         f"full log: {engine.log_path}")


#: A log line that names an exception ("ValueError: ...", "RuntimeError: ...").
_ERROR_LINE = re.compile(r"\b[A-Za-z_.]*(?:Error|Exception)\b:")


class Progress:
    """One self-rewriting status line on a terminal; a line every 15 s otherwise."""

    def __init__(self, label: str, stream: IO[str] = sys.stderr) -> None:
        self.label = label
        self.stream = stream
        self.start = time.monotonic()
        self.tty = stream.isatty()
        self._last_print = -1e9

    def tick(self, detail: str) -> None:
        elapsed = time.monotonic() - self.start
        if self.tty:
            width = shutil.get_terminal_size((100, 20)).columns
            head = f"{self.label} {elapsed:4.0f}s  "
            self.stream.write("\r\033[K" + (head + detail)[: width - 1])
            self.stream.flush()
        elif elapsed - self._last_print >= 15:
            self._last_print = elapsed
            print(f"{self.label} {elapsed:.0f}s  {detail[:160]}", file=self.stream, flush=True)

    def done(self, message: str) -> None:
        elapsed = time.monotonic() - self.start
        if self.tty:
            self.stream.write("\r\033[K")
        print(f"{message} in {elapsed:.0f} s", file=self.stream, flush=True)


# ----------------------------------------------------------------------------- demo


@dataclass(frozen=True)
class Demo:
    tenant_key: str
    model: str


async def _send(client: httpx.AsyncClient, method: str, url: str, *, patience_s: float = 30.0,
                **kwargs: Any) -> httpx.Response:
    """One API call, retried while the gateway answers 502/503: just after start it may
    not have polled the engine's shape yet."""
    deadline = time.monotonic() + patience_s
    while True:
        r = await client.request(method, url, **kwargs)
        if r.status_code not in (502, 503) or time.monotonic() > deadline:
            return r
        await asyncio.sleep(0.5)


async def create_demo(gateway_url: str, admin_key: str, info: dict[str, Any],
                      engine_model: str) -> Demo:
    """The demo tenant, a key for it and its named vector, through the public
    admin and tenant APIs (what an operator would do with curl)."""
    admin = {"Authorization": f"Bearer {admin_key}"}
    limits = dict(DEMO_LIMITS)
    # Never ask for more than the engine holds: that would be a 409 overcommit.
    caps = {"latch_count": int(info.get("max_latched_conversations", 1024)),
            "latch_bytes": int(info.get("max_latched_bytes", 1 << 28))}
    for name, cap in caps.items():
        limits[name] = min(limits[name], cap)
    async with httpx.AsyncClient(base_url=gateway_url, timeout=30.0) as client:
        r = await _send(client, "POST", "/admin/tenants", headers=admin,
                        json={"id": DEMO_TENANT, "name": "Demo tenant", "limits": limits})
        if r.status_code == 409:  # already there (persistent Redis): reuse it
            existing = await _send(client, "GET", f"/admin/tenants/{DEMO_TENANT}", headers=admin)
            if existing.status_code != 200:
                _fail("create the demo tenant", r)
        elif r.status_code != 201:
            _fail("create the demo tenant", r)
        r = await _send(client, "POST", f"/admin/tenants/{DEMO_TENANT}/keys", headers=admin,
                        json={})
        if r.status_code != 201:
            _fail("create a key for the demo tenant", r)
        key = str(r.json()["key"])
        layer = int(info["num_layers"]) // 2
        r = await _send(
            client, "PUT", f"/v1/steering/vectors/{DEMO_VECTOR}",
            headers={"Authorization": f"Bearer {key}"},
            json={"hook": "post_block",
                  "layers": {str(layer): demo_vector(int(info["hidden_size"]))},
                  "description": f"demo: fixed random unit direction, post_block layer {layer}"},
        )
        if r.status_code not in (200, 201):
            _fail(f"register the demo vector {DEMO_VECTOR!r}", r)
    return Demo(tenant_key=key, model=str(info.get("model") or engine_model))


def _fail(what: str, r: httpx.Response) -> NoReturn:
    raise RuntimeError(f"could not {what}: HTTP {r.status_code} {r.text[:500]}")


def quick_start(*, gateway_url: str, admin_key: str, demo: Demo, store: str, engine: Engine,
                default_model: bool) -> str:
    model_note = (f"SmolLM2-135M-Instruct (the default; {demo.model})"
                  if default_model else demo.model)
    return "\n".join([
        "",
        "steergate is up",
        "",
        f"  gateway     {gateway_url}",
        f"  dashboard   {gateway_url}/dashboard",
        f"  admin key   {admin_key}",
        f"  demo key    {demo.tenant_key}   (tenant {DEMO_TENANT!r})",
        f"  model       {model_note}",
        f"  store       {store}",
        f"  engine      {engine.url} (private; log: {engine.log_path})",
        "",
        f"Steer with the demo tenant's vector {DEMO_VECTOR!r} and latch the conversation:",
        "",
        curl_command(gateway_url, demo.tenant_key, demo.model),
        "",
        "Send it again without \"steering\" (same conversation_id): the latch steers it "
        "(x-steering-latch: bridged).",
        "",
        "To follow the README tour (and the CLI) in another shell, paste:",
        "",
        f"  export KEY={demo.tenant_key} STEERGATE_ADMIN_KEY={admin_key}",
        f"  export STEERGATE_GATEWAY_URL={gateway_url}",
        "",
        "Ctrl-C stops everything.",
        "",
    ])


# ----------------------------------------------------------------------------- main


def default_model_engine_args(engine_args: list[str]) -> list[str]:
    """The default model is served in float32 unless the user chose a dtype: it is
    small enough for float32 on CPU, and it is then the same arithmetic as the
    float32 ``transformers`` model that vectors are made and checked with (vLLM's
    ``auto`` would serve a float32 checkpoint as bfloat16 on x86 CPUs)."""
    if any(a == "--dtype" or a.startswith("--dtype=") for a in engine_args):
        return engine_args
    return ["--dtype", "float32", *engine_args]


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="steergate up",
        description="Start the engine, the gateway and a demo tenant. Arguments not listed "
                    "here are passed to the engine (vLLM), e.g. --max-model-len 4096.",
    )
    p.add_argument("--model", help="model path or Hugging Face id (default: SmolLM2-135M-Instruct, "
                                    "fetched and converted on first use)")
    p.add_argument(
        "--port", type=port_argument, default=None,
        help="gateway port (default STEERGATE_PORT, or 8080)",
    )
    p.add_argument(
        "--host", default=None, help="gateway bind address (default STEERGATE_HOST, or 127.0.0.1)"
    )
    p.add_argument("--engine-timeout", type=float, default=900.0,
                   help="seconds to wait for the engine to become ready (default 900)")
    return p.parse_known_args(argv)


def _checked(settings_type: type[S], **given: Any) -> S | None:
    """``settings_type(**given)``, the rest read from the environment, or None once its
    faults are printed (one line naming each variable)."""
    try:
        return settings_type(**given)
    except ValidationError as exc:
        print(f"steergate up: {settings_error(exc, settings_type)}", file=sys.stderr)
        return None


def _model_path_problem(model: str | None) -> str | None:
    """Why ``--model`` cannot be served, when it is a local path (a Hugging Face id is
    left to vLLM). Checked before the engine's minute-long start."""
    if model is None or not (model.startswith(("/", ".", "~")) or os.path.exists(model)):
        return None
    path = Path(model).expanduser()
    if not path.exists():
        return f"--model {model!r}: no such file or directory"
    if not path.is_dir() or not (path / "config.json").is_file():
        return f"--model {model!r}: not a model directory (it has no config.json)"
    return None


def _redis_problem(redis_url: str | None, timeout_s: float = 3.0) -> str | None:
    """Why REDIS_URL cannot be used now (None when unset or answering). Checked before
    the engine starts: otherwise a Redis that is not there cost the engine's whole start
    and ended in an error that did not name it."""
    if not redis_url:
        return None
    from steergate.gateway.store.connection import connect

    async def ping() -> None:
        client = connect(redis_url, timeout_s)
        try:
            await asyncio.wait_for(client.ping(), timeout_s + 1)
        finally:
            await client.aclose()

    try:
        asyncio.run(ping())
    except Exception as exc:
        return (f"cannot reach Redis at REDIS_URL ({display_url(redis_url)}): "
                f"{type(exc).__name__}; start it, "
                "or unset REDIS_URL for the embedded store")
    return None


def _log_store(redis_url: str | None) -> str:
    if redis_url:
        return f"Redis ({display_url(redis_url)})"
    banner = ("WARNING: REDIS_URL is not set, so the gateway uses its embedded in-process store. "
              "Tenants, keys, quotas and usage live in this process only: they are lost on exit "
              "and cannot be shared by a second gateway. Set REDIS_URL for anything but a demo.")
    print("\n" + "!" * 78 + "\n" + banner + "\n" + "!" * 78 + "\n", file=sys.stderr, flush=True)
    return "embedded, single process only (set REDIS_URL to use Redis)"


async def _serve(settings: GatewaySettings, engine: Engine, info: dict[str, Any], *,
                 default_model: bool, store: str) -> int:
    import uvicorn

    from steergate.gateway.app import create_app
    from steergate.gateway.server import connection_options

    server = uvicorn.Server(uvicorn.Config(
        create_app(settings), host=settings.host, port=settings.port, log_level="warning",
        lifespan="on", **connection_options(settings),
    ))
    connect_host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    gateway_url = f"http://{connect_host}:{settings.port}"
    status = {"code": 0}

    async def after_start() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.05)
        try:
            admin_key = settings.admin_key.get_secret_value() if settings.admin_key else ""
            demo = await create_demo(gateway_url, admin_key, info, engine.model)
        except Exception as exc:  # the gateway runs, but the demo is not usable
            print(f"steergate up: {exc}", file=sys.stderr, flush=True)
            status["code"] = 1
            server.should_exit = True
            return
        print(quick_start(gateway_url=gateway_url, admin_key=admin_key, demo=demo,
                          store=store, engine=engine, default_model=default_model), flush=True)

    async def watch_engine() -> None:
        while not server.should_exit:
            code = engine.exited()
            if code is not None:
                print(f"steergate up: the engine exited with status {code}; stopping "
                      f"(log: {engine.log_path})", file=sys.stderr, flush=True)
                status["code"] = 1
                server.should_exit = True
                return
            await asyncio.sleep(1.0)

    tasks = [asyncio.create_task(after_start()), asyncio.create_task(watch_engine())]
    try:
        await server.serve()
    finally:
        for t in tasks:
            t.cancel()
    if not server.started and status["code"] == 0:
        status["code"] = 1  # e.g. the port was taken; uvicorn has said why
    return status["code"]


def main(argv: list[str]) -> int:
    # Imported here, not at the top: the gateway image has no engine package.
    from steergate.engine.real_model import ModelFetchError, ensure_real_model, steergate_home

    args, engine_args = _parse(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # SIGTERM behaves like Ctrl-C: unwind through the finally below, which stops the
    # engine's process group. uvicorn restores this handler and re-raises the signal
    # after its own graceful shutdown, so the same path runs then too.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    # Every setting of both halves, before anything starts: a bad engine setting used to
    # surface a minute later, deep in a worker's traceback.
    # `up` serves its own engine, so STEERGATE_ENGINE_URLS is not read: a stale value used
    # to refuse a start that would never have used it. Its default stands in.
    if os.environ.get("STEERGATE_ENGINE_URLS"):
        print("steergate up: STEERGATE_ENGINE_URLS is ignored: up starts and serves its own "
              "engine", file=sys.stderr)
    env = _checked(GatewaySettings,
                   engine_urls=GatewaySettings.model_fields["engine_urls"].default)
    if env is None or _checked(EngineSettings) is None:
        return 2
    problem = _model_path_problem(args.model) or _redis_problem(env.redis_url)
    if problem:
        print(f"steergate up: {problem}", file=sys.stderr)
        return 2
    keys = resolve_secrets(env)
    home = steergate_home()
    default_model = args.model is None
    engine: Engine | None = None
    # The flags win; else the gateway's own settings (STEERGATE_PORT, STEERGATE_HOST).
    args.port = env.port if args.port is None else args.port
    args.host = env.host if args.host is None else args.host
    try:
        free = port_is_free(args.host, args.port)
    except socket.gaierror as exc:
        print(f"steergate up: cannot bind {args.host!r}: {exc.strerror}", file=sys.stderr)
        return 2
    if not free:
        print(f"steergate up: {args.host}:{args.port} is in use; choose another with --port",
              file=sys.stderr)
        return 1
    try:
        if default_model:
            model = str(ensure_real_model())  # prints its progress on the first run only
            engine_args = default_model_engine_args(engine_args)
        else:
            model = args.model
        store = _log_store(env.redis_url)
        engine = Engine(model=model, port=free_port(), token=keys.engine_token,
                        log_path=home / "logs" / "engine.log", extra_args=engine_args)
        print(f"starting the engine ({model}) on a private port; this takes about a minute "
              f"on CPU; log: {engine.log_path}", file=sys.stderr, flush=True)
        engine.start()
        progress = Progress("  engine starting")
        info = engine.wait_ready(args.engine_timeout, progress)
        progress.done(f"engine ready (hidden_size {info.get('hidden_size')}, "
                      f"{info.get('num_layers')} layers)")
        settings = GatewaySettings(
            redis_url=env.redis_url, engine_urls=engine.url,
            engine_token=SecretStr(keys.engine_token), admin_key=SecretStr(keys.admin_key),
            key_pepper=SecretStr(keys.key_pepper), host=args.host, port=args.port,
        )
        return asyncio.run(_serve(settings, engine, info, default_model=default_model,
                                  store=store))
    except KeyboardInterrupt:
        print("\nstopping", file=sys.stderr, flush=True)
        return 0
    except (EngineFailed, ModelFetchError, RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"steergate up: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if engine is not None:
            # A second Ctrl-C must not interrupt the cleanup and orphan the engine.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            engine.stop()
            print("engine stopped", file=sys.stderr, flush=True)
