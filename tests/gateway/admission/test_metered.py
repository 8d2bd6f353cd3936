"""The admit-then-settle bracket (steergate/gateway/admission/metered.py ``admitted``)
that inference, vector uploads, vectors from examples and the metered engine calls
share: every call is settled exactly once, whichever way it ends."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from steergate.gateway.admission.admitted import Admission
from steergate.gateway.admission.metered import admitted
from steergate.gateway.admission.settlement import Outcome
from steergate.gateway.tenancy.records import Tenant
from steergate.shared.errors import APIError

HEADERS = {"x-ratelimit-limit-requests": "600"}


class Settler:
    def __init__(self) -> None:
        self.outcomes: list[Outcome] = []

    def submit(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)


async def _admit() -> Admission:
    return Admission(Tenant(id="t"), "lease", 10, None, False, "", [], headers=dict(HEADERS))


def _settled(settler: Settler) -> list[tuple[int, int, int]]:
    return [(o.status, o.tokens_used, o.prompt_tokens) for o in settler.outcomes]


async def test_an_explicit_settlement_is_the_only_one() -> None:
    settler = Settler()
    async with admitted(settler, _admit()) as call:  # type: ignore[arg-type]
        call.settle(200, 7, prompt_tokens=3)
        call.settle(500)
    assert _settled(settler) == [(200, 7, 3)]


async def test_an_api_error_settles_with_its_status_and_carries_the_rate_limit_headers() -> None:
    settler = Settler()
    with pytest.raises(APIError) as raised:
        async with admitted(settler, _admit()):  # type: ignore[arg-type]
            raise APIError("engine_unavailable", "down")
    assert _settled(settler) == [(502, 0, -1)]
    assert raised.value.headers["x-ratelimit-limit-requests"] == "600"


async def test_a_client_that_leaves_releases_the_lease_as_499_with_its_charge() -> None:
    """499, as it is logged: a 4xx in /v1/usage (status 0 was counted in no class)."""
    settler = Settler()
    with pytest.raises(asyncio.CancelledError):
        async with admitted(settler, _admit()) as call:  # type: ignore[arg-type]
            call.tokens, call.prompt_tokens = 12, 4
            raise asyncio.CancelledError
    assert _settled(settler) == [(499, 12, 4)]


async def test_an_unexpected_error_is_settled_as_the_500_it_is_answered() -> None:
    settler = Settler()
    with pytest.raises(KeyError):
        async with admitted(settler, _admit()) as call:  # type: ignore[arg-type]
            call.tokens, call.prompt_tokens = 12, 4
            raise KeyError("a bug")
    assert _settled(settler) == [(500, 12, 4)]


async def test_a_handed_off_call_is_left_to_its_response() -> None:
    settler = Settler()
    async with admitted(settler, _admit()) as call:  # type: ignore[arg-type]
        call.hand_off()
    assert settler.outcomes == []
    call.settle(200, 5)  # the stream's end
    assert _settled(settler) == [(200, 5, -1)]


async def test_a_body_that_forgets_to_settle_still_releases_the_lease() -> None:
    settler = Settler()
    async with admitted(settler, _admit()):  # type: ignore[arg-type]
        pass
    assert _settled(settler) == [(0, 0, -1)]


async def test_a_refused_admission_settles_nothing() -> None:
    settler = Settler()

    async def refused() -> Any:
        raise APIError("rate_limit_exceeded", "slow down")

    with pytest.raises(APIError):
        async with admitted(settler, refused()):  # type: ignore[arg-type]
            raise AssertionError("the body must not run")
    assert settler.outcomes == []
