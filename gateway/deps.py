"""Typed accessors for what the lifespan put on ``app.state`` (no module globals)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from gateway.accounting import Settler
from gateway.limits import Limiter
from gateway.reconcile import Reconciler
from gateway.scripts import Scripts
from gateway.store import Redis
from gateway.tenants import TenantStore
from gateway.upstream import EnginePool
from shared.settings import GatewaySettings


@dataclass
class Services:
    """Everything the routes use, built once per app in the lifespan."""

    settings: GatewaySettings
    redis: Redis
    scripts: Scripts
    tenants: TenantStore
    pool: EnginePool
    limiter: Limiter
    settler: Settler
    reconciler: Reconciler


def get_services(request: Request) -> Services:
    """Plain accessor (callable from anywhere that has the request)."""
    return request.app.state.services  # type: ignore[no-any-return]


async def _services(request: Request) -> Services:
    # async on purpose: FastAPI runs sync dependencies in a thread pool, which costs
    # a thread hand-off (~0.5 ms on a busy box) on every request.
    return get_services(request)


ServicesDep = Annotated[Services, Depends(_services)]
