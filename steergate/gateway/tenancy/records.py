"""What a tenant and its keys are: limits, the tenant record, API keys (name, expiry,
scopes, own limits, rotation state), admin keys (roles), and how they are validated and
read from their Redis records (``steergate/gateway/store/key_names.py`` names the keys;
``tenants.py`` stores them).

Default limits (``Limits()``) are sized so that 16 default tenants exactly fill an
engine with the contract's default caps (1024 latches, 256 MiB): 64 latches and
16 MiB of latches each. Requests: 600/min, 200k tokens/min, 16 in flight;
vectors: 100 named vectors, 64 MiB.
"""

from __future__ import annotations

import math
import secrets
import time
import unicodedata
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from steergate.shared.engine_api import DEFAULT_MAX_LATCHED_BYTES, DEFAULT_MAX_LATCHED_CONVERSATIONS
from steergate.shared.errors import APIError, InvalidField

#: An engine's latch caps (count, bytes) until one has reported its own: the engine
#: contract's defaults.
DEFAULT_ENGINE_CAPS = (DEFAULT_MAX_LATCHED_CONVERSATIONS, DEFAULT_MAX_LATCHED_BYTES)
BIG = 10**15  # keeps every limit an exact integer inside Lua's doubles


class Limits(BaseModel):
    """A tenant's limits. Zero latch/vector quotas disable latching / named vectors.
    Integers are strict, as a key's are: ``true``, ``"600"`` and ``600.0`` are refused,
    not read as 1 and 600."""

    model_config = ConfigDict(extra="forbid")

    rpm: int = Field(
        default=600, ge=1, le=BIG, strict=True, description="Requests per minute (GCRA)."
    )
    tpm: int = Field(
        default=200_000, ge=1, le=BIG, strict=True, description="Tokens per minute (GCRA)."
    )
    max_concurrency: int = Field(
        default=16, ge=1, le=100_000, strict=True, description="Requests in flight."
    )
    latch_count: int = Field(
        default=64, ge=0, le=BIG, strict=True, description="Latched conversations."
    )
    latch_bytes: int = Field(
        default=16 * 2**20, ge=0, le=BIG, strict=True, description="Bytes of latches."
    )
    vector_count: int = Field(default=100, ge=0, le=BIG, strict=True, description="Named vectors.")
    vector_bytes: int = Field(
        default=64 * 2**20, ge=0, le=BIG, strict=True, description="Bytes of named vectors."
    )
    latch_policy: Literal["evict_oldest", "reject"] = Field(
        default="evict_oldest", description="Over the latch quota: evict own LRU latches, or 429."
    )
    token_budget: TokenBudget | None = Field(
        default=None,
        description="Tokens (prompt + completion) per UTC day or month; past it, 429 "
        "budget_exceeded until the period rolls over. None: no budget.",
    )


class TokenBudget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: int = Field(ge=1, le=BIG, strict=True, description="Tokens per period.")
    period: Literal["day", "month"] = Field(description="UTC day or UTC calendar month.")


Limits.model_rebuild()


class Tenant(BaseModel):
    """A tenant. ``cache_salt`` is a random value, excluded from every dump the API
    returns; the prefix-cache salt the engines see is HMAC(pepper, it)
    (``TenantStore.salt_secret``), so Redis alone does not give it."""

    id: str
    name: str = ""
    limits: Limits = Field(default_factory=Limits)
    allow_overcommit: bool = False
    created_at: float = Field(default_factory=time.time)
    cache_salt: SecretStr = Field(
        default_factory=lambda: SecretStr(secrets.token_hex(16)), exclude=True
    )

    def record(self) -> bytes:
        """The stored form (the only one that includes the salt)."""
        doc = self.model_dump()
        doc["cache_salt"] = self.cache_salt.get_secret_value()
        return orjson.dumps(doc)

    @classmethod
    def from_record(cls, raw: str | bytes) -> Tenant:
        return cls.model_validate(orjson.loads(raw))


#: What a tenant key may be used for; a route's scope is decided in
#: ``steergate.gateway.tenancy.auth``.
SCOPES: tuple[str, ...] = ("inference", "vectors", "latches", "usage")
#: Roles of admin keys: ``viewer`` may only read (GET/HEAD) under /admin.
ADMIN_ROLES: tuple[str, ...] = ("admin", "viewer")
#: ``POST /admin/keys/{key_id}/rotate``: how long the old secret keeps working.
DEFAULT_GRACE_S = 3600
MAX_GRACE_S = 7 * 86400
KEY_FIELDS = frozenset({"name", "expires_at", "scopes", "limits"})
#: The longest name of a tenant, an API key or an admin key.
MAX_NAME = 200
#: Characters no name may hold (beside Unicode's controls, category Cc): the line and
#: paragraph separators and the bidirectional overrides and isolates, which reorder
#: what a terminal or a page shows around them ("Trojan source").
_HIDDEN = frozenset("\u2028\u2029\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def check_name(value: Any, field: str = "name") -> str:
    """A display name (a tenant's, an API key's or an admin key's), validated in full:
    a string of at most :data:`MAX_NAME` characters, with no control character (an
    escape sequence would reach an operator's terminal through ``steergate`` tables,
    a newline would split a log or CSV line) and no bidirectional override."""
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > MAX_NAME:
        raise InvalidField(field, f"'{field}' must be a string of at most {MAX_NAME} characters")
    for ch in value:
        if ch in _HIDDEN or unicodedata.category(ch) == "Cc":
            raise InvalidField(
                field, f"'{field}' must not contain control characters (found U+{ord(ch):04X})"
            )
    return value


class KeyLimits(BaseModel):
    """A key's own limits, each at most the tenant's; None: only the tenant's apply."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rpm: int | None = Field(
        default=None, ge=1, le=BIG, strict=True, description="Requests per minute of this key."
    )
    max_concurrency: int | None = Field(
        default=None, ge=1, le=100_000, strict=True, description="This key's requests in flight."
    )


@dataclass(frozen=True)
class ApiKey:
    """A tenant key as ``auth.get_tenant`` leaves it on ``request.state.api_key``."""

    key_id: str
    tenant_id: str
    name: str
    prefix: str
    scopes: frozenset[str]
    limits: KeyLimits
    created_at: float
    expires_at: float | None

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


@dataclass(frozen=True)
class KeyMatch:
    """A resolved tenant key. ``valid_until``: set when the secret presented is a rotated
    one in its grace period (it stops working then, with 401 invalid_api_key)."""

    tenant: Tenant
    key: ApiKey
    valid_until: float | None = None


@dataclass(frozen=True)
class AdminKey:
    """An admin key (``POST /admin/keys``); the bootstrap key is ``key_id="bootstrap"``."""

    key_id: str
    role: str
    name: str = ""
    prefix: str = ""
    created_at: float = 0.0
    created_by: str = ""

    def public(self) -> dict[str, Any]:
        return {
            "key_id": self.key_id,
            "name": self.name,
            "role": self.role,
            "prefix": self.prefix,
            "created_at": self.created_at,
            "created_by": self.created_by,
        }


BOOTSTRAP_ADMIN = AdminKey(key_id="bootstrap", role="admin", name="STEERGATE_ADMIN_KEY")


@dataclass(frozen=True)
class KeyInfo:
    key_id: str
    prefix: str
    created_at: float
    tenant_id: str = ""
    name: str = ""
    scopes: tuple[str, ...] = SCOPES
    limits: KeyLimits = KeyLimits()
    expires_at: float | None = None
    last_used_at: float | None = None
    previous_expires_at: float | None = None

    def public(self) -> dict[str, Any]:
        return {
            "key_id": self.key_id,
            "tenant_id": self.tenant_id,
            "name": self.name,
            "prefix": self.prefix,
            "scopes": list(self.scopes),
            "limits": self.limits.model_dump(),
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "last_used_at": self.last_used_at,
            "previous_expires_at": self.previous_expires_at,
        }


def scopes_of(doc: dict[str, Any]) -> tuple[str, ...]:
    # Keys made before scopes existed have every scope; a stored list is never empty.
    return tuple(doc["scopes"]) if "scopes" in doc else SCOPES


def api_key_from(tenant_id: str, key_id: str, doc: dict[str, Any]) -> ApiKey:
    """From a key record or a lookup entry (they share these fields)."""
    return ApiKey(
        key_id=key_id,
        tenant_id=tenant_id,
        name=doc.get("name", ""),
        prefix=doc.get("prefix", ""),
        scopes=frozenset(scopes_of(doc)),
        limits=KeyLimits.model_validate(doc.get("limits") or {}),
        created_at=doc.get("created_at", 0.0),
        expires_at=doc.get("expires_at"),
    )


#: Fields of a key record copied into its lookup entries (never a secret or a hash).
LOOKUP_FIELDS = ("name", "prefix", "scopes", "limits", "created_at", "expires_at")


def lookup_value(
    tenant: Tenant, key_id: str, doc: dict[str, Any], until: float | None = None
) -> bytes:
    """What ``keys.key_lookup(hash)`` holds: everything authentication needs, so a cache
    miss costs two reads (this and the tenant record), as before scopes existed. The
    fields are immutable for a key's life (a rotation writes new entries), so the
    copies cannot drift. ``tc``: the tenant's ``created_at``, so an entry left behind
    by a deleted tenant never authenticates for a new tenant of the same id;
    ``until``: a rotated-out secret's grace end."""
    entry: dict[str, Any] = {"t": tenant.id, "k": key_id, "tc": tenant.created_at}
    entry.update({f: doc[f] for f in LOOKUP_FIELDS if f in doc})
    if until is not None:
        entry["until"] = until
    return orjson.dumps(entry)


def parse_lookup(value: str) -> dict[str, Any]:
    if value.startswith("{"):
        return orjson.loads(value)  # type: ignore[no-any-return]
    tenant_id, key_id = value.split(" ", 1)  # a key made before scopes: every scope
    return {"t": tenant_id, "k": key_id}


def key_info_from(
    tenant_id: str, key_id: str, doc: dict[str, Any], last_used: Any, now: float
) -> KeyInfo:
    prev_until: float | None = doc.get("prev_expires_at")
    in_grace = bool(doc.get("prev_hash")) and prev_until is not None and prev_until > now
    return KeyInfo(
        key_id=key_id,
        tenant_id=tenant_id,
        prefix=doc["prefix"],
        created_at=doc["created_at"],
        name=doc.get("name", ""),
        scopes=scopes_of(doc),
        limits=KeyLimits.model_validate(doc.get("limits") or {}),
        expires_at=doc.get("expires_at"),
        last_used_at=float(last_used) if last_used else None,
        previous_expires_at=prev_until if in_grace else None,
    )


def check_key_options(
    tenant: Tenant, name: Any, expires_at: Any, scopes: Any, limits: Any, now: float
) -> tuple[str, float | None, tuple[str, ...], KeyLimits]:
    """Validate ``POST /admin/tenants/{id}/keys`` options; every 400 names its field."""
    name = check_name(name)
    if expires_at is not None:
        if (
            isinstance(expires_at, bool)
            or not isinstance(expires_at, (int, float))
            or not math.isfinite(expires_at)
        ):
            raise InvalidField("expires_at", "'expires_at' must be a number (unix seconds)")
        if expires_at <= now:
            raise InvalidField("expires_at", "'expires_at' must be in the future (unix seconds)")
        if 1e12 <= expires_at < 1e14:  # now, in milliseconds, for the next 1,000 years
            raise InvalidField("expires_at", "'expires_at' is unix seconds, not milliseconds")
        if expires_at >= 1e11:  # the year 5138
            raise InvalidField(
                "expires_at", "'expires_at' must be under 1e11 unix seconds (the year 5138)"
            )
        expires_at = float(expires_at)
    if scopes is None:
        chosen = SCOPES
    else:
        if not isinstance(scopes, list) or not scopes:
            raise InvalidField(
                "scopes", f"'scopes' must be a non-empty list of {', '.join(SCOPES)}"
            )
        for i, scope in enumerate(scopes):
            if scope not in SCOPES:
                raise InvalidField(
                    f"scopes[{i}]", f"unknown scope {scope!r}: use {', '.join(SCOPES)}"
                )
        chosen = tuple(s for s in SCOPES if s in scopes)
    if limits is None:
        limits = {}
    if not isinstance(limits, dict):
        raise InvalidField("limits", "'limits' must be an object")
    try:
        key_limits = KeyLimits.model_validate(limits)
    except ValidationError as exc:
        raise invalid_field(exc, "limits") from exc
    for field in ("rpm", "max_concurrency"):
        mine, theirs = getattr(key_limits, field), getattr(tenant.limits, field)
        if mine is not None and mine > theirs:
            raise InvalidField(
                f"limits.{field}",
                f"'limits.{field}' ({mine}) is above the tenant's {field} ({theirs})",
            )
    return name, expires_at, chosen, key_limits


def admin_key_from(key_id: str, doc: dict[str, Any]) -> AdminKey:
    return AdminKey(
        key_id=key_id,
        role=doc["role"],
        name=doc.get("name", ""),
        prefix=doc.get("prefix", ""),
        created_at=doc.get("created_at", 0.0),
        created_by=doc.get("created_by", ""),
    )


def as_limits(value: Limits | dict[str, Any] | None) -> Limits:
    if isinstance(value, Limits):
        return value
    try:
        return Limits.model_validate(value or {})
    except ValidationError as exc:
        raise invalid_field(exc, "limits") from exc


def invalid_field(exc: ValidationError, root: str) -> APIError:
    first = exc.errors()[0]
    path = ".".join(str(p) for p in (root, *first["loc"]))
    return APIError("invalid_request", f"'{path}': {first['msg']}", param=path)
