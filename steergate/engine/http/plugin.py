"""The ``vllm.endpoint_plugins`` entry point: a thin adapter between vLLM's API server
and the pure modules (latch, registry, resolve).

``attach_router`` runs in ``build_app`` before vLLM adds its own middlewares, so
ours sit inside vLLM's (CORS stays outermost, which keeps preflight working) and
outside the router. Order, outermost first: the request id, the error shape, token
auth, the JSON depth bound, then the steering rewrite. It also redacts scoped ids
from uvicorn's access log.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
from argparse import Namespace
from typing import Any

from fastapi import FastAPI
from starlette.middleware import Middleware

from steergate.engine import capture_io
from steergate.engine.http.auth import EngineTokenMiddleware
from steergate.engine.http.capture import CaptureSupport
from steergate.engine.http.rewrite import SteeringRewriteMiddleware
from steergate.engine.http.routes import build_router
from steergate.engine.http.runtime import RuntimeRef, ServedArchitecture, SteeringRuntime
from steergate.shared import request_id
from steergate.shared.jsondepth import JsonDepthMiddleware
from steergate.shared.openai_errors import OpenAIErrorMiddleware
from steergate.shared.request_id import RequestIdMiddleware
from steergate.shared.settings import EngineSettings
from steergate.shared.steering import DTYPE_MAX, ModelShape

log = logging.getLogger("steergate.http")


class SteeringEndpointPlugin:
    name = "steergate"
    # None: load for every task set. The token middleware comes with this plugin, so
    # gating it on "generate" would leave a pooling-only engine unauthenticated.
    required_tasks: tuple[str, ...] | None = None

    def __init__(self, settings: EngineSettings | None = None) -> None:
        self.settings = settings or EngineSettings()
        self.runtime = RuntimeRef()

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(build_router(self.runtime))
        token = (
            self.settings.engine_token.get_secret_value() if self.settings.engine_token else None
        )
        # Ours, outermost first, all outside vLLM's own: every response carries the
        # gateway's request id and every log line written while serving it ends with it
        # (shared/request_id.py); vLLM's errors (``"code": 400``) and ours leave in one
        # shape; the token is checked, then the JSON depth before anything parses a
        # body; then the steering rewrite.
        stack = [
            Middleware(RequestIdMiddleware),
            Middleware(OpenAIErrorMiddleware),
            Middleware(EngineTokenMiddleware, token=token),
            Middleware(JsonDepthMiddleware),
            Middleware(SteeringRewriteMiddleware, runtime=self.runtime),
        ]
        for entry in reversed(stack):  # add_middleware prepends: add the innermost first
            app.add_middleware(entry.cls, *entry.args, **entry.kwargs)
        request_id.install_log_records()
        redact_access_log()

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        if not self.settings.engine_token or not self.settings.engine_token.get_secret_value():
            raise RuntimeError(
                "STEERGATE_ENGINE_TOKEN is required: the engine refuses to start without it"
            )
        if engine_client is None:
            raise RuntimeError("steergate needs a running engine (not the render-only server)")
        count = getattr(args, "api_server_count", None)
        if count is not None and count > 1:
            # The latch controller and registry are per process; a second API server
            # would keep a second, disagreeing copy of both.
            raise RuntimeError(
                "steergate needs --api-server-count 1 (latches live in the API server)"
            )
        model_config = engine_client.vllm_config.model_config
        shape = ModelShape(
            hidden_size=int(model_config.get_hidden_size()),
            num_layers=int(model_config.get_total_num_hidden_layers()),
        )
        _share_vllm_log_handlers()
        runtime = SteeringRuntime.create(
            _served_name(args), shape, self.settings,
            capture=capture_support(engine_client.vllm_config),
            served=_served_architecture(model_config, steering=self.settings.steering == "on"),
            dtype=dtype_name(model_config),
        )
        self.runtime.set(runtime)
        state.steergate = runtime
        log.info(
            "steergate: %s (%s, steering %s) hidden_size=%d num_layers=%d "
            "caps=%d latches/%d bytes epoch=%s",
            runtime.served.architecture,
            runtime.served.convention or "no convention",
            "on" if runtime.served.steered else "off",
            shape.hidden_size,
            shape.num_layers,
            runtime.controller.max_count,
            runtime.controller.max_bytes,
            runtime.epoch,
        )


def dtype_name(model_config: Any) -> str:
    """The served dtype (``torch.bfloat16`` -> ``"bfloat16"``), as ``DTYPE_MAX`` names
    it; an unknown one is held to float32's range."""
    name = str(getattr(model_config, "dtype", "float32")).removeprefix("torch.")
    return name if name in DTYPE_MAX else "float32"


def capture_support(vllm_config: Any) -> CaptureSupport:
    """The API server's view of capture: the longest sequence, and why this engine
    cannot capture, if so (:func:`engine.capture_io.refusal`, answered as a 501
    ``not_implemented`` naming ``capture``)."""
    max_len = int(getattr(vllm_config.model_config, "max_model_len", 0) or 2048)
    return CaptureSupport(max_len, capture_io.refusal(vllm_config))


def _served_architecture(model_config: Any, steering: bool) -> ServedArchitecture:
    """The served model's architecture and layer convention. With steering on, an
    unsupported one has already stopped the workers' start (steergate/engine/worker/runner.py);
    this raises the same refusal in case it reaches here."""
    from steergate.engine.worker import conventions

    arch = conventions.architecture_of(model_config)
    vllm_class = conventions.vllm_class_of(model_config)
    if not steering:
        return ServedArchitecture(arch, vllm_class, None)
    support = conventions.lookup(arch, vllm_class)
    return ServedArchitecture(arch, vllm_class, support.convention.name)


def _served_name(args: Namespace) -> str:
    names = getattr(args, "served_model_name", None)
    if names:
        return str(names[0] if isinstance(names, (list, tuple)) else names)
    return str(getattr(args, "model", ""))


#: The id segment of the routes that carry a scoped id, and a ``prefix=`` query value.
_SCOPED_PATH = re.compile(r"(/v1/steering/(?:latches|vectors)/)([^/?#\s]+)")
_PREFIX_QUERY = re.compile(r"([?&]prefix=)([^&#\s]*)")


class ScopedIdRedactor(logging.Filter):
    """Rewrites uvicorn's access-log record so it never carries a scoped id.

    ``PUT /v1/steering/vectors/alpha~calm`` is logged as ``PUT
    /v1/steering/vectors/id:3fa2c0d1``: 8 hex of an HMAC under a key drawn at start,
    so lines of one run still correlate but a log reader cannot confirm a guessed
    tenant or vector name (a plain hash of ``alpha~calm`` could be brute-forced).
    uvicorn logs ``(client_addr, method, full_path, http_version, status)``."""

    def __init__(self, key: bytes | None = None) -> None:
        super().__init__("steergate.redact")
        self._key = key or secrets.token_bytes(32)

    def tag(self, value: str) -> str:
        mac = hmac.new(self._key, value.encode("utf-8", "surrogateescape"), hashlib.sha256)
        return "id:" + mac.hexdigest()[:8]

    def redact(self, path: str) -> str:
        path = _SCOPED_PATH.sub(lambda m: m.group(1) + self.tag(m.group(2)), path)
        return _PREFIX_QUERY.sub(lambda m: m.group(1) + self.tag(m.group(2)), path)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], self.redact(args[2]), *args[3:])
        return True


def redact_access_log() -> None:
    """Install :class:`ScopedIdRedactor` on ``uvicorn.access`` once per process. A
    logger's filters survive uvicorn's later ``dictConfig`` (it replaces handlers only)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, ScopedIdRedactor) for f in access.filters):
        access.addFilter(ScopedIdRedactor())


def _share_vllm_log_handlers() -> None:
    """Route the pure modules' ``steergate.*`` loggers (e.g. the oversize-latch
    warning) through vLLM's handlers, so they land in the engine log with vLLM's
    format instead of being dropped by an unconfigured root logger."""
    ours, theirs = logging.getLogger("steergate"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False
