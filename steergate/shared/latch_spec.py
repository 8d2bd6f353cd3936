"""A latch as data: what Redis keeps for a latched conversation and what the gateway
sends an engine to restore it.

A latch is its phase, its by-value sites (inline terms scaled and summed per
(hook, layer), float32) and its by-reference terms (engine-side vector name,
content digest, scale). Both sides build it with :func:`sum_inline` in one fixed
order, so a restored latch steers bit-identically to the turn that stored it, and
both compute the same :func:`latch_digest`, which is how an engine and Redis agree
on *which* latch a conversation holds.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from steergate.shared.clamp import ClampItem, decode_items, encode_items, update_latch_digest
from steergate.shared.codecs import b64_to_f32, f32_to_b64
from steergate.shared.positions import is_phase
from steergate.shared.steering import HOOKS, InlineTerm, NamedTerm

Site = tuple[str, int]  # (hook, layer)
Ref = tuple[str, str, float]  # (engine-side vector name, digest, scale)

VERSION = 1


class SpecError(ValueError):
    """A spec that is not one this module wrote."""


@dataclass(frozen=True)
class LatchSpec:
    phase: str
    sites: Mapping[Site, np.ndarray] = field(default_factory=dict)
    refs: tuple[Ref, ...] = ()
    #: Clamp terms in request order (steergate/shared/clamp.py); absent from the encoding
    #: when empty.
    clamps: tuple[ClampItem, ...] = ()

    @property
    def nbytes(self) -> int:
        return int(sum(int(v.nbytes) for v in self.sites.values())) + sum(
            c.nbytes for c in self.clamps
        )

    @property
    def kind(self) -> str:
        return "value" if self.sites or any(c.sites for c in self.clamps) else "ref"

    @property
    def digest(self) -> str:
        return latch_digest(self.phase, self.sites, self.refs, self.clamps)

    def named(self) -> list[tuple[str, str]]:
        """(engine-side name, digest) of every by-reference term, adds and clamps: the
        vectors the latch steers with, as they were when it was made."""
        return [(r[0], r[1]) for r in self.refs] + [
            c.ref for c in self.clamps if c.ref is not None
        ]

    def encode(self) -> str:
        doc: dict[str, Any] = {
            "v": VERSION,
            "phase": self.phase,
            "sites": [
                [h, layer, f32_to_b64(self.sites[(h, layer)])] for h, layer in sorted(self.sites)
            ],
            "refs": [list(r) for r in self.refs],
        }
        if self.clamps:
            doc["clamps"] = encode_items(self.clamps)
        return json.dumps(doc, separators=(",", ":"))


def latch_digest(
    phase: str,
    sites: Mapping[Site, np.ndarray],
    refs: Iterable[Ref],
    clamps: tuple[ClampItem, ...] = (),
) -> str:
    """Identity of a latch: equal digests mean equal steering on every later turn.
    Clamps are mixed in only when there are some: an add-only latch keeps its digest."""
    h = hashlib.sha256(f"latch:{phase}".encode())
    for hook, layer in sorted(sites):
        h.update(f"|{hook}:{layer}|".encode())
        h.update(np.asarray(sites[(hook, layer)], dtype="<f4").tobytes())
    for name, digest, scale in refs:
        h.update(f"|ref:{name}:{digest}:".encode())
        h.update(struct.pack("<d", float(scale)))
    if clamps:
        update_latch_digest(h, clamps)
    return h.hexdigest()


def decode_spec(text: str | bytes | Any) -> LatchSpec:
    """Parse a spec written by :meth:`LatchSpec.encode` (or its parsed JSON)."""
    try:
        doc = json.loads(text) if isinstance(text, (str, bytes)) else text
        if not isinstance(doc, dict) or doc.get("v") != VERSION:
            raise SpecError("unsupported latch spec")
        phase = doc["phase"]
        if not is_phase(phase):
            raise SpecError("bad phase")
        sites: dict[Site, np.ndarray] = {}
        for hook, layer, data in doc["sites"]:
            if hook not in HOOKS or not isinstance(layer, int) or isinstance(layer, bool):
                raise SpecError("bad site")
            vec = b64_to_f32(data)
            if not np.isfinite(vec).all():
                raise SpecError("non-finite site")
            sites[(hook, layer)] = vec
        refs = tuple((str(n), str(d), float(s)) for n, d, s in doc["refs"])
        if not all(math.isfinite(scale) for _, _, scale in refs):
            raise SpecError("non-finite scale")
        clamps = decode_items(doc.get("clamps", ()), HOOKS)
    except SpecError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecError("malformed latch spec") from exc
    return LatchSpec(phase, sites, refs, clamps)


def sum_inline(terms: Iterable[InlineTerm]) -> dict[Site, np.ndarray]:
    """By-value part of a steering: one float32 vector per distinct (hook, layer),
    terms scaled and summed in request order."""
    sites: dict[Site, np.ndarray] = {}
    for term in terms:
        if term.clamp is not None:
            continue  # clamps are kept one by one (LatchSpec.clamps), never summed
        scale = np.float32(term.scale)
        for layer, vec in term.layers.items():
            accumulate(sites, (term.hook, int(layer)), vec, scale)
    return sites


def accumulate(
    sites: dict[Site, np.ndarray], site: Site, vec: np.ndarray, scale: np.float32
) -> None:
    # A sum that overflows to inf is refused afterwards, naming the field (the range
    # checks of the gateway and the engine); numpy need not warn in the log too.
    with np.errstate(over="ignore"):
        scaled = np.asarray(vec, dtype=np.float32) * scale
        if site in sites:
            sites[site] = sites[site] + scaled
        else:
            sites[site] = scaled.astype(np.float32, copy=True)


def clamp_items(
    terms: Iterable[InlineTerm | NamedTerm], ref_of: Callable[[NamedTerm], tuple[str, str]]
) -> tuple[ClampItem, ...]:
    """The clamp terms of a steering in request order, as a latch keeps them (the
    gateway and the engine both build them here, so they agree on the digest).
    ``ref_of`` maps a named term to (engine-side name, content digest)."""
    items = []
    for term in terms:
        if term.clamp is None:
            continue
        if isinstance(term, NamedTerm):
            items.append(ClampItem(term.clamp, ref=ref_of(term)))
        else:
            sites = {(term.hook, int(layer)): vec for layer, vec in term.layers.items()}
            items.append(ClampItem(term.clamp, sites=sites))
    return tuple(items)
