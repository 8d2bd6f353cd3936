"""Typed accessors for what the lifespan put on ``app.state`` (no module globals)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from steergate.gateway.admission.bodies import BodyParser
from steergate.gateway.admission.limits import Limiter
from steergate.gateway.admission.settlement import Settler
from steergate.gateway.admission.turns import TenantTurns
from steergate.gateway.engines.client import EngineClient
from steergate.gateway.engines.sync import EngineSync
from steergate.gateway.store.connection import Redis
from steergate.gateway.store.scripts import Scripts
from steergate.gateway.tenancy.tenants import TenantStore
from steergate.gateway.vectors.contrast_jobs import ContrastJobs
from steergate.shared.settings import GatewaySettings


@dataclass
class Services:
    """Everything the routes use, built once per app in the lifespan."""

    settings: GatewaySettings
    redis: Redis
    scripts: Scripts
    tenants: TenantStore
    engines: EngineClient
    sync: EngineSync
    limiter: Limiter
    settler: Settler
    bodies: BodyParser  # large bodies parsed in worker processes, per tenant
    contrast: ContrastJobs  # from-examples' math: threads of its own, per tenant
    exports: TenantTurns = field(default_factory=TenantTurns)  # usage exports, per tenant


def get_services(request: Request) -> Services:
    """Plain accessor (callable from anywhere that has the request)."""
    return request.app.state.services  # type: ignore[no-any-return]


async def _services(request: Request) -> Services:
    # async on purpose: FastAPI runs sync dependencies in a thread pool, which costs
    # a thread hand-off (~0.5 ms on a busy box) on every request.
    return get_services(request)


ServicesDep = Annotated[Services, Depends(_services)]
