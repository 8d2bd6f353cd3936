"""Authentication dependencies: ``Bearer sk-sg-...`` -> Tenant (with the key's expiry
and scope checked here, for every tenant route), admin keys and their roles, and the
scrape token for ``/metrics``.

Nothing here ever logs or echoes key material: failures say only that the key is
invalid.

Scope by route, decided here and nowhere else (:func:`route_scope`):
``/v1/steering/vectors*`` -> ``vectors``, ``/v1/steering/latches*`` -> ``latches``,
``/v1/usage*`` -> ``usage``, every other tenant route (chat, completions, responses,
models, tokenize, detokenize, and any route added later) -> ``inference``.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import Depends, Request

from steergate.gateway.tenancy.api_keys import same_secret
from steergate.gateway.tenancy.records import BOOTSTRAP_ADMIN, AdminKey, ApiKey, Tenant
from steergate.gateway.tracing import span
from steergate.shared.asgi import sole_header
from steergate.shared.errors import APIError

#: (path prefix, scope), first match wins; anything else is ``inference``.
ROUTE_SCOPES: tuple[tuple[str, str], ...] = (
    ("/v1/steering/vectors", "vectors"),
    ("/v1/steering/latches", "latches"),
    ("/v1/usage", "usage"),
)
#: Methods a ``viewer`` admin key may use (reads).
READ_METHODS = frozenset({"GET", "HEAD"})


def route_scope(path: str) -> str:
    """The scope a tenant key needs for ``path``."""
    for prefix, scope in ROUTE_SCOPES:
        if path.startswith(prefix):
            return scope
    return "inference"


def _bearer(request: Request) -> str | None:
    """The bearer token of the one Authorization header (none when it is repeated:
    ``shared.asgi.sole_header``)."""
    raw = sole_header(request.scope["headers"], b"authorization")
    value = raw.decode("latin-1") if raw is not None else ""
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _invalid() -> APIError:
    return APIError("invalid_api_key", "Incorrect or missing API key.")


async def get_tenant(request: Request) -> Tenant:
    """The caller's tenant. Also refuses an expired key (401 ``expired_api_key``: its
    ``expires_at`` is checked against the clock on every request, cached or not) and a
    key without the route's scope (403 ``insufficient_scope``), and leaves the key on
    ``request.state.api_key`` (``tenants.ApiKey``: key_id, name, scopes, limits,
    expires_at). A cached key costs no Redis call; its last use is noted in memory
    and flushed in batches (``steergate.gateway.tenancy.key_last_use``)."""
    token = _bearer(request)
    if token is None:
        raise _invalid()
    tenants = request.app.state.tenants
    with span("auth") as traced:
        match = await tenants.resolve(token)
        if match is None:
            raise _invalid()
        tenant, key = match.tenant, match.key
        traced.set_attribute("steergate.tenant_id", tenant.id)
    request.state.tenant_id = tenant.id  # for logs/metrics: the id, never the key
    now = time.time()
    if key.expires_at is not None and now >= key.expires_at:
        raise APIError("expired_api_key", "This API key has expired.")
    scope = route_scope(request.scope["path"])
    if scope not in key.scopes:
        raise APIError("insufficient_scope", f"This API key does not have the '{scope}' scope.")
    request.state.api_key = key
    tenants.key_use.touch(tenant.id, key.key_id, now)
    return tenant


def caller_key(request: Request) -> ApiKey:
    """The key ``get_tenant`` resolved for this request (its id, and its own limits for
    admission)."""
    return request.state.api_key  # type: ignore[no-any-return]


def is_admin(request: Request) -> bool:
    """Whether the request carries the bootstrap admin key (``STEERGATE_ADMIN_KEY``)."""
    token = _bearer(request)
    admin = request.app.state.settings.admin_key
    return bool(token and admin and same_secret(token, admin.get_secret_value()))


async def admin_principal(request: Request) -> AdminKey:
    """The admin key presented: the bootstrap key (role ``admin``, id ``bootstrap``) or
    one made with ``POST /admin/keys``. A missing/unknown key is 401, a tenant key 403."""
    if is_admin(request):
        return BOOTSTRAP_ADMIN
    token = _bearer(request)
    tenants = request.app.state.tenants
    if token:
        admin = await tenants.resolve_admin(token)
        if admin is not None:
            return admin  # type: ignore[no-any-return]
        if await tenants.resolve_key(token) is not None:
            raise APIError("permission_denied", "This route needs an admin key.")
    raise _invalid()


async def require_admin(request: Request) -> None:
    """Every admin surface (every ``/admin`` route, whoever adds it; ``/openapi.json``;
    ``/metrics`` without the scrape token): an admin key. Role ``viewer`` may read
    (GET, HEAD) and nothing else: a write is 403 ``permission_denied``. The key is left
    on ``request.state.admin`` (the audit log's actor)."""
    admin = await admin_principal(request)
    if admin.role != "admin" and request.method not in READ_METHODS:
        raise APIError(
            "permission_denied",
            f"This admin key has role '{admin.role}', which may only read (GET).",
        )
    request.state.admin = admin


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
