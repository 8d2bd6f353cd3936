"""``steergate engine``: stock vLLM's OpenAI server with this project's plugins.

We only build an argv and exec it, so vLLM owns the process (signals, exit code,
logging) exactly as if it had been started by hand. The engine token is enforced
by the endpoint plugin's middleware, not by ``--api-key`` (which would also guard
routes with a second, differently-shaped error).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8100
# GiB of KV cache on CPU; vLLM's own default (4 GiB+) is far too much for a shared
# test machine and the tiny model. Operators set it explicitly for real models.
DEFAULT_CPU_KVCACHE_GIB = "1"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"

USAGE = ("usage: steergate engine --model PATH_OR_HF_ID [--port 8100] [--no-steering] "
         "[vLLM args...]")
#: Serve the model unsteered (sets STEERGATE_STEERING=off): the only way to serve an
#: architecture without a verified steering convention (docs/steering-op.md).
NO_STEERING = "--no-steering"


def _has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def build_command(args: list[str], python: str = sys.executable) -> list[str]:
    """argv for vLLM's server: ours first, then the user's (which win on repeats
    only where vLLM lets the last one win, so we never add a flag the user gave)."""
    model = _flag_value(args, "--model")
    if model is None:
        raise ValueError("--model is required")
    cmd = [python, "-m", SERVER_MODULE, *args]
    if not _has_flag(args, "--host"):
        cmd += ["--host", DEFAULT_HOST]
    if not _has_flag(args, "--port"):
        cmd += ["--port", str(DEFAULT_PORT)]
    if not _has_flag(args, "--served-model-name"):
        cmd += ["--served-model-name", model]
    return cmd


def build_env(base: Mapping[str, str]) -> dict[str, str]:
    env = dict(base)
    # Both of our entry points (general + endpoint plugin) are named "steergate";
    # vLLM loads endpoint plugins only when they are named here.
    env["VLLM_PLUGINS"] = "steergate"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KVCACHE_GIB)
    # Idle keep-alive connections outlive the gateway's pool TTL
    # (steergate/gateway/engines/http1.py, IDLE_TTL_S = 4 s) by a wide margin, so the engine
    # never closes a connection the gateway may be writing a POST to (uvicorn's default is 5 s).
    env.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "30")
    # The V1 model runner is the default everywhere: it is the one steering has run on
    # end to end. On GPUs with Triton vLLM 0.32 would pick V2, whose adapter is only
    # unit-tested so far, so V2 is opt-in: an operator's VLLM_USE_V2_MODEL_RUNNER=1 is
    # kept (HiSparse needs it; watermarking selects V2 by itself) and the V2 adapter steers.
    # See docs/steering-op.md, "V1 and V2 model runners".
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    return env


def apply_no_steering(args: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """``--no-steering`` is ours, not vLLM's: drop it and set STEERGATE_STEERING=off,
    which every engine process (API server, workers) reads."""
    if NO_STEERING not in args:
        return args, env
    return [a for a in args if a != NO_STEERING], {**env, "STEERGATE_STEERING": "off"}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        print(USAGE)
        return 0 if args else 2
    if _has_flag(args, "--api-key"):
        print("steergate engine: do not pass --api-key; the engine token is "
              "STEERGATE_ENGINE_TOKEN", file=sys.stderr)
        return 2
    if not os.environ.get("STEERGATE_ENGINE_TOKEN"):
        print("steergate engine: STEERGATE_ENGINE_TOKEN is not set; refusing to start an "
              "engine that anyone on the network could call", file=sys.stderr)
        return 2
    # The engine's own settings, before vLLM's minute-long start: read first inside a
    # worker, a bad one surfaced as "Engine core initialization failed".
    from pydantic import ValidationError

    from steergate.shared.settings import EngineSettings, settings_error

    try:
        EngineSettings()
    except ValidationError as exc:
        print(f"steergate engine: {settings_error(exc, EngineSettings)}", file=sys.stderr)
        return 2
    args, env = apply_no_steering(args, build_env(os.environ))
    try:
        cmd = build_command(args)
    except ValueError as exc:
        print(f"steergate engine: {exc}\n{USAGE}", file=sys.stderr)
        return 2
    os.execvpe(cmd[0], cmd, env)
    return 0  # pragma: no cover - exec does not return


if __name__ == "__main__":
    raise SystemExit(main())
