"""One engine call on a tenant's behalf that is not inference (the model list, the
tokenizer): admitted, counted and settled like an inference request (one request
against requests/min and concurrency, no tokens), so anything the gateway proxies
is metered."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from steergate.gateway.admission.settlement import Outcome
from steergate.gateway.deps import Services
from steergate.gateway.engines.upstream import UpstreamResponse
from steergate.gateway.tenancy.records import ApiKey, Tenant
from steergate.shared.errors import APIError


async def metered_call(
    svc: Services,
    tenant: Tenant,
    call: Callable[[], Awaitable[UpstreamResponse]],
    api_key: ApiKey,
) -> tuple[UpstreamResponse, dict[str, str]]:
    """``call()``'s answer and the rate-limit headers to send with it (``api_key``: the
    caller's, whose own limits apply too)."""
    adm = await svc.limiter.admit_plain(tenant, api_key)
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
