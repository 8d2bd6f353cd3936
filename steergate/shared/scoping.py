"""Tenant scoping of client-chosen identifiers.

The engine keeps one global namespace for conversation ids and vector names (the
original single-tenant design). The gateway closes it by rewriting every id to
``<tenant>~<id>`` before the engine sees it. ``~`` can appear neither in a tenant
id nor in a client id, so the split is unambiguous and one tenant can never
produce another tenant's scoped form.
"""

from __future__ import annotations

import re

from steergate.shared.errors import InvalidField

SEPARATOR = "~"

# Anchored with \A...\Z, never ^...$: ``$`` also matches before a final "\n", so
# "chat-1\n" used to pass and reached the engine's request line. Explicit ASCII
# classes only (``\d``/``\w`` match "²" and "١"). Call sites use ``fullmatch``; the
# anchors keep a stray ``.match``/``.search`` full-string too.
TENANT_ID_RE = re.compile(r"\A[a-z0-9-]{1,32}\Z")
CONVERSATION_ID_RE = re.compile(r"\A[A-Za-z0-9._:@-]{1,256}\Z")
VECTOR_NAME_RE = re.compile(r"\A[A-Za-z0-9._-]{1,64}\Z")
# What the engine accepts: the client forms above, optionally behind one tenant scope.
ENGINE_CONVERSATION_ID_RE = re.compile(r"\A(?:[a-z0-9-]{1,32}~)?[A-Za-z0-9._:@-]{1,256}\Z")
ENGINE_VECTOR_NAME_RE = re.compile(r"\A(?:[a-z0-9-]{1,32}~)?[A-Za-z0-9._-]{1,64}\Z")
#: Path segments with a meaning of their own: a client's HTTP library resolves
#: ``/v1/steering/vectors/..`` to ``/v1/steering/``, so a vector or conversation of that
#: name could be made (in a body) but never read or deleted. Not ids.
DOT_SEGMENTS = frozenset({".", ".."})


def is_engine_conversation_id(value: object) -> bool:
    return (
        isinstance(value, str)
        and value not in DOT_SEGMENTS
        and ENGINE_CONVERSATION_ID_RE.fullmatch(value) is not None
    )


def is_engine_vector_name(value: object) -> bool:
    return (
        isinstance(value, str)
        and value not in DOT_SEGMENTS
        and ENGINE_VECTOR_NAME_RE.fullmatch(value) is not None
    )


def check_conversation_id(value: object, param: str = "conversation_id") -> str:
    if (
        not isinstance(value, str)
        or value in DOT_SEGMENTS
        or not CONVERSATION_ID_RE.fullmatch(value)
    ):
        raise InvalidField(
            param,
            f"'{param}' must be 1-256 characters of [A-Za-z0-9._:@-], not '.' or '..'",
            code="invalid_conversation_id",
        )
    return value


def check_vector_name(value: object, param: str = "name") -> str:
    if not isinstance(value, str) or value in DOT_SEGMENTS or not VECTOR_NAME_RE.fullmatch(value):
        raise InvalidField(
            param,
            f"'{param}' must be 1-64 characters of [A-Za-z0-9._-], not '.' or '..'",
            code="invalid_vector_name",
        )
    return value


def check_tenant_id(value: object, param: str = "id") -> str:
    if not isinstance(value, str) or not TENANT_ID_RE.fullmatch(value):
        raise InvalidField(
            param, f"'{param}' must be 1-32 characters of [a-z0-9-]", code="invalid_tenant_id"
        )
    return value


def scope(tenant_id: str, local_id: str) -> str:
    """The engine-side form of a tenant's conversation id or vector name."""
    return f"{tenant_id}{SEPARATOR}{local_id}"


def tenant_prefix(tenant_id: str) -> str:
    return f"{tenant_id}{SEPARATOR}"


def unscope(tenant_id: str, scoped: str) -> str | None:
    """The client form, or None when ``scoped`` does not belong to ``tenant_id``."""
    prefix = tenant_prefix(tenant_id)
    return scoped[len(prefix) :] if scoped.startswith(prefix) else None
