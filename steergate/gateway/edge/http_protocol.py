"""The gateway's HTTP/1.1 server protocol: uvicorn's httptools protocol, plus a bound on
how long a connection may take to send a complete request head, and the project's error
shape for a request that is not HTTP at all.

uvicorn closes a keep-alive connection that stays idle after a response
(``timeout_keep_alive``), but not one that never sends a request, nor one that sends its
head a byte at a time (slowloris): each would hold a socket and its buffers for ever.
Here a timer starts when the connection opens and again when the next request's first
byte arrives; the connection is closed unless the head is complete when it fires.

A request the HTTP parser rejects (a control character in a header, a malformed request
line, a bad chunk size) never reaches the app, so no middleware shapes its answer:
uvicorn writes ``text/plain`` "Invalid HTTP request received.". Here it is the same 400
as every other: ``{"error": {"message", "type", "param", "code": "invalid_request",
"request_id"}}`` with ``x-request-id`` and ``x-should-retry: false``, then the
connection closes (the parser cannot find where the next request would begin).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from steergate.shared import errors, request_id

log = logging.getLogger("steergate.gateway.http")

MALFORMED = "the request is not valid HTTP/1.1 (request line, a header or the body framing)"


class GatewayHTTPProtocol(HttpToolsProtocol):
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

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to what its parser refuses (``msg``: uvicorn's words, logged
        by it already), in the project's error shape."""
        self._disarm()
        rid = request_id.new()
        error = errors.error_body(MALFORMED, "invalid_request_error", None, "invalid_request")
        error["error"]["request_id"] = rid
        body = orjson.dumps(error)
        head = [STATUS_LINE[400]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        extra = {
            "content-type": "application/json",
            "content-length": str(len(body)),
            request_id.HEADER: rid,
            **errors.retry_headers("invalid_request"),
            "connection": "close",
        }
        for key, text in extra.items():
            head += [key.encode(), b": ", text.encode(), b"\r\n"]
        self.transport.write(b"".join([*head, b"\r\n", body]))
        self.transport.close()


def gateway_http_protocol(head_timeout_s: float) -> type[GatewayHTTPProtocol]:
    """The protocol class for uvicorn's ``http=`` option, with this head timeout."""
    return type("GatewayHTTPProtocol", (GatewayHTTPProtocol,), {"head_timeout_s": head_timeout_s})
