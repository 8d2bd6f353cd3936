"""Run ASGI apps under uvicorn in background threads (real sockets, real streaming)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from tests.harness import free_port


@dataclass
class ServerThread:
    app: Any
    port: int = field(default_factory=free_port)
    server: uvicorn.Server | None = None
    thread: threading.Thread | None = None
    loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="on",
            access_log=False,
        )
        self.server = uvicorn.Server(config)
        self.loop = asyncio.new_event_loop()

        def serve() -> None:
            assert self.loop is not None and self.server is not None
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.server.serve())

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def call(self, coro: Any, timeout: float = 10) -> Any:
        """Run ``coro`` on the server's own event loop (where its clients live)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(10)
