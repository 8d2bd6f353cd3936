"""Turn a request's ``steering`` + ``conversation_id`` into the sites a turn is steered
with, applying the contract's latch semantics against the controller.

Every path sums in one fixed order (inline terms in request order, then named terms
in request order), so a bridged turn produces bit-identical sites -- and therefore
the same payload digest, the same cache salt and the same output -- as the turn that
stored the latch. Pure (numpy only); the HTTP layer calls :func:`resolve_turn`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from engine.latch import Latch, LatchController, LatchState, RefTerm, Site
from engine.registry import VectorRegistry
from shared.errors import InvalidField
from shared.steering import InlineTerm, NamedTerm, SteeringRequest


@dataclass(frozen=True)
class Resolution:
    """What one turn does: its latch state (the header value) and the summed sites.
    Empty ``sites`` means the turn is not steered."""

    state: LatchState
    phase: str = "all"
    sites: dict[Site, np.ndarray] = field(default_factory=dict)

    @property
    def applied(self) -> bool:
        return bool(self.sites)


def resolve_turn(
    steering: SteeringRequest | None,
    conversation_id: str | None,
    registry: VectorRegistry,
    controller: LatchController,
) -> Resolution:
    """Raises :class:`InvalidField` before any latch changes, so a rejected request
    never stores, replaces or drops a latch."""
    if steering is None:
        if conversation_id is None:
            return Resolution("none")
        used, latch = controller.use(conversation_id, registry.digest_of)
        if latch is None:
            return Resolution(used)
        return Resolution(used, latch.phase, combine(latch.value_sites, latch.refs, registry))

    if steering.latch and conversation_id is None:
        raise InvalidField(
            "steering.latch",
            "'steering.latch' needs a 'conversation_id'",
            code="latch_without_conversation_id",
        )
    value_sites = sum_inline(t for t in steering.terms if isinstance(t, InlineTerm))
    refs = _refs(steering, registry)
    sites = combine(value_sites, refs, registry)
    state: LatchState = "none"
    if steering.latch and conversation_id is not None:
        state = controller.store(conversation_id, Latch(steering.phase, value_sites, refs))
    return Resolution(state, steering.phase, sites)


def sum_inline(terms: Iterable[InlineTerm]) -> dict[Site, np.ndarray]:
    """By-value part: one float32 vector per distinct (hook, layer)."""
    sites: dict[Site, np.ndarray] = {}
    for term in terms:
        scale = np.float32(term.scale)
        for layer, vec in term.layers.items():
            _accumulate(sites, (term.hook, int(layer)), vec, scale)
    return sites


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
            _accumulate(sites, (vector.hook, int(layer)), vec, scale)
    return sites


def _refs(steering: SteeringRequest, registry: VectorRegistry) -> tuple[RefTerm, ...]:
    refs = []
    for term in steering.terms:
        if not isinstance(term, NamedTerm):
            continue
        digest = registry.digest_of(term.name)
        if digest is None:
            param = f"steering.vectors[{term.index}].name"
            raise InvalidField(param, f"'{param}': no vector with this name", code="unknown_vector")
        refs.append(RefTerm(term.name, digest, term.scale))
    return tuple(refs)


def _accumulate(
    sites: dict[Site, np.ndarray], site: Site, vec: np.ndarray, scale: np.float32
) -> None:
    scaled = np.asarray(vec, dtype=np.float32) * scale
    if site in sites:
        sites[site] = sites[site] + scaled
    else:
        sites[site] = scaled.astype(np.float32, copy=True)
