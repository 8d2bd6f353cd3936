"""The ``steering`` request object: parsing and validation, shared by both sides.

The gateway validates to answer 400s before spending a rate-limit slot on the
engine, and to know a latch's size up front; the engine validates again because it
also serves single-tenant callers directly. One parser keeps both answers equal.

Every rejection is an :class:`~shared.errors.InvalidField` whose ``param`` is the
JSON path of the offending value, e.g. ``steering.vectors[2].layers.7``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from steergate.shared.clamp import OPS, Bounds, parse_bounds, point, unit
from steergate.shared.codecs import (
    DTYPES,
    CodecError,
    b64decode_strict,
    check_b64_length,
    decode_packed_bytes,
)
from steergate.shared.errors import InvalidField, reject_unknown
from steergate.shared.positions import parse_tokens

HOOKS: tuple[str, ...] = ("pre_attn", "post_attn", "post_block")
PHASES: tuple[str, ...] = ("all", "prefill", "decode")
MAX_TERMS = 256
FLOAT32_BYTES = 4
#: Steering is applied in float32: a larger scale becomes inf there, however finite in JSON.
FLOAT32_MAX = float(np.finfo(np.float32).max)
#: The largest finite value of each dtype a model may be served in: the steering
#: tables hold the summed steering in it (a float16 row of 1e5 is inf).
DTYPE_MAX = {"float32": FLOAT32_MAX, "bfloat16": 3.3895313892515355e38, "float16": 65504.0}
#: The most a request's summed steering may hold in one element at one point of the
#: stream (and the largest clamp bound), whatever the dtype: 100 times the largest
#: activations reported in LLM residual streams (about 1e4, "massive activations"). Past
#: about 1e19 the float32 math of a norm squares the stream to inf, every point at once
#: may add this much, and a non-finite hidden state is not the request's alone: it is
#: written to KV-cache blocks that other requests are given next (found from outside: one
#: tenant's 3e38 at 8 points emptied another tenant's unsteered answers).
STEER_ABS_MAX = 1e6
#: Layer keys are ASCII decimal without sign or leading zeros ("²".isdigit() and
#: int("١") == 1 are why this is not ``str.isdigit``); 9 digits is past any model.
_LAYER_KEY = re.compile(r"0|[1-9][0-9]{0,8}")

Site = tuple[str, int]  # (hook, layer)


@dataclass(frozen=True)
class ModelShape:
    """What validation needs to know about the served model."""

    hidden_size: int
    num_layers: int


@dataclass(frozen=True)
class NamedTerm:
    name: str
    scale: float = 1.0
    index: int = 0  # position in ``vectors``, for error messages
    clamp: Bounds | None = None  # op clamp/ablate (steergate/shared/clamp.py); None: an add


@dataclass(frozen=True)
class InlineTerm:
    hook: str
    layers: dict[int, np.ndarray] = field(hash=False)
    scale: float = 1.0
    index: int = 0
    clamp: Bounds | None = None  # op clamp/ablate: ``layers`` hold unit directions


Term = NamedTerm | InlineTerm


@dataclass(frozen=True)
class SteeringRequest:
    terms: tuple[Term, ...]
    phase: str = "all"
    latch: bool = False

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.terms if isinstance(t, NamedTerm)]

    def inline_sites(self) -> set[Site]:
        return {
            (t.hook, layer)
            for t in self.terms
            if isinstance(t, InlineTerm) and t.clamp is None
            for layer in t.layers
        }

    def inline_latch_bytes(self, hidden_size: int) -> int:
        """Bytes a by-value latch of this request holds: one float32 vector per
        distinct inline add site after summing its terms, plus one per inline clamp
        direction (clamps are kept one by one: their order matters)."""
        clamps = sum(
            len(t.layers) for t in self.terms if isinstance(t, InlineTerm) and t.clamp is not None
        )
        return FLOAT32_BYTES * hidden_size * (len(self.inline_sites()) + clamps)


def parse_steering(obj: Any, shape: ModelShape | None, param: str = "steering") -> SteeringRequest:
    """Validate a ``steering`` object. ``shape=None`` checks structure only
    (lengths and layer ranges are then left to whoever knows the model)."""
    if not isinstance(obj, dict):
        raise InvalidField(param, f"'{param}' must be an object")
    reject_unknown(obj, {"vectors", "phase", "latch", "tokens", "compare"}, param)
    if not isinstance(obj.get("compare", False), bool):
        raise InvalidField(f"{param}.compare", f"'{param}.compare' must be a boolean")
    phase = obj.get("phase", "all")
    if phase not in PHASES:
        raise InvalidField(f"{param}.phase", f"'{param}.phase' must be one of {', '.join(PHASES)}")
    if "tokens" in obj:  # steergate/shared/positions.py: phase is its shorthand
        if "phase" in obj:
            raise InvalidField(
                f"{param}.tokens", f"'{param}.tokens' and '{param}.phase' exclude each other"
            )
        phase = parse_tokens(obj["tokens"], f"{param}.tokens")
    latch = obj.get("latch", False)
    if not isinstance(latch, bool):
        raise InvalidField(f"{param}.latch", f"'{param}.latch' must be a boolean")
    vectors = obj.get("vectors", [])
    if not isinstance(vectors, list):
        raise InvalidField(f"{param}.vectors", f"'{param}.vectors' must be an array")
    if len(vectors) > MAX_TERMS:
        raise InvalidField(
            f"{param}.vectors",
            f"'{param}.vectors' has {len(vectors)} terms; at most {MAX_TERMS} are allowed",
        )
    if latch and not vectors:
        raise InvalidField(f"{param}.vectors", f"'{param}.latch' needs at least one vector to keep")
    terms = tuple(parse_term(v, shape, f"{param}.vectors[{i}]", i) for i, v in enumerate(vectors))
    return SteeringRequest(terms=terms, phase=phase, latch=latch)


def parse_term(obj: Any, shape: ModelShape | None, param: str, index: int = 0) -> Term:
    if not isinstance(obj, dict):
        raise InvalidField(param, f"'{param}' must be an object")
    op = obj.get("op", "add")
    if op not in OPS:
        raise InvalidField(f"{param}.op", f"'{param}.op' must be one of {', '.join(OPS)}")
    if op != "add":
        return _parse_clamp_term(obj, op, shape, param, index)
    scale = _parse_scale(obj.get("scale", 1.0), f"{param}.scale")
    if "name" in obj:
        reject_unknown(obj, named_term_keys(op), param)
        name = obj["name"]
        if not isinstance(name, str) or not name:
            raise InvalidField(f"{param}.name", f"'{param}.name' must be a non-empty string")
        return NamedTerm(name=name, scale=scale, index=index)
    reject_unknown(obj, {"hook", "layers", "packed", "scale", "op"}, param)
    hook = parse_hook(obj.get("hook"), f"{param}.hook")
    layers = parse_layers_or_packed(obj, shape, param)
    _check_scaled(layers, scale, f"{param}.scale")
    return InlineTerm(hook=hook, layers=layers, scale=scale, index=index)


_CLAMP_KEYS = {"op", "min", "max", "value", "strength"}


def named_term_keys(op: Any) -> set[str]:
    """The keys a named term may hold: one list for the parser and the gateway's
    prescan (which refuses the others before admission, as a large body's parse does)."""
    return {"name", "scale", "op"} if op == "add" else {"name"} | _CLAMP_KEYS


def _parse_clamp_term(
    obj: dict[str, Any], op: str, shape: ModelShape | None, param: str, index: int
) -> Term:
    """A clamp or ablate term (steergate/shared/clamp.py). No ``scale``: only the direction
    of the vector matters. Inline directions are normalised here."""
    if "name" in obj:
        reject_unknown(obj, named_term_keys(op), param)
        bounds = parse_bounds(obj, op, param)
        name = obj["name"]
        if not isinstance(name, str) or not name:
            raise InvalidField(f"{param}.name", f"'{param}.name' must be a non-empty string")
        return NamedTerm(name=name, index=index, clamp=bounds)
    reject_unknown(obj, {"hook", "layers", "packed"} | _CLAMP_KEYS, param)
    bounds = parse_bounds(obj, op, param)
    hook = parse_hook(obj.get("hook"), f"{param}.hook")
    layers = parse_layers_or_packed(obj, shape, param)
    key = "layers" if "layers" in obj else "packed"
    units = {layer: unit(vec, f"{param}.{key}.{layer}") for layer, vec in layers.items()}
    return InlineTerm(hook=hook, layers=units, index=index, clamp=bounds)


def parse_vector_body(
    obj: Any, shape: ModelShape | None
) -> tuple[str, dict[int, np.ndarray], str | None]:
    """A named-vector registration body ``{hook, layers|packed, description?}``."""
    if not isinstance(obj, dict):
        raise InvalidField("body", "the request body must be a JSON object", "invalid_json")
    reject_unknown(obj, {"hook", "layers", "packed", "description"}, None)
    hook = parse_hook(obj.get("hook"), "hook")
    description = obj.get("description")
    if description is not None and (not isinstance(description, str) or len(description) > 1024):
        raise InvalidField(
            "description", "'description' must be a string of at most 1024 characters"
        )
    return hook, parse_layers_or_packed(obj, shape, None), description


def parse_hook(value: Any, param: str) -> str:
    if value not in HOOKS:
        raise InvalidField(
            param, f"'{param}' must be one of {', '.join(HOOKS)}; got {_short(value)}"
        )
    return str(value)


def parse_layers_or_packed(
    obj: Mapping[str, Any], shape: ModelShape | None, param: str | None
) -> dict[int, np.ndarray]:
    prefix = f"{param}." if param else ""
    has_layers, has_packed = "layers" in obj, "packed" in obj
    if has_layers == has_packed:
        raise InvalidField(
            f"{prefix}layers", f"exactly one of '{prefix}layers' or '{prefix}packed' must be given"
        )
    if has_layers:
        return _parse_layers(obj["layers"], shape, f"{prefix}layers")
    return _parse_packed(obj["packed"], shape, f"{prefix}packed")


def check_vectors(layers: Mapping[int, np.ndarray], shape: ModelShape, param: str) -> None:
    """Layer range, length and finiteness of already-decoded vectors (e.g. GGUF)."""
    for layer, vec in layers.items():
        _check_layer(layer, shape, f"{param}.{layer}")
        _check_vector(vec, shape, f"{param}.{layer}")


def _parse_layers(obj: Any, shape: ModelShape | None, param: str) -> dict[int, np.ndarray]:
    if not isinstance(obj, dict) or not obj:
        raise InvalidField(
            param, f"'{param}' must be a non-empty object of layer index -> array of numbers"
        )
    out: dict[int, np.ndarray] = {}
    for key, values in obj.items():
        if not isinstance(key, str) or not _LAYER_KEY.fullmatch(key):
            p = f"{param}.{key}" if isinstance(key, str) and _printable(key) else param
            raise InvalidField(
                p,
                f"'{p}': layer keys must be 0-based decimal integers in ASCII digits, without "
                f"sign or leading zeros; got {_short(key)}",
            )
        p = f"{param}.{key}"
        layer = int(key)
        _check_layer(layer, shape, p)
        if isinstance(values, list) and values:
            _check_length(len(values), shape, p)  # before a single element is converted
        vec = inline_vector(values, p)
        _check_vector(vec, shape, p)
        out[layer] = vec
    return out


def inline_vector(values: Any, param: str) -> np.ndarray:
    """A JSON array of numbers as float32, at C speed: the element types are read by
    ``set(map(type, ...))`` and the values converted by numpy, so no Python bytecode
    runs per element (a per-element ``isinstance`` loop cost 60 ms per million)."""
    if not isinstance(values, list) or not values:
        raise InvalidField(param, f"'{param}' must be a non-empty array of numbers")
    # bool is a subclass of int, but True is no steering value: exact types only.
    if not set(map(type, values)) <= _NUMBER_TYPES:
        raise InvalidField(param, f"'{param}' must contain only numbers")
    try:
        with np.errstate(over="ignore"):  # past float32's range becomes inf, rejected below
            vec = np.asarray(values, dtype=np.float64).astype(np.float32)
    except OverflowError:  # an integer past float64 (Python's json parses 1e400 digits)
        raise InvalidField(param, f"'{param}' contains NaN or Inf") from None
    if not np.isfinite(vec).all():
        raise InvalidField(param, f"'{param}' contains NaN or Inf")
    return vec


_NUMBER_TYPES: frozenset[type] = frozenset({int, float})


def _parse_packed(obj: Any, shape: ModelShape | None, param: str) -> dict[int, np.ndarray]:
    if not isinstance(obj, dict):
        raise InvalidField(param, f"'{param}' must be an object")
    reject_unknown(obj, {"dtype", "shape", "layer_indices", "data"}, param)
    dtype = obj.get("dtype", "float32")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise InvalidField(f"{param}.dtype", f"'{param}.dtype' must be one of {', '.join(DTYPES)}")
    dims = obj.get("shape")
    if (
        not isinstance(dims, list)
        or len(dims) != 2
        or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims)
    ):
        raise InvalidField(
            f"{param}.shape",
            f"'{param}.shape' must be [num_layers, hidden_size] of positive integers",
        )
    rows, width = dims
    if shape is not None and width != shape.hidden_size:
        raise InvalidField(
            f"{param}.shape",
            f"'{param}.shape' has width {width}; the model's hidden size is {shape.hidden_size}",
        )
    indices = obj.get("layer_indices")
    if not isinstance(indices, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in indices
    ):
        raise InvalidField(
            f"{param}.layer_indices", f"'{param}.layer_indices' must be an array of integers"
        )
    if len(indices) != rows:
        raise InvalidField(
            f"{param}.layer_indices",
            f"'{param}.layer_indices' has {len(indices)} entries but shape has {rows} rows",
        )
    if len(set(indices)) != len(indices):
        raise InvalidField(
            f"{param}.layer_indices", f"'{param}.layer_indices' must not repeat a layer"
        )
    for i in indices:
        _check_layer(i, shape, f"{param}.layer_indices")
    data = obj.get("data")
    if not isinstance(data, str):
        raise InvalidField(f"{param}.data", f"'{param}.data' must be a base64 string")
    try:
        check_b64_length(data, rows * width * DTYPES[dtype])
        flat = decode_packed_bytes(b64decode_strict(data), dtype, rows * width)
    except CodecError as exc:
        raise InvalidField(f"{param}.data", f"'{param}.data' {exc}") from exc
    matrix = flat.reshape(rows, width)
    if not np.isfinite(matrix).all():
        raise InvalidField(f"{param}.data", f"'{param}.data' contains NaN or Inf")
    return {int(layer): matrix[r].copy() for r, layer in enumerate(indices)}


def _check_layer(layer: int, shape: ModelShape | None, param: str) -> None:
    if layer < 0 or (shape is not None and layer >= shape.num_layers):
        bound = f"0..{shape.num_layers - 1}" if shape is not None else ">= 0"
        raise InvalidField(param, f"'{param}': layer {layer} is out of range ({bound})")


def _check_length(length: int, shape: ModelShape | None, param: str) -> None:
    if shape is not None and length != shape.hidden_size:
        raise InvalidField(
            param,
            f"'{param}' has length {length}; the model's hidden size is {shape.hidden_size}",
        )


def _check_vector(vec: np.ndarray, shape: ModelShape | None, param: str) -> None:
    if shape is not None and vec.shape != (shape.hidden_size,):
        raise InvalidField(
            param,
            f"'{param}' has length {vec.size}; the model's hidden size is {shape.hidden_size}",
        )
    if not np.isfinite(vec).all():
        raise InvalidField(param, f"'{param}' contains NaN or Inf")


def _parse_scale(value: Any, param: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidField(param, f"'{param}' must be a finite number")
    try:
        scale = float(value)
    except OverflowError:  # an integer beyond float64
        scale = math.inf
    if not math.isfinite(scale) or abs(scale) > FLOAT32_MAX:
        raise InvalidField(
            param, f"'{param}' must be a finite number of magnitude at most {FLOAT32_MAX:.7g}"
        )
    return scale


def _check_scaled(layers: Mapping[int, np.ndarray], scale: float, param: str) -> None:
    """Each vector times ``scale`` must stay finite in float32, where it is applied."""
    factor = np.float32(scale)
    with np.errstate(over="ignore"):
        for vec in layers.values():
            if not np.isfinite(vec * factor).all():
                raise InvalidField(param, f"'{param}' times the vector overflows float32")


@dataclass(frozen=True)
class SteeringBound:
    """How far a request may move the residual stream of the served model: ``limit`` per
    element of the summed steering at one point, and per clamp bound. All 2 L + 1 points
    at once stay within half the dtype's range (the tables and the stream hold the
    steering in it: a float16 row of 1e5 is inf), and never past :data:`STEER_ABS_MAX`."""

    dtype: str = "float32"  # a key of DTYPE_MAX
    num_layers: int = 1

    @property
    def limit(self) -> float:
        points = 2 * max(1, self.num_layers) + 1
        return min(STEER_ABS_MAX, DTYPE_MAX[self.dtype] / (2 * points))


def check_sites_finite(
    sites: Mapping[Site, np.ndarray],
    bound: SteeringBound,
    param: str = "steering.vectors",
) -> None:
    """The summed steering (inline and named terms, each scaled) must be finite and
    within ``bound`` at every point of the stream: every term may be within it while
    their sum is not, and ``post_block`` l and ``pre_attn`` l+1 are one point, summed
    into one table row (``engine/worker/tables.py``)."""
    limit = bound.limit
    points: dict[Site, np.ndarray] = {}
    with np.errstate(over="ignore", invalid="ignore"):
        for site, vec in sites.items():
            at = point(site)
            points[at] = points[at] + vec if at in points else vec
        for (hook, layer), summed in points.items():
            peak = float(np.abs(summed).max(initial=0.0))
            if peak <= limit:  # NaN compares False: refused too
                continue
            where = f"{hook} layer {layer}"
            if hook == "post_block":
                where += f" (the same point as pre_attn layer {layer + 1})"
            raise InvalidField(
                param,
                f"'{param}': the summed steering at {where} reaches {peak:.4g} in one "
                f"element; this {bound.dtype} model takes at most {limit:.4g} per point of "
                "the stream (more overflows it)",
            )


def _printable(text: str) -> bool:
    return len(text) <= 32 and text.isprintable()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
