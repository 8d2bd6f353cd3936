"""What the operator surfaces (admin API, dashboard, /metrics) read besides one
tenant's usage: every engine's status, and Σ tenant latch quotas against the
engine caps.

Engine calls here are bounded by a short timeout: a hung engine must make an
admin page or a scrape say "down", never hang it for the proxy's long read timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from steergate.gateway.engines.client import EngineClient
from steergate.gateway.engines.upstream import Engine
from steergate.gateway.tenancy.records import DEFAULT_ENGINE_CAPS, Tenant
from steergate.shared.errors import APIError

STATUS_TIMEOUT_S = 2.0


class EngineStatus(BaseModel):
    url: str
    up: bool
    status: dict[str, Any] | None = None
    info: dict[str, Any] | None = None
    error: str | None = None


class CapacityUse(BaseModel):
    """Σ of one latch quota over tenants vs the smallest engine's cap."""

    allocated: int
    engine_cap: int
    engine_cap_source: str  # "engines" (reported) | "default" (no engine reported yet)
    overcommitted: bool


async def _status(engines: EngineClient, engine: Engine, timeout_s: float) -> EngineStatus:
    """Shown by ``engine.shown``: its URL without credentials."""
    url = engine.shown
    try:
        body = await asyncio.wait_for(engines.status(engine), timeout_s)
    except asyncio.TimeoutError:
        return EngineStatus(url=url, up=False, info=engine.info, error="status timed out")
    except APIError as exc:
        return EngineStatus(url=url, up=False, info=engine.info, error=exc.message)
    except ValueError:
        return EngineStatus(url=url, up=False, info=engine.info, error="status was not JSON")
    return EngineStatus(url=url, up=True, status=body, info=engine.info)


async def engine_statuses(
    engines: EngineClient, timeout_s: float = STATUS_TIMEOUT_S
) -> list[EngineStatus]:
    """``/v1/steering/status`` of every engine, concurrently."""
    return list(
        await asyncio.gather(*(_status(engines, e, timeout_s) for e in engines.engines))
    )


def capacity(tenants: Sequence[Tenant], caps: tuple[int, int] | None) -> dict[str, CapacityUse]:
    """The same arithmetic as the overcommit check in ``TenantStore``: the caps of the
    smallest engine (or the contract defaults until an engine has reported)."""
    source = "engines" if caps else "default"
    count_cap, bytes_cap = caps or DEFAULT_ENGINE_CAPS
    count = sum(t.limits.latch_count for t in tenants)
    nbytes = sum(t.limits.latch_bytes for t in tenants)
    return {
        "latch_count": CapacityUse(
            allocated=count,
            engine_cap=count_cap,
            engine_cap_source=source,
            overcommitted=count > count_cap,
        ),
        "latch_bytes": CapacityUse(
            allocated=nbytes,
            engine_cap=bytes_cap,
            engine_cap_source=source,
            overcommitted=nbytes > bytes_cap,
        ),
    }
