"""Tenant scoping of a request body, and scrubbing of what comes back.

The client speaks in its own ids; the engine sees ``<tenant>~<id>``. This module
validates the two gateway fields (``conversation_id``, ``steering``), rewrites them
to the scoped forms, combines the tenant's secret cache salt with the client's (so
one tenant can never share another's prefix cache, whatever salt it sends), and
removes scoped forms from anything the engine answers.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from gateway.tenants import Tenant
from shared.errors import InvalidField
from shared.scoping import check_conversation_id, check_vector_name, scope
from shared.steering import ModelShape, SteeringRequest, parse_steering

_ANY_SCOPE = re.compile(rb"[a-z0-9-]{1,32}~(?=[A-Za-z0-9._:@-])")


@dataclass(frozen=True)
class Prepared:
    conversation_id: str | None
    scoped_conversation_id: str | None
    steering: SteeringRequest | None
    latch_bytes: int
    latch_kind: str
    stream: bool
    include_usage: bool  # the client asked for the usage chunk itself


def prepare_inference(body: dict[str, Any], tenant: Tenant, shape: ModelShape | None) -> Prepared:
    """Validate and rewrite ``body`` in place for the engine."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidField("stream", "'stream' must be a boolean")
    conv = None
    if "conversation_id" in body and body["conversation_id"] is not None:
        conv = check_conversation_id(body["conversation_id"])
        body["conversation_id"] = scope(tenant.id, conv)
    steering = None
    if body.get("steering") is not None:
        steering = parse_steering(body["steering"], shape)
        if steering.latch and conv is None:
            raise InvalidField("steering.latch", "'steering.latch' needs a 'conversation_id'")
        for i, term in enumerate(body["steering"].get("vectors", [])):
            if "name" in term:
                check_vector_name(term["name"], f"steering.vectors[{i}].name")
                term["name"] = scope(tenant.id, term["name"])
    latch_bytes = 0
    kind = "ref"
    if steering is not None and steering.latch:
        sites = steering.inline_sites()
        if sites:
            kind = "value"
            # Without a known shape the engine still enforces its caps; count a site at
            # its encoded size so quota accounting never under-counts by much.
            latch_bytes = steering.inline_latch_bytes(shape.hidden_size) if shape else 0
    include_usage = False
    if stream:
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise InvalidField("stream_options", "'stream_options' must be an object")
        include_usage = bool((opts or {}).get("include_usage"))
        body["stream_options"] = {**(opts or {}), "include_usage": True}
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise InvalidField("cache_salt", "'cache_salt' must be a string")
    body["cache_salt"] = combined_salt(tenant, salt)
    return Prepared(
        conv,
        scope(tenant.id, conv) if conv else None,
        steering,
        latch_bytes,
        kind,
        stream,
        include_usage,
    )


def combined_salt(tenant: Tenant, client_salt: str | None) -> str:
    """The tenant's secret salt always participates; the client's only adds to it."""
    h = hashlib.sha256(tenant.cache_salt.get_secret_value().encode())
    if client_salt:
        h.update(b"\0" + client_salt.encode())
    return h.hexdigest()


def scrub(data: bytes, tenant_id: str, *, error: bool = False) -> bytes:
    """Remove scoped forms. Success bodies: only this tenant's prefix before an id
    (generated text is otherwise left alone); error bodies: any scope prefix."""
    if error:
        return _ANY_SCOPE.sub(b"", data)
    marker = f"{tenant_id}~".encode()
    return data.replace(marker, b"") if marker in data else data
