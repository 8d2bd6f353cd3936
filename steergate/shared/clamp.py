"""Directional clamps and ablation: the parts both sides share (no torch, no vLLM).

A clamp term bounds the residual stream's component along a direction ``v``. With
``v̂ = v / |v|`` and ``c = h · v̂`` at the site, after the site's additive steering::

    h' = h + strength · (clip(c, min, max) − c) · v̂

``"value": x`` is ``min = max = x``; ``"op": "ablate"`` is ``value 0``. A missing
bound is no bound (``±inf``). Several clamps at one point of the stream apply one
after the other in the order of the request's terms (layers ascending within a
term); ``post_block`` l and ``pre_attn`` l+1 are one point (docs/steering-op.md).

Three shapes of one clamp:

* :class:`Bounds` -- min, max, strength, as parsed from a term;
* :class:`ClampItem` -- one clamp *term* as a latch keeps it: by value (unit
  directions per site) or by reference (engine-side vector name + content digest);
* :class:`Resolved` -- one clamp at one site, what the workers' tables hold.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from steergate.shared.codecs import b64_to_f32, f32_to_b64
from steergate.shared.errors import InvalidField

Site = tuple[str, int]  # (hook, layer)
OPS: tuple[str, ...] = ("add", "clamp", "ablate")
#: Clamp directions per point of the stream when the engine is not told otherwise.
DEFAULT_MAX_CLAMPS_PER_SITE = 4
_FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Bounds:
    lo: float | None  # None: no lower bound
    hi: float | None  # None: no upper bound
    strength: float = 1.0

    def as_list(self) -> list[float | None]:
        return [self.lo, self.hi, self.strength]

    def floats(self) -> tuple[float, float, float]:
        """(lo, hi, strength) with missing bounds as ±inf, as the tables hold them."""
        lo = -math.inf if self.lo is None else self.lo
        hi = math.inf if self.hi is None else self.hi
        return lo, hi, self.strength


@dataclass(frozen=True)
class ClampItem:
    """One clamp term of a latch: ``sites`` (unit float32 directions, by value) or
    ``ref`` (engine-side vector name, content digest), never both."""

    bounds: Bounds
    sites: Mapping[Site, np.ndarray] = field(default_factory=dict)
    ref: tuple[str, str] | None = None

    @property
    def nbytes(self) -> int:
        return int(sum(int(v.nbytes) for v in self.sites.values()))


@dataclass(frozen=True)
class Resolved:
    site: Site
    direction: np.ndarray  # float32, unit length
    bounds: Bounds


# ---- parsing ------------------------------------------------------------------


def parse_bounds(obj: Mapping[str, Any], op: str, param: str) -> Bounds:
    """``min``/``max``/``value``/``strength`` of a clamp or ablate term."""
    strength = _number(obj.get("strength", 1.0), f"{param}.strength")
    if not 0.0 <= strength <= 1.0:
        raise InvalidField(f"{param}.strength", f"'{param}.strength' must be in [0, 1]")
    if op == "ablate":
        for key in ("min", "max", "value"):
            if key in obj:
                raise InvalidField(
                    f"{param}.{key}", f"'{param}.{key}' is not allowed with op 'ablate' (value 0)"
                )
        return Bounds(0.0, 0.0, strength)
    if "value" in obj:
        for key in ("min", "max"):
            if key in obj:
                raise InvalidField(
                    f"{param}.{key}", f"'{param}.value' and '{param}.{key}' exclude each other"
                )
        value = _number(obj["value"], f"{param}.value")
        return Bounds(value, value, strength)
    lo = _number(obj["min"], f"{param}.min") if obj.get("min") is not None else None
    hi = _number(obj["max"], f"{param}.max") if obj.get("max") is not None else None
    if lo is None and hi is None:
        raise InvalidField(
            f"{param}.min", f"'{param}': op 'clamp' needs 'min', 'max' or 'value'"
        )
    if lo is not None and hi is not None and lo > hi:
        raise InvalidField(
            f"{param}.min", f"'{param}.min' ({lo:g}) is above '{param}.max' ({hi:g})"
        )
    return Bounds(lo, hi, strength)


def _number(value: Any, param: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidField(param, f"'{param}' must be a finite number")
    try:
        out = float(value)
    except OverflowError:
        out = math.inf
    if not math.isfinite(out) or abs(out) > _FLOAT32_MAX:
        raise InvalidField(
            param, f"'{param}' must be a finite number of magnitude at most {_FLOAT32_MAX:.7g}"
        )
    return out


def unit(vec: np.ndarray, param: str) -> np.ndarray:
    """``vec / |vec|`` in float64, rounded once to float32. A zero vector has no
    direction: 400 naming ``param``."""
    v = np.asarray(vec, dtype=np.float64)
    norm = float(np.linalg.norm(v))
    if not math.isfinite(norm) or norm == 0.0:
        raise InvalidField(param, f"'{param}': a clamp direction must be a non-zero vector")
    return (v / norm).astype(np.float32)


# ---- resolution and limits ----------------------------------------------------


def point(site: Site) -> Site:
    """The point of the stream a site names: ``pre_attn`` l (l >= 1) is ``post_block`` l-1."""
    hook, layer = site
    return ("post_block", layer - 1) if hook == "pre_attn" and layer > 0 else site


def check_per_point(
    clamps: Iterable[Resolved], limit: int, param: str = "steering.vectors"
) -> None:
    counts: dict[Site, int] = {}
    for c in clamps:
        p = point(c.site)
        counts[p] = counts.get(p, 0) + 1
        if counts[p] > limit:
            hook, layer = c.site
            raise InvalidField(
                param,
                f"'{param}': more than {limit} clamp directions at {hook} layer {layer} "
                "(post_block l and pre_attn l+1 count together); this engine allows "
                f"{limit} per point",
            )


def value_resolved(item: ClampItem) -> list[Resolved]:
    return [Resolved(site, item.sites[site], item.bounds) for site in sorted(item.sites)]


# ---- digests and wire forms ---------------------------------------------------


def update_digest(h: Any, clamps: Iterable[Resolved]) -> None:
    """Mix resolved clamps, in order, into a payload digest (called only when there
    are clamps, so a pure add's digest is what it always was)."""
    for c in clamps:
        h.update(f"|clamp:{c.site[0]}:{c.site[1]}|".encode())
        h.update(struct.pack("<3d", *c.bounds.floats()))
        h.update(np.asarray(c.direction, dtype="<f4").tobytes())


def update_latch_digest(h: Any, items: Iterable[ClampItem]) -> None:
    for item in items:
        h.update(b"|clampterm|")
        h.update(struct.pack("<3d", *item.bounds.floats()))
        if item.ref is not None:
            h.update(f"ref:{item.ref[0]}:{item.ref[1]}".encode())
        for hook, layer in sorted(item.sites):
            h.update(f"|{hook}:{layer}|".encode())
            h.update(np.asarray(item.sites[(hook, layer)], dtype="<f4").tobytes())


def encode_resolved(clamps: Iterable[Resolved]) -> list[list[Any]]:
    return [[c.site[0], c.site[1], f32_to_b64(c.direction), *c.bounds.as_list()] for c in clamps]


def decode_resolved(rows: Iterable[list[Any]]) -> tuple[Resolved, ...]:
    return tuple(
        Resolved((str(h), int(layer)), b64_to_f32(data), Bounds(lo, hi, float(s)))
        for h, layer, data, lo, hi, s in rows
    )


def encode_items(items: Iterable[ClampItem]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for item in items:
        doc: dict[str, Any] = {"b": item.bounds.as_list()}
        if item.ref is not None:
            doc["ref"] = list(item.ref)
        else:
            doc["sites"] = [[h, layer, f32_to_b64(item.sites[(h, layer)])]
                            for h, layer in sorted(item.sites)]
        out.append(doc)
    return out


#: How far a stored direction's norm may be from 1: float32 rounding of a unit vector
#: moves it by about 1e-7 per sqrt(element); anything further was not written by us.
_UNIT_TOLERANCE = 1e-4


def decode_items(docs: Any, hooks: Iterable[str]) -> tuple[ClampItem, ...]:
    """Inverse of :func:`encode_items`; raises ValueError/KeyError/TypeError on junk.
    Holds what :func:`parse_bounds` and :func:`unit` guarantee of a parsed term (a
    bound, ``min <= max``, unit directions): a stored latch is input too."""
    allowed = set(hooks)
    items = []
    for doc in docs:
        lo, hi, s = doc["b"]
        bounds = Bounds(_opt(lo), _opt(hi), float(s))
        if not 0.0 <= bounds.strength <= 1.0:
            raise ValueError("bad strength")
        if bounds.lo is None and bounds.hi is None:
            raise ValueError("a clamp without a bound")
        if bounds.lo is not None and bounds.hi is not None and bounds.lo > bounds.hi:
            raise ValueError("clamp min above max")
        if "ref" in doc:
            name, digest = doc["ref"]
            items.append(ClampItem(bounds, ref=(str(name), str(digest))))
            continue
        sites: dict[Site, np.ndarray] = {}
        for hook, layer, data in doc["sites"]:
            if hook not in allowed or not isinstance(layer, int) or isinstance(layer, bool):
                raise ValueError("bad site")
            vec = b64_to_f32(data)
            if not np.isfinite(vec).all():
                raise ValueError("non-finite clamp direction")
            if abs(float(np.linalg.norm(vec.astype(np.float64))) - 1.0) > _UNIT_TOLERANCE:
                raise ValueError("clamp direction not of unit length")
            sites[(hook, layer)] = vec
        items.append(ClampItem(bounds, sites=sites))
    return tuple(items)


def _opt(value: Any) -> float | None:
    if value is None:
        return None
    out = float(value)
    if not math.isfinite(out):
        raise ValueError("non-finite bound")
    return out

