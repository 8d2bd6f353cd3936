"""One engine call on a tenant's behalf that is not inference (the model list, the
tokenizer): admitted, counted and settled like an inference request (one request
against requests/min and concurrency, no tokens), so anything the gateway proxies
is metered."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from steergate.gateway.accounting import Outcome
from steergate.gateway.deps import Services
from steergate.gateway.records import Tenant
from steergate.gateway.upstream import UpstreamResponse
from steergate.shared.errors import APIError


async def metered_call(
    svc: Services,
    tenant: Tenant,
    call: Callable[[], Awaitable[UpstreamResponse]],
    api_key: Any = None,
) -> tuple[UpstreamResponse, dict[str, str]]:
    """``call()``'s answer and the rate-limit headers to send with it (``api_key``: the
    caller's, whose own limits apply too)."""
    adm = await svc.limiter.admit(
        tenant,
        tokens=0,
        conversation_id=None,
        latch=False,
        latch_bytes=0,
        latch_kind="ref",
        api_key=api_key,
    )
    status = 0
    try:
        r = await call()
        status = r.status
        return r, adm.headers
    except APIError as exc:
        status = exc.status
        exc.headers = {**adm.headers, **exc.headers}
        raise
    finally:
        svc.settler.submit(Outcome(adm, status, 0, None))
