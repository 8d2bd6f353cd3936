"""The core's fake engine (``tests/gateway/fake_engine.py``) plus the two read routes
the operator surfaces need and it does not serve: ``GET /v1/steering/status``
(contract §5) and ``GET /v1/steering/vectors`` (the registry listing)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.gateway.fake_engine import EngineState, make_engine
from tests.gateway.servers import ServerThread


def make_engine_with_status(state: EngineState) -> Starlette:
    app = make_engine(state)

    def authed(request: Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {state.token}"

    async def status(request: Request) -> Response:
        if not authed(request):
            return JSONResponse(
                {
                    "error": {
                        "message": "bad token",
                        "type": "x",
                        "param": None,
                        "code": "unauthorized",
                    }
                },
                status_code=401,
            )
        return JSONResponse(
            {
                "latched_conversations": len(state.latches),
                "latched_bytes": sum(int(v.get("bytes", 0)) for v in state.latches.values()),
                "max_latched_conversations": state.max_latched,
                "max_latched_bytes": state.max_bytes,
                "evictions": 0,
                "refusals": 0,
                "bridges": 0,
                "latches_stored": len(state.latches),
                "epoch": state.epoch,
            }
        )

    async def vectors(request: Request) -> Response:
        if not authed(request):
            return JSONResponse({"error": {"message": "bad token"}}, status_code=401)
        return JSONResponse([{"name": n, "hook": v.get("hook")} for n, v in state.vectors.items()])

    # Before the fake's own routes, so GET /v1/steering/vectors is not shadowed.
    app.router.routes[:0] = [
        Route("/v1/steering/status", status),
        Route("/v1/steering/vectors", vectors),
    ]
    return app


@contextmanager
def status_engine(token: str, **state_kw: object) -> Iterator[tuple[EngineState, ServerThread]]:
    state = EngineState(token=token, **state_kw)  # type: ignore[arg-type]
    server = ServerThread(make_engine_with_status(state)).start()
    try:
        yield state, server
    finally:
        server.stop()
