"""Authentication dependencies: ``Bearer sk-sg-...`` -> Tenant, the admin key, and the
scrape token for ``/metrics``.

Nothing here ever logs or echoes key material: failures say only that the key is
invalid.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from gateway.apikeys import same_secret
from gateway.tenants import Tenant
from shared.errors import APIError


def _bearer(request: Request) -> str | None:
    value = request.headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _invalid() -> APIError:
    return APIError("invalid_api_key", "Incorrect or missing API key.")


async def get_tenant(request: Request) -> Tenant:
    token = _bearer(request)
    if token is None:
        raise _invalid()
    tenant = await request.app.state.tenants.resolve_key(token)
    if tenant is None:
        raise _invalid()
    request.state.tenant_id = tenant.id  # for logs/metrics: the id, never the key
    return tenant


def is_admin(request: Request) -> bool:
    token = _bearer(request)
    admin = request.app.state.settings.admin_key
    return bool(token and admin and same_secret(token, admin.get_secret_value()))


async def require_admin(request: Request) -> None:
    """Admin key only: a missing/unknown key is 401, a tenant key is 403."""
    if is_admin(request):
        return
    token = _bearer(request)
    if token and await request.app.state.tenants.resolve_key(token) is not None:
        raise APIError("permission_denied", "This route needs the admin key.")
    raise _invalid()


async def require_metrics_reader(request: Request) -> None:
    """``GET /metrics``: the scrape token (``STEERGATE_METRICS_TOKEN``) or the admin key.

    The scrape token exists so that Prometheus need not hold the admin key: it opens
    ``/metrics`` and nothing else. Otherwise the same answers as ``require_admin``."""
    token = _bearer(request)
    scrape = request.app.state.settings.metrics_token
    expected = scrape.get_secret_value() if scrape is not None else ""
    if token and expected and same_secret(token, expected):
        return
    await require_admin(request)


TenantDep = Annotated[Tenant, Depends(get_tenant)]
AdminDep = Annotated[None, Depends(require_admin)]
