"""Admission and settlement as one bracket, for every call the gateway meters: inference,
vector uploads, vectors from examples, and the engine calls that are not inference (the
model list, the tokenizer; one request against requests/min and concurrency, no tokens).

``admitted(settler, limiter.admit(...))`` admits the request and settles it exactly once:

* the body settles it with what it knows (``call.settle(status, tokens, ...)``), or hands
  settlement to a response that outlives it (``call.hand_off()``: a stream settles when
  it ends);
* an ``APIError`` settles it with the error's status and gets the admission's rate-limit
  headers; any other exit (the client went away) settles it with status 0, which
  releases the lease at once;
* ``call.tokens`` / ``call.prompt_tokens`` are charged on those exits too (work the engine
  did before a later step failed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from steergate.gateway.admission.admitted import Admission
from steergate.gateway.admission.limits import Limiter
from steergate.gateway.admission.settlement import CLIENT_CLOSED, Outcome, Settler
from steergate.gateway.tenancy.records import ApiKey, Tenant
from steergate.shared.errors import APIError


class Admitted:
    """One admitted call, settled once."""

    def __init__(self, settler: Settler, admission: Admission) -> None:
        self.settler = settler
        self.admission = admission
        #: Charged if the call ends without an explicit ``settle``.
        self.tokens = 0
        self.prompt_tokens = -1
        self.handed_off = False
        self.settled = False

    @property
    def headers(self) -> dict[str, str]:
        """The ``x-ratelimit-*`` headers of the admission."""
        return self.admission.headers

    def settle(
        self,
        status: int,
        tokens: int | None = None,
        latch_state: str | None = None,
        steered: bool = False,
        prompt_tokens: int | None = None,
    ) -> None:
        """Queue the settlement (the first call only). ``tokens`` -1: unknown, the
        reservation is charged."""
        if self.settled:
            return
        self.settled = True
        self.settler.submit(
            Outcome(
                self.admission,
                status,
                self.tokens if tokens is None else tokens,
                latch_state,
                steered,
                prompt_tokens=self.prompt_tokens if prompt_tokens is None else prompt_tokens,
            )
        )

    def hand_off(self) -> None:
        """The response settles the call when it ends (a stream)."""
        self.handed_off = True


class _Bracket:
    """``async with admitted(...) as call``: a plain class rather than a generator-based
    context manager, because it wraps every request (it saves the generator's frame and
    its throw-in on each exit)."""

    __slots__ = ("_admission", "_call", "_settler")

    def __init__(self, settler: Settler, admission: Awaitable[Admission]) -> None:
        self._settler = settler
        self._admission = admission
        self._call: Admitted | None = None

    async def __aenter__(self) -> Admitted:
        self._call = Admitted(self._settler, await self._admission)
        return self._call

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        call = self._call
        assert call is not None
        if exc is None:
            if not call.handed_off:
                call.settle(0)  # a body that returned without settling: never hold the lease
        elif isinstance(exc, APIError):
            call.settle(exc.status)
            exc.headers = {**call.headers, **exc.headers}
        elif isinstance(exc, asyncio.CancelledError):
            call.settle(CLIENT_CLOSED)  # the client went away: release the lease now
        else:
            call.settle(500)  # answered as the internal error it is


def admitted(settler: Settler, admission: Awaitable[Admission]) -> _Bracket:
    """Admit (``admission``: a ``Limiter.admit`` or ``admit_plain`` call), run the body,
    settle once (see the module docstring)."""
    return _Bracket(settler, admission)


class _Answer(Protocol):
    @property
    def status(self) -> int: ...


A = TypeVar("A", bound=_Answer)


async def metered_call(
    settler: Settler,
    limiter: Limiter,
    tenant: Tenant,
    call: Callable[[], Awaitable[A]],
    api_key: ApiKey,
) -> tuple[A, dict[str, str]]:
    """``call()``'s answer (an engine's, with a ``status``) and the rate-limit headers to
    send with it (``api_key``: the caller's, whose own limits apply too)."""
    async with admitted(settler, limiter.admit_plain(tenant, api_key)) as metered:
        r = await call()
        metered.settle(r.status)
        return r, metered.headers
