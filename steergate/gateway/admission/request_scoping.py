"""Scoping: a request body's client ids become tenant-scoped ids, and what comes back
loses them again.

Two passes, either side of admission, so that nothing proportional to the body's
vector data runs before the request is admitted (and counted):

- :func:`prescan` reads what admission needs from the body's structure alone: the
  conversation id, the named vectors, whether a latch is stored and how many
  (hook, layer) sites it keeps, the token estimate. Every identifier is validated in
  full here. Bounded work: at most ``MAX_TERMS`` terms and ``MAX_SITES`` sites each.
  It also refuses steering with more inline (JSON array) numbers than an
  :class:`InlineBudget` allows, from the arrays' lengths alone: what one request may
  make the gateway convert is bounded before any of it is converted.
- :func:`check_latching` validates the values of a request that stores a latch
  before admission, since its admission commits the latch quota's evictions: a
  request refused with 400 must not have dropped other conversations' latches.
- :func:`prepare_inference` then validates the steering values against the model,
  rewrites ids to ``<tenant>~<id>``, combines the tenant's secret cache salt with the
  client's (so one tenant can never share another's prefix cache, whatever salt it
  sends), and builds the spec of a latch to store (what Redis keeps to restore it).

:func:`scrub` removes scoped forms from anything the engine answers.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from steergate.gateway.admission.limits import estimate_tokens
from steergate.gateway.tenancy.records import Tenant
from steergate.shared.capture import CaptureSpec, parse_capture
from steergate.shared.clamp import OPS
from steergate.shared.engine_api import EXPECT_FIELD
from steergate.shared.errors import InvalidField, reject_unknown
from steergate.shared.latch_spec import LatchSpec, clamp_items, sum_inline
from steergate.shared.scoping import check_conversation_id, check_vector_name, scope
from steergate.shared.settings import GatewaySettings
from steergate.shared.steering import (
    FLOAT32_BYTES,
    MAX_TERMS,
    InlineTerm,
    ModelShape,
    NamedTerm,
    SteeringRequest,
    named_term_keys,
    parse_steering,
)

_ANY_SCOPE = re.compile(rb"[a-z0-9-]{1,32}~(?=[A-Za-z0-9._:@-])")
#: Layers one inline term may name (far above any model's layer count; a bound on the
#: prescan's work, not a model check: that comes after admission).
MAX_SITES = 1024


@dataclass(frozen=True)
class InlineBudget:
    """Inline steering numbers one term / one request may carry (``STEERGATE_MAX_INLINE_
    FLOATS_PER_*``). Larger steering travels as ``packed`` (decoded by numpy from one
    string) or as a named vector; the defaults fit a model of hidden size 8192 at 4
    layers per term and 8 per request."""

    per_term: int = GatewaySettings.model_fields["max_inline_floats_per_term"].default
    per_request: int = GatewaySettings.model_fields["max_inline_floats_per_request"].default

    @classmethod
    def of(cls, settings: GatewaySettings) -> InlineBudget:
        return cls(settings.max_inline_floats_per_term, settings.max_inline_floats_per_request)


#: Choices one request may ask for (``n``), OpenAI's own bound.
MAX_N = 128


@dataclass(frozen=True)
class Head:
    """What admission needs, read without touching vector data."""

    conversation_id: str | None
    #: The named vectors used (client form, first-use order), each with its first
    #: term's index in ``steering.vectors`` (for error params).
    first_term: dict[str, int] = field(hash=False)
    steered: bool  # the request carries its own ``steering``
    latch: bool
    #: Vectors a by-value latch of this request keeps, as the engine stores it
    #: (``SteeringRequest.inline_latch_bytes``): one per distinct inline add site, plus
    #: one per inline clamp or ablate direction (kept one by one, never merged).
    latch_vectors: int
    stream: bool
    tokens: int
    #: ``capture``, structure checked (sites bounded); layers and bytes are checked
    #: against the model's shape before admission too (routes/inference.py).
    capture: CaptureSpec | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The named vectors used, client form, first-use order."""
        return tuple(self.first_term)

    def unknown_vector(self, name: str) -> InvalidField:
        """The 400 for a named vector the tenant lacks, as the engine says it: the term
        named, the name not echoed (it may be tenant-scoped)."""
        param = f"steering.vectors[{self.first_term.get(name, 0)}].name"
        return InvalidField(param, f"'{param}': no vector with this name", code="unknown_vector")

    def latch_bytes(self, shape: ModelShape | None) -> int:
        # Without a known shape the engine still enforces its caps; the keep step
        # records the exact size once the engine has stored the latch.
        return FLOAT32_BYTES * shape.hidden_size * self.latch_vectors if shape else 0

    @property
    def latch_kind(self) -> str:
        return "value" if self.latch_vectors else "ref"


@dataclass(frozen=True)
class Prepared:
    scoped_conversation_id: str | None
    steering: SteeringRequest | None
    spec: LatchSpec | None  # the latch this turn asks to store
    include_usage: bool  # the client asked for the usage chunk itself
    continuous_usage: bool = False  # ... and for usage in every chunk


def prescan(body: dict[str, Any], budget: InlineBudget = InlineBudget()) -> Head:
    if EXPECT_FIELD in body:
        # The gateway's word to the engine (which latch and vector digests Redis holds,
        # which latch to restore): the engine trusts it, so a client must never set it.
        raise InvalidField(
            EXPECT_FIELD, f"'{EXPECT_FIELD}' is the gateway's field; clients cannot send it"
        )
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N):
        # vLLM takes any n and fans it out into n requests queued ahead of every tenant's.
        raise InvalidField("n", f"'n' must be an integer in 1..{MAX_N}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidField("stream", "'stream' must be a boolean")
    conv = None
    if body.get("conversation_id") is not None:
        conv = check_conversation_id(body["conversation_id"])
    raw = body.get("steering")
    names: dict[str, int] = {}
    sites: set[tuple[Any, Any]] = set()
    directions = 0  # inline clamp/ablate directions: each is latched on its own
    latch = False
    if raw is not None:
        if not isinstance(raw, dict):
            raise InvalidField("steering", "'steering' must be an object")
        latch = raw.get("latch", False) is True
        vectors = raw.get("vectors", [])
        if not isinstance(vectors, list):
            raise InvalidField("steering.vectors", "'steering.vectors' must be an array")
        if len(vectors) > MAX_TERMS:
            raise InvalidField(
                "steering.vectors",
                f"'steering.vectors' has {len(vectors)} terms; at most {MAX_TERMS} are allowed",
            )
        inline = 0
        for i, term in enumerate(vectors):
            param = f"steering.vectors[{i}]"
            if not isinstance(term, dict):
                raise InvalidField(param, f"'{param}' must be an object")
            if "name" in term:
                # Its keys first, as the parser checks them: an unknown key is the same
                # 400 whatever the body's size (a large body is parsed before admission,
                # a small one's names were checked first and said unknown_vector).
                op = term.get("op", "add")
                if isinstance(op, str) and op in OPS:  # else the parser names the op
                    reject_unknown(term, named_term_keys(op), param)
                names.setdefault(check_vector_name(term["name"], f"{param}.name"), i)
            else:
                hook = term.get("hook")
                hook = hook if isinstance(hook, str) else repr(hook)  # malformed: named later
                layers = _term_layers(term, param)
                if term.get("op", "add") == "add":
                    sites.update((hook, layer) for layer in layers)
                else:
                    directions += len(layers)
                inline += _check_inline_floats(term, param, inline, budget)
        if latch and conv is None:
            raise InvalidField(
                "steering.latch",
                "'steering.latch' needs a 'conversation_id'",
                code="latch_without_conversation_id",
            )
    capture = parse_capture(body["capture"], None) if body.get("capture") is not None else None
    return Head(
        capture=capture,
        conversation_id=conv,
        first_term=names,
        steered=raw is not None,
        latch=latch,
        latch_vectors=len(sites) + directions if latch else 0,
        stream=stream,
        tokens=estimate_tokens(body),
    )


def _term_layers(term: dict[str, Any], param: str) -> list[Any]:
    """The layer keys of an inline term, bounded; values are checked after admission."""
    if isinstance(term.get("layers"), dict):
        layers = list(term["layers"])
    elif isinstance(term.get("packed"), dict) and isinstance(
        term["packed"].get("layer_indices"), list
    ):
        layers = term["packed"]["layer_indices"]
    else:
        return []  # malformed: parse_steering names the field after admission
    if len(layers) > MAX_SITES:
        raise InvalidField(param, f"'{param}' names {len(layers)} layers; at most {MAX_SITES}")
    return [_layer_key(layer) for layer in layers]


def _check_inline_floats(
    term: dict[str, Any], param: str, before: int, budget: InlineBudget
) -> int:
    """The numbers in an inline term's arrays (read from their lengths: at most
    ``MAX_SITES`` of them, checked first), refused past the term's or the request's
    budget; returns the count."""
    layers = term.get("layers")
    if not isinstance(layers, dict):
        return 0
    count = sum(len(v) for v in layers.values() if isinstance(v, list))
    if count > budget.per_term or before + count > budget.per_request:
        where = (
            f"at most {budget.per_term:,} per term"
            if count > budget.per_term
            else f"at most {budget.per_request:,} per request ({before:,} in earlier terms)"
        )
        raise InvalidField(
            f"{param}.layers",
            f"'{param}.layers' holds {count:,} numbers as JSON arrays; {where} are accepted "
            "inline. Send larger steering as 'packed' (base64, see docs/api.md) or register "
            "it once as a named vector (PUT /v1/steering/vectors/{name}) and send its name.",
            code="steering_too_large",
        )
    return count


def _layer_key(layer: Any) -> Any:
    """``"2"`` (a ``layers`` key) and ``2`` (a ``packed`` index) are the same site."""
    if isinstance(layer, str) and layer.isascii() and layer.isdigit():
        return int(layer)
    return layer if isinstance(layer, (int, str)) else repr(layer)


def check_latching(
    body: dict[str, Any], head: Head, shape: ModelShape | None, parsed: SteeringRequest | None
) -> SteeringRequest | None:
    """Every 400 of a latching request's values, before admission (its admission
    evicts the tenant's least recently used latches to make room, and that is
    committed). The steering parsed here (bounded by the inline budget, as after
    admission) is what :func:`prepare_inference` uses. Other requests: ``parsed``."""
    if not head.latch or body.get("steering") is None:
        return parsed
    steering = parsed if parsed is not None else parse_steering(body["steering"], shape)
    _request_options(body, head)
    return steering


def _request_options(body: dict[str, Any], head: Head) -> tuple[bool, bool]:
    """``stream_options`` and ``cache_salt`` checked; whether the client asked for a
    stream's usage, and for usage in every chunk (vLLM's rule: only with the first)."""
    asked: dict[str, Any] = {}
    if head.stream:
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise InvalidField("stream_options", "'stream_options' must be an object")
        for name in ("include_usage", "continuous_usage_stats"):
            asked[name] = value = (opts or {}).get(name)
            if value is not None and not isinstance(value, bool):
                # Overwritten by prepare_inference: an invalid value would otherwise
                # never reach vLLM's check.
                param = f"stream_options.{name}"
                raise InvalidField(param, f"'{param}' must be a boolean")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise InvalidField("cache_salt", "'cache_salt' must be a string")
    usage = asked.get("include_usage") is True
    return usage, usage and asked.get("continuous_usage_stats") is True


def prepare_inference(
    body: dict[str, Any],
    head: Head,
    tenant: Tenant,
    shape: ModelShape | None,
    vector_digests: dict[str, str],
    parsed: SteeringRequest | None = None,
    *,
    salt_secret: str,
) -> Prepared:
    """Validate the steering values and rewrite ``body`` in place for the engine.
    ``parsed``: the body's steering, already validated against ``shape`` (large
    bodies are, in a worker process: ``steergate/gateway/admission/bodies.py``);
    ``salt_secret``: the tenant's prefix-cache secret (``TenantStore.salt_secret``)."""
    conv = head.conversation_id
    if conv is not None:
        body["conversation_id"] = scope(tenant.id, conv)
    steering = None
    spec = None
    if body.get("steering") is not None:
        steering = parsed if parsed is not None else parse_steering(body["steering"], shape)
        for term in body["steering"].get("vectors", []):
            if "name" in term:
                term["name"] = scope(tenant.id, term["name"])
        if steering.latch:
            spec = latch_spec(steering, tenant.id, vector_digests)
    include_usage, continuous_usage = _request_options(body, head)
    if head.stream:
        # The stream's usage, and its count so far on every chunk: a stream cut short
        # (the client left, the engine broke) is charged exactly what was generated
        # (stream_meter.py). The relay removes what the client did not ask for.
        body["stream_options"] = {
            **(body.get("stream_options") or {}),
            "include_usage": True,
            "continuous_usage_stats": True,
        }
    body["cache_salt"] = combined_salt(salt_secret, body.get("cache_salt"))
    return Prepared(
        scope(tenant.id, conv) if conv else None,
        steering,
        spec,
        include_usage,
        continuous_usage,
    )


def latch_spec(
    steering: SteeringRequest, tenant_id: str, vector_digests: dict[str, str]
) -> LatchSpec:
    """The latch the engine stores for this turn, as the engine builds it (same sums,
    same order, engine-side names), so both compute the same digest."""
    sites = sum_inline(t for t in steering.terms if isinstance(t, InlineTerm))
    refs = tuple(
        (scope(tenant_id, t.name), vector_digests.get(t.name, ""), t.scale)
        for t in steering.terms
        if isinstance(t, NamedTerm) and t.clamp is None
    )
    clamps = clamp_items(
        steering.terms, lambda t: (scope(tenant_id, t.name), vector_digests.get(t.name, ""))
    )
    return LatchSpec(steering.phase, sites, refs, clamps)


def combined_salt(salt_secret: str, client_salt: str | None) -> str:
    """The tenant's secret (``TenantStore.salt_secret``) always participates; the
    client's salt only adds to it."""
    h = hashlib.sha256(salt_secret.encode())
    if client_salt:
        h.update(b"\0" + client_salt.encode())
    return h.hexdigest()


def scrub(data: bytes, tenant_id: str, *, error: bool = False) -> bytes:
    """Remove scoped forms. Success bodies: only this tenant's prefix, and only from a
    JSON string that is one whole scoped id (``"a~chat-1"``, as a field echoing an id
    would hold it): generated text is never changed, so tenant ``a``'s "banana~split",
    "see a~b" or "x~N(0,1)" arrive as the model wrote them. Error bodies: any scope
    prefix, wherever it stands (messages quote ids inside sentences)."""
    if error:
        return _ANY_SCOPE.sub(b"", data)
    if f"{tenant_id}~".encode() not in data:  # the usual case: one substring search
        return data
    return _own_scope(tenant_id).sub(b"", data)


@functools.lru_cache(maxsize=1024)
def _own_scope(tenant_id: str) -> re.Pattern[bytes]:
    return re.compile(
        rb'(?<=")' + re.escape(tenant_id.encode()) + rb'~(?=[A-Za-z0-9._:@-]{1,256}")'
    )
