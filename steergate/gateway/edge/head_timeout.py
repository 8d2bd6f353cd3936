"""The gateway's HTTP/1.1 server protocol: uvicorn's httptools protocol, plus a bound on
how long a connection may take to send a complete request head.

uvicorn closes a keep-alive connection that stays idle after a response
(``timeout_keep_alive``), but not one that never sends a request, nor one that sends its
head a byte at a time (slowloris): each would hold a socket and its buffers for ever.
Here a timer starts when the connection opens and again when the next request's first
byte arrives; the connection is closed unless the head is complete when it fires.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("steergate.gateway.http")


class HeadTimeoutProtocol(HttpToolsProtocol):
    head_timeout_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_timer is None:
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            log.debug("closing a connection that sent no complete request head")
            self.transport.close()


def head_timeout_protocol(head_timeout_s: float) -> type[HeadTimeoutProtocol]:
    """The protocol class for uvicorn's ``http=`` option, with this bound."""
    return type("HeadTimeoutProtocol", (HeadTimeoutProtocol,), {"head_timeout_s": head_timeout_s})
