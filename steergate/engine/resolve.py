"""Turn a request's ``steering`` + ``conversation_id`` into the sites a turn is steered
with, applying the contract's latch semantics against the controller.

Every path sums in one fixed order (inline terms in request order, then named terms
in request order), so a bridged turn produces bit-identical sites -- and therefore
the same payload digest, the same cache salt and the same output -- as the turn that
stored the latch. Pure (numpy only); the HTTP layer calls :func:`resolve_turn`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from steergate.engine.latch import Latch, LatchController, RefTerm, Site
from steergate.engine.registry import VectorRegistry
from steergate.shared.clamp import (
    DEFAULT_MAX_CLAMPS_PER_SITE,
    ClampItem,
    Resolved,
    check_per_point,
    unit,
    value_resolved,
)
from steergate.shared.engine_api import EXPECT_FIELD, LatchState
from steergate.shared.errors import APIError, InvalidField
from steergate.shared.latch_spec import LatchSpec, accumulate, clamp_items, sum_inline
from steergate.shared.steering import (
    InlineTerm,
    NamedTerm,
    SteeringBound,
    SteeringRequest,
    check_sites_finite,
)

#: Where a restored latch comes from: the gateway's expectations (shared.engine_api).
RESTORE_FIELD = f"{EXPECT_FIELD}.restore"
#: A float32 model of one layer: the bound where the caller names none (tests).
FLOAT32_BOUND = SteeringBound()


@dataclass(frozen=True)
class Resolution:
    """What one turn does: its latch state (the header value) and the summed sites.
    Empty ``sites`` means the turn is not steered."""

    state: LatchState
    phase: str = "all"
    sites: dict[Site, np.ndarray] = field(default_factory=dict)
    clamps: tuple[Resolved, ...] = ()  # in the order they apply (steergate/shared/clamp.py)
    #: Puts the conversation's latch back as it was before this turn changed it, for a
    #: turn that vLLM then refuses (``undo``); None when the turn changed nothing.
    undo: Callable[[], None] | None = field(default=None, compare=False)

    @property
    def applied(self) -> bool:
        return bool(self.sites or self.clamps)


@dataclass(frozen=True)
class Expect:
    """What the gateway (the system of record) says this engine must hold for the
    turn; see ``shared.engine_api.EXPECT_FIELD``. Absent for direct callers, which
    keep the single-tenant behaviour (unknown names are 400s, missing latches ``none``)."""

    vectors: Mapping[str, str] = field(default_factory=dict)
    latch: str | None = None
    restore: LatchSpec | None = None


def cache_miss(code: str, what: str) -> APIError:
    """409 ``vector_missing`` / ``latch_missing``: this engine's cache lacks state the
    gateway holds. Raised before anything changes; the gateway installs and retries."""
    return APIError(code, f"this engine does not hold the {what}; install it and retry")


def resolve_turn(
    steering: SteeringRequest | None,
    conversation_id: str | None,
    registry: VectorRegistry,
    controller: LatchController,
    expect: Expect | None = None,
    max_clamps: int = DEFAULT_MAX_CLAMPS_PER_SITE,
    bound: SteeringBound = FLOAT32_BOUND,
) -> Resolution:
    """Raises :class:`InvalidField` (or a 409 cache miss) before any latch changes, so
    a rejected request never stores, replaces or drops a latch. ``bound``: how far the
    applied steering may move the served model's stream."""
    if steering is None:
        if conversation_id is None:
            return Resolution("none")
        if expect is not None and expect.restore is not None:
            return _restore(
                expect.restore, expect, conversation_id, registry, controller, max_clamps, bound
            )
        if expect is not None and expect.latch == "":
            # The system of record holds no latch (never stored, evicted by the tenant's
            # quota, deleted): a copy cached here must not steer this turn.
            controller.delete(conversation_id)
            return Resolution("none")
        if expect is not None and expect.latch is not None:
            held = controller.get(conversation_id)
            if held is None or held.digest != expect.latch:
                raise cache_miss("latch_missing", "conversation's latch")
            _require_vectors(held.named(), registry, expect)
        elif expect is not None:
            # Redis's entry is pending (another turn is storing a latch): whichever latch
            # this engine holds is bridged, with the content Redis holds for the vectors
            # the gateway names.
            held = controller.get(conversation_id)
            if held is not None and any(
                name in expect.vectors
                and (registry.digest_of(name) or "") != expect.vectors[name]
                for name, _ in held.named()
            ):
                raise cache_miss("vector_missing", "named vectors of this turn")
        used, latch = controller.use(conversation_id, registry.digest_of)
        if latch is None:
            return Resolution(used)
        clamps = resolve_clamps(latch.clamps, registry)
        check_per_point(clamps, max_clamps)
        return Resolution(
            used, latch.phase, combine(latch.value_sites, latch.refs, registry), clamps
        )

    if steering.latch and conversation_id is None:
        raise InvalidField(
            "steering.latch",
            "'steering.latch' needs a 'conversation_id'",
            code="latch_without_conversation_id",
        )
    value_sites = sum_inline(t for t in steering.terms if isinstance(t, InlineTerm))
    refs = _refs(steering, registry, expect)
    sites = combine(value_sites, refs, registry)
    items = clamp_items(steering.terms, lambda t: _ref_digest(t, registry, expect))
    clamps = resolve_clamps(items, registry)
    check_per_point(clamps, max_clamps)
    # each term is finite; their sum at a point of the stream, or a named term's, may not be
    check_in_range(sites, clamps, bound)
    state: LatchState = "none"
    undo = None
    if steering.latch and conversation_id is not None:
        before = controller.get(conversation_id)
        latch = Latch(steering.phase, value_sites, refs, items)
        state = controller.store(conversation_id, latch)
        undo = functools.partial(controller.undo_store, conversation_id, latch, before)
    return Resolution(state, steering.phase, sites, clamps, undo)


def resolve_clamps(items: Iterable[ClampItem], registry: VectorRegistry) -> tuple[Resolved, ...]:
    """Clamp terms -> one clamp per site, in order: a named vector's layers ascending,
    each direction normalised from the vector's current content (callers checked its
    digest)."""
    out: list[Resolved] = []
    for item in items:
        if item.ref is None:
            out.extend(value_resolved(item))
            continue
        vector = registry.get(item.ref[0])
        if vector is None:  # pragma: no cover - excluded by the callers' digest check
            raise KeyError(item.ref[0])
        for layer in sorted(vector.layers):
            direction = unit(vector.layers[layer], "steering.vectors")
            out.append(Resolved((vector.hook, int(layer)), direction, item.bounds))
    return tuple(out)


def combine(
    value_sites: Mapping[Site, np.ndarray], refs: Iterable[RefTerm], registry: VectorRegistry
) -> dict[Site, np.ndarray]:
    """Value sites plus every named term's current vector times its scale.

    Callers have checked each ref's digest against the registry (stored refs in
    :meth:`LatchController.use`, fresh ones in :func:`_refs`), so the data read here
    is the content the digest names.
    """
    sites = {site: np.array(vec, dtype=np.float32, copy=True) for site, vec in value_sites.items()}
    for ref in refs:
        vector = registry.get(ref.name)
        if vector is None:  # pragma: no cover - excluded by the callers' digest check
            raise KeyError(ref.name)
        scale = np.float32(ref.scale)
        for layer, vec in vector.layers.items():
            accumulate(sites, (vector.hook, int(layer)), vec, scale)
    return sites


def _restore(
    spec: LatchSpec,
    expect: Expect,
    conversation_id: str,
    registry: VectorRegistry,
    controller: LatchController,
    max_clamps: int = DEFAULT_MAX_CLAMPS_PER_SITE,
    bound: SteeringBound = FLOAT32_BOUND,
) -> Resolution:
    """Install the gateway's copy of the conversation's latch, then bridge with it.
    A by-reference term whose vector now has other content makes it stale, exactly as
    :meth:`LatchController.use` would have found."""
    latch = Latch.from_spec(spec)
    _require_vectors(latch.named(), registry, expect)
    if any(registry.digest_of(name) != digest for name, digest in latch.named()):
        controller.delete(conversation_id)
        return Resolution("dropped_stale")
    # Stored under the engine's own caps (it may evict other cached latches, never
    # lose them: Redis keeps them). One too large to keep still steers this turn.
    clamps = resolve_clamps(latch.clamps, registry)
    check_per_point(clamps, max_clamps)
    sites = combine(latch.value_sites, latch.refs, registry)
    check_in_range(sites, clamps, bound, param=RESTORE_FIELD)  # the gateway's copy is input too
    controller.store(conversation_id, latch)
    return Resolution("restored", latch.phase, sites, clamps)


def check_in_range(
    sites: Mapping[Site, np.ndarray],
    clamps: Iterable[Resolved],
    bound: SteeringBound,
    param: str = "steering.vectors",
) -> None:
    """What a turn applies stays within ``bound``: the summed steering at each point of
    the stream, and each clamp's bounds (a clamp moves the projection to a bound: one of
    1e5 is inf in float16). ``param`` names the field that carried them."""
    check_sites_finite(sites, bound, param)
    limit = bound.limit
    for c in clamps:
        for value in (c.bounds.lo, c.bounds.hi):
            if value is not None and abs(value) > limit:
                raise InvalidField(
                    param,
                    f"'{param}': a clamp bound of {value:.7g} is beyond {limit:.4g}, "
                    f"the most this {bound.dtype} model takes (more overflows it)",
                )


def _require_vectors(
    named: Iterable[tuple[str, str]], registry: VectorRegistry, expect: Expect
) -> None:
    """A latch's named vectors must be here, each with the content the gateway says
    Redis holds where it says (it may not: a latch recorded before the gateway sent
    them); else a 409 for the gateway to install them."""
    for name, _ in named:
        held = registry.digest_of(name)
        if held is None or held != expect.vectors.get(name, held):
            raise cache_miss("vector_missing", "named vectors of this turn")


def _refs(
    steering: SteeringRequest, registry: VectorRegistry, expect: Expect | None = None
) -> tuple[RefTerm, ...]:
    refs = []
    for term in steering.terms:
        if not isinstance(term, NamedTerm) or term.clamp is not None:
            continue
        refs.append(RefTerm(term.name, _ref_digest(term, registry, expect)[1], term.scale))
    return tuple(refs)


def _ref_digest(
    term: NamedTerm, registry: VectorRegistry, expect: Expect | None
) -> tuple[str, str]:
    """(name, current digest) of a named term; a 409 if the gateway expects other
    content, a 400 if this engine has no such vector."""
    digest = registry.digest_of(term.name)
    if expect is not None and term.name in expect.vectors:
        if digest != expect.vectors[term.name]:
            raise cache_miss("vector_missing", "named vectors of this turn")
    if digest is None:
        param = f"steering.vectors[{term.index}].name"
        raise InvalidField(param, f"'{param}': no vector with this name", code="unknown_vector")
    return term.name, digest
