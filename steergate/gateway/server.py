"""``steergate gateway [--port 8080] [--host H]``: validate the secrets, then serve."""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from steergate.shared.settings import GatewaySettings

#: An idle keep-alive connection is closed after this (uvicorn's default, made explicit).
KEEP_ALIVE_S = 5

REQUIRED = {
    "admin_key": "STEERGATE_ADMIN_KEY",
    "key_pepper": "STEERGATE_KEY_PEPPER",
    "engine_token": "STEERGATE_ENGINE_TOKEN",
}


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError

    from steergate.shared.settings import GatewaySettings, port_argument, settings_error

    parser = argparse.ArgumentParser(
        prog="steergate gateway",
        description="Serve the multi-tenant gateway. Configuration is read from the "
        "environment (README.md, Configuration); the secrets STEERGATE_ADMIN_KEY, "
        "STEERGATE_KEY_PEPPER and STEERGATE_ENGINE_TOKEN are required.",
    )
    parser.add_argument(
        "--port", type=port_argument, default=None, help="port (env STEERGATE_PORT)"
    )
    parser.add_argument("--host", default=None, help="bind address (env STEERGATE_HOST)")
    parser.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error")
    )
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in {"port": args.port, "host": args.host}.items() if v is not None}
    try:
        # The environment is checked in full even where a flag replaces a value: a bad
        # STEERGATE_PORT beside --port was ignored without a word, and broke the next
        # start that went without the flag.
        settings = GatewaySettings()
        if overrides:
            settings = GatewaySettings(**overrides)
    except ValidationError as exc:
        print(
            f"steergate gateway: refusing to start: {settings_error(exc, GatewaySettings)}",
            file=sys.stderr,
        )
        return 2
    missing = [env for field, env in REQUIRED.items() if not getattr(settings, field)]
    if missing:
        print(
            f"steergate gateway: refusing to start: set {', '.join(missing)} "
            "(secrets the gateway needs; `steergate up` generates them for local use).",
            file=sys.stderr,
        )
        return 2

    import uvicorn

    from steergate.gateway.app import create_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    app = create_app(settings)
    # Everything imported so far lives for the whole process: move it out of the
    # collector's reach, so the occasional full collection does not walk the whole
    # of FastAPI/pydantic/redis-py in the middle of a request (a p99 spike).
    gc.collect()
    gc.freeze()
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        access_log=False,
        # Explicit, so a missing extra fails loudly instead of silently falling back
        # to asyncio + h11 (about twice the per-request cost).
        loop="uvloop",
        **connection_options(settings),
    )
    return 0


def connection_options(settings: GatewaySettings) -> dict[str, Any]:
    """uvicorn options that bound what one client connection may hold: the gateway's
    httptools protocol (``steergate/gateway/edge/http_protocol.py``: request head and body
    timeouts, JSON 400s for malformed HTTP) and the keep-alive idle timeout."""
    from steergate.gateway.edge.http_protocol import gateway_http_protocol

    return {
        "http": gateway_http_protocol(settings.header_timeout_s, settings.body_timeout_s),
        "timeout_keep_alive": KEEP_ALIVE_S,
    }
