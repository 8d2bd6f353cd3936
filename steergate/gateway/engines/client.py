"""The gateway's one client of the engines: typed calls over the contract in
``steergate/shared/engine_api.py``.

Route handlers never build an engine URL: they call these methods, which scope
tenant identifiers, validate and percent-encode them (``engine_api.latch_path`` /
``vector_path``) and read the answers. Transport, routing and error mapping stay
in ``steergate/gateway/engines/upstream.py``; this module knows *what* to ask, not *how*.

Writes to every engine (vector installs and deletes, latch deletes) never fail a
client request: Redis already holds the truth and an engine is a cache. But an
engine that did not take a write is never ignored either: it is marked ``dirty``,
routed around, and synced from Redis (``steergate/gateway/engines/sync.py``) before it
serves again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import orjson

from steergate.gateway.engines.upstream import Engine, EnginePool, UpstreamResponse, UpstreamStream
from steergate.shared import engine_api
from steergate.shared.errors import APIError
from steergate.shared.scoping import scope, tenant_prefix
from steergate.shared.steering import ModelShape

log = logging.getLogger("steergate.gateway.engines")

#: Background engine deletes queued at once; past it they are shed, never awaited on a
#: request (the periodic engine sync removes what a shed delete would have).
MAX_BACKGROUND = 1024
#: How long one engine may take to answer a cache write (a vector install or a delete:
#: milliseconds of work). One that takes longer is hung: it is marked dirty, as for any
#: missed write, and the client's request goes on without it.
WRITE_TIMEOUT_S = 10.0


class EngineClient:
    def __init__(self, pool: EnginePool, *, background_writes: int = 8) -> None:
        self.pool = pool
        self._background: set[asyncio.Task[None]] = set()
        self._janitor = asyncio.Semaphore(background_writes)

    @property
    def engines(self) -> list[Engine]:
        return self.pool.engines

    def pick(self, affinity: str | None = None) -> Engine:
        return self.pool.pick(affinity)

    def shape(self) -> ModelShape | None:
        return self.pool.shape()

    async def known_shape(self) -> ModelShape:
        """The served model's shape, polling the engines once if none reported it yet."""
        shape = self.pool.shape()
        if shape is None:
            await self.pool.refresh()
            shape = self.pool.shape()
        if shape is None:
            raise APIError("engine_unavailable", "The inference engine is unavailable.")
        return shape

    async def models(self) -> UpstreamResponse:
        return await self.pool.request("GET", engine_api.MODELS)

    async def tokenize(self, content: bytes) -> UpstreamResponse:
        return await self.pool.request("POST", engine_api.TOKENIZE, content=content)

    async def detokenize(self, content: bytes) -> UpstreamResponse:
        return await self.pool.request("POST", engine_api.DETOKENIZE, content=content)

    # -- inference --------------------------------------------------------------------

    async def complete(
        self, engine: Engine, path: str, content: bytes, timeout_s: float | None = None
    ) -> UpstreamResponse:
        return await self.pool.request(
            "POST", path, engine=engine, content=content, timeout_s=timeout_s
        )

    def stream(
        self, engine: Engine, path: str, content: bytes
    ) -> contextlib.AbstractAsyncContextManager[UpstreamStream]:
        return self.pool.stream(path, content, engine=engine)

    # -- vectors ----------------------------------------------------------------------

    async def put_vector(self, engine: Engine, tenant_id: str, name: str, body: bytes) -> bool:
        """Install one vector (``body``: the JSON Redis keeps) on one engine."""
        path = engine_api.vector_path(scope(tenant_id, name))
        return await self._write(engine, "PUT", path, body, ok=(200, 201))

    async def put_vector_everywhere(self, tenant_id: str, name: str, body: bytes) -> None:
        path = engine_api.vector_path(scope(tenant_id, name))
        await self._everywhere("PUT", path, body, ok=(200, 201))

    async def delete_vector_everywhere(self, tenant_id: str, name: str) -> None:
        path = engine_api.vector_path(scope(tenant_id, name))
        await self._everywhere("DELETE", path, None, ok=(204, 404))

    async def list_vectors(self, engine: Engine, tenant_id: str | None = None) -> list[dict]:
        return await self._list(engine, engine_api.VECTORS, tenant_id)

    # -- latches ----------------------------------------------------------------------

    async def delete_latch_everywhere(self, tenant_id: str, conversation_id: str) -> None:
        path = engine_api.latch_path(scope(tenant_id, conversation_id))
        await self._everywhere("DELETE", path, None, ok=(204, 404))

    def forget_latches_soon(self, tenant_id: str, conversation_ids: list[str]) -> None:
        """Drop latches the tenant's quota evicted from every engine, in the background:
        never on a request's path or the settlement loop (an engine's copy is never
        bridged anyway, since Redis no longer expects it; this only frees its memory)."""
        if len(self._background) >= MAX_BACKGROUND:
            return  # shed: the engine sync deletes what these would have
        task = asyncio.create_task(self._forget(tenant_id, conversation_ids))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _forget(self, tenant_id: str, conversation_ids: list[str]) -> None:
        async with self._janitor:
            for conv in conversation_ids:
                await self.delete_latch_everywhere(tenant_id, conv)

    async def delete_engine_entry(self, engine: Engine, kind: str, scoped_id: str) -> bool:
        """Delete one latch (``kind="latch"``) or vector by its engine-side id."""
        path = (
            engine_api.latch_path(scoped_id)
            if kind == "latch"
            else engine_api.vector_path(scoped_id)
        )
        return await self._write(engine, "DELETE", path, None, ok=(204, 404))

    async def list_latches(self, engine: Engine, tenant_id: str | None = None) -> list[dict]:
        return await self._list(engine, engine_api.LATCHES, tenant_id)

    # -- info -------------------------------------------------------------------------

    async def status(self, engine: Engine) -> dict[str, Any]:
        r = await self.pool.request("GET", engine_api.STATUS, engine=engine, timeout_s=2.0)
        if r.status != 200:
            raise APIError("engine_unavailable", "The inference engine is unavailable.")
        doc = r.json()
        return doc if isinstance(doc, dict) else {}

    # -- internals --------------------------------------------------------------------

    async def _list(self, engine: Engine, route: str, tenant_id: str | None) -> list[dict]:
        params = {"prefix": tenant_prefix(tenant_id)} if tenant_id else None
        r = await self.pool.request("GET", route, engine=engine, params=params, timeout_s=10.0)
        if r.status != 200:
            raise APIError("engine_unavailable", "The inference engine is unavailable.")
        rows = r.json()
        if isinstance(rows, dict):  # the vector list may come wrapped
            rows = rows.get("data", [])
        return [row for row in rows if isinstance(row, dict)]

    async def _write(
        self, engine: Engine, method: str, path: str, body: bytes | None, ok: tuple[int, ...]
    ) -> bool:
        """One cache write to one engine; False (and the engine dirty) when it did not
        take it. An engine the poller has found down is not waited for: it is synced
        from Redis when it is back, whatever it missed meanwhile."""
        if not engine.healthy:
            self._missed(engine, method, "engine down")
            return False
        try:
            r = await self.pool.request(
                method, path, engine=engine, content=body, timeout_s=WRITE_TIMEOUT_S
            )
        except APIError as exc:
            self._missed(engine, method, exc.code)
            return False
        if r.status not in ok:
            self._missed(engine, method, str(r.status))
            return False
        return True

    async def _everywhere(
        self, method: str, path: str, body: bytes | None, ok: tuple[int, ...]
    ) -> None:
        await asyncio.gather(*(self._write(e, method, path, body, ok) for e in self.engines))

    @staticmethod
    def _missed(engine: Engine, method: str, why: str) -> None:
        if not engine.dirty:
            log.warning(
                "engine %s did not take a %s (%s): routing around it until it is synced",
                engine.shown,
                method,
                why,
            )
        engine.dirty = True


def miss_code(status: int, body: bytes) -> str | None:
    """``vector_missing`` / ``latch_missing`` when an engine says its cache lacks what
    the gateway expected (409 with one of ``engine_api.MISS_CODES``), else None."""
    if status != 409:
        return None
    try:
        code = orjson.loads(body).get("error", {}).get("code")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return code if code in engine_api.MISS_CODES else None
