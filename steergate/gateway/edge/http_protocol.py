"""The gateway's HTTP/1.1 server protocol: uvicorn's httptools protocol, plus bounds on
how long a client may take to send a request, and the project's error shape for a
request that is not HTTP at all.

uvicorn closes a keep-alive connection that stays idle after a response
(``timeout_keep_alive``), but not one that never sends a request, nor one that sends its
head or its body a byte at a time (slowloris): each would hold a socket, its buffers and
a task for ever, and a valid key is enough to open thousands. One timer per connection:

- **head**: from the connection's start, and again from the next request's first byte,
  the head must be complete within ``head_timeout_s``, else the connection is closed
  (nothing was asked, so nothing is answered);
- **body**: from the head's end, the body must be complete within ``body_timeout_s``,
  else the client gets 408 ``request_timeout`` in the error shape (unless a response has
  started: an early 401 does not wait for the body) and the connection closes. The app
  reading the body sees a client that left. A pipelined request waiting behind another
  one's response is not the client's fault: its clock starts again.

A request head is bounded in size and in header count (``MAX_HEAD_BYTES``,
``MAX_HEADERS``): the parser builds a header value by appending each piece to what it has
(quadratic in its length) and uvicorn keeps every header, so one connection sending a
64 MiB header held the event loop for seconds and 20 of them took 800 MB, with no key
(found from outside). Past either bound the client gets 431 ``headers_too_large`` in the
error shape and the connection closes; the bytes past the bound are never parsed.

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
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from steergate.shared import errors, request_id

log = logging.getLogger("steergate.gateway.http")

MALFORMED = "the request is not valid HTTP/1.1 (request line, a header or the body framing)"
#: Header fields one request may carry (names, values and line endings), in bytes ...
MAX_HEADER_BYTES = 64 * 1024
#: ... and in number (a browser sends about 20, a proxy chain adds a few).
MAX_HEADERS = 128
#: What one request head may take of the stream: its request line (the URL parser refuses
#: a target past 64 KiB: a 400) plus its header fields.
MAX_HEAD_BYTES = 64 * 1024 + 16 + MAX_HEADER_BYTES
HEAD_TOO_LARGE = (
    f"the request head is too large: at most {MAX_HEADERS} header fields of "
    f"{MAX_HEADER_BYTES // 1024} KiB in all"
)


class _HeadTooLarge(Exception):
    """Raised in a parser callback: the parser stops, uvicorn calls ``send_400_response``."""


class GatewayHTTPProtocol(HttpToolsProtocol):
    head_timeout_s: float = 10.0
    body_timeout_s: float = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        # Bytes a request head may still take (None while a body or nothing is due), and
        # the head's header fields so far.
        self._head_left: int | None = MAX_HEAD_BYTES
        self._heads_done = 0
        self._header_count = 0
        self._header_bytes = 0
        self._head_too_large = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.head_timeout_s, self._head_timed_out)

    def data_received(self, data: bytes) -> None:
        left = self._head_left
        if left is None or len(data) <= left:
            if left is not None:
                self._head_left = left - len(data)
            super().data_received(data)
            return
        # More than the head may take: parse what it may take; the rest only if the
        # head ended within it (a body, or the next request, follows).
        heads_done = self._heads_done
        super().data_received(data[:left])
        if self.transport.is_closing():
            return
        if self._heads_done == heads_done:
            self._refuse_head()
            return
        self.data_received(data[left:])

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_count = self._header_bytes = 0
        if self._timer is None:
            self._arm(self.head_timeout_s, self._head_timed_out)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._header_bytes += len(name) + len(value) + 4  # ": " and CRLF
        if self._header_count > MAX_HEADERS or self._header_bytes > MAX_HEADER_BYTES:
            self._head_too_large = True
            raise _HeadTooLarge
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_left = None
        self._heads_done += 1
        super().on_headers_complete()
        self._arm(self.body_timeout_s, self._body_timed_out)

    def on_message_complete(self) -> None:
        self._disarm()
        self._head_left = MAX_HEAD_BYTES
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, seconds: float, then: Callable[[], None]) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, then)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timed_out(self) -> None:
        self._timer = None
        if not self.transport.is_closing():
            log.debug("closing a connection that sent no complete request head")
            self.transport.close()

    def _body_timed_out(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self.pipeline:  # queued behind a response still being sent: wait on
            self._arm(self.body_timeout_s, self._body_timed_out)
            return
        cycle = self.cycle
        if cycle is not None and cycle.response_started:
            log.debug("closing a connection whose request body never ended")
            self.transport.close()
            return
        log.info("request body not complete within %g s: 408", self.body_timeout_s)
        message = f"the request body did not arrive within {self.body_timeout_s:g} seconds"
        self._answer_and_close("request_timeout", message)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to what its parser refuses (``msg``: uvicorn's words, logged
        by it already), in the project's error shape."""
        if self._head_too_large:
            self._refuse_head()
            return
        self._disarm()
        self._answer_and_close("invalid_request", MALFORMED)

    def _refuse_head(self) -> None:
        log.info("request head past %d bytes or %d fields: 431", MAX_HEAD_BYTES, MAX_HEADERS)
        self._disarm()
        self._answer_and_close("headers_too_large", HEAD_TOO_LARGE)

    def _answer_and_close(self, code: str, message: str) -> None:
        """Write a whole error response in the project's shape, then close: the app (if
        it runs) sees the client leave, and whatever it sends later goes nowhere."""
        rid = request_id.new()
        with request_id.use(rid):
            answer = errors.render(errors.APIError(code, message))
        head = [STATUS_LINE[answer.status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        extra = [*answer.raw_headers(), (request_id.HEADER.encode(), rid.encode())]
        for name, value in [*extra, (b"connection", b"close")]:
            head += [name, b": ", value, b"\r\n"]
        if self.cycle is not None:  # as uvicorn's connection_lost: the app sees a client
            self.cycle.disconnected = True  # that left, and its own answer goes nowhere
            self.cycle.message_event.set()
        self.transport.write(b"".join([*head, b"\r\n", answer.body]))
        self.transport.close()


def gateway_http_protocol(
    head_timeout_s: float, body_timeout_s: float
) -> type[GatewayHTTPProtocol]:
    """The protocol class for uvicorn's ``http=`` option, with these timeouts."""
    return type(
        "GatewayHTTPProtocol",
        (GatewayHTTPProtocol,),
        {"head_timeout_s": head_timeout_s, "body_timeout_s": body_timeout_s},
    )
