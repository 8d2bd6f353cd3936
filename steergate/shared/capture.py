"""The ``capture`` request object and answer: parsing, bounds, encoding, decoding.

Shared by the gateway (400s before admission, before work proportional to size)
and the engine (which validates again, knowing the served model and the tokenised
prompts). No torch: numpy only, so the gateway can import it.

Request: ``{"sites": [{"hook", "layers": [int, ...]}], "tokens": "prompt" |
"generated" | "all", "reduce": "mean" | "last" | "none"}``.

Answer: ``{"dtype": "float32", "tokens", "reduce", "sites": [{"index", "hook",
"layer", "shape": [rows, hidden], "data": base64 little-endian float32}]}``.

Rows (see docs/steering-op.md): ``prompt`` rows are the prompt's positions;
``generated`` rows are the generated tokens' positions as each is fed back into
the model -- the last generated token is never fed back, so a completion of ``k``
tokens has ``k - 1`` generated rows; ``all`` is both, in position order. ``mean``
and ``last`` reduce over those rows to one row (zero rows stay zero rows).
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from steergate.shared.codecs import CodecError, b64decode_strict
from steergate.shared.errors import APIError, InvalidField, reject_unknown
from steergate.shared.steering import HOOKS, ModelShape

TOKENS: tuple[str, ...] = ("prompt", "generated", "all")
REDUCES: tuple[str, ...] = ("mean", "last", "none")
FLOAT32_BYTES = 4
#: Distinct (hook, layer) sites per request: every hook at every layer of a 64-layer
#: model is 192; past 256 a caller wants a different tool.
MAX_SITES = 256
#: Captured float32 bytes per request, over all choices and sites (the answer's
#: base64 is 4/3 of this). 64 pairs x 30 layers x 576 x 4 (from-examples on the real
#: model, mean) is 8.8 MiB; ``reduce: "none"`` on long prompts is what this stops.
MAX_BYTES = 64 * 1024 * 1024

Site = tuple[str, int]  # (hook, layer)


@dataclass(frozen=True)
class CaptureLimits:
    max_sites: int = MAX_SITES
    max_bytes: int = MAX_BYTES


@dataclass(frozen=True)
class CaptureSpec:
    """A validated capture request; ``sites`` are distinct, in request order."""

    sites: tuple[Site, ...]
    tokens: str = "prompt"
    reduce: str = "mean"

    def to_json(self) -> dict[str, Any]:
        """The canonical request form (what the engine's workers receive)."""
        by_hook: dict[str, list[int]] = {}
        for hook, layer in self.sites:
            by_hook.setdefault(hook, []).append(layer)
        return {
            "sites": [{"hook": h, "layers": ls} for h, ls in by_hook.items()],
            "tokens": self.tokens,
            "reduce": self.reduce,
        }

    def rows(self, prompt_tokens: int, generated_fed: int) -> int:
        """Rows of one choice's site before reduction becomes one row."""
        n = {"prompt": prompt_tokens, "generated": generated_fed}.get(
            self.tokens, prompt_tokens + generated_fed
        )
        if self.reduce == "none" or n == 0:
            return n
        return 1

    def max_rows(self, prompt_tokens: int, max_tokens: int) -> int:
        """The most rows one choice's site can hold: ``max_tokens`` generated
        tokens feed back ``max_tokens - 1`` of them."""
        return self.rows(prompt_tokens, max(0, max_tokens - 1))

    def nbytes(self, hidden_size: int, rows: int) -> int:
        """Captured float32 bytes for ``rows`` rows per site (all choices together)."""
        return FLOAT32_BYTES * hidden_size * len(self.sites) * rows


def parse_capture(
    obj: Any,
    shape: ModelShape | None,
    param: str = "capture",
    limits: CaptureLimits | None = None,
) -> CaptureSpec:
    """Validate a ``capture`` object. ``shape=None`` checks structure only (layer
    ranges are then left to whoever knows the model). Too many sites is
    ``capture_too_large``; every other fault is ``invalid_request`` naming the field."""
    limits = limits or CaptureLimits()
    if not isinstance(obj, dict):
        raise InvalidField(param, f"'{param}' must be an object")
    reject_unknown(obj, {"sites", "tokens", "reduce"}, param)
    tokens = obj.get("tokens", "prompt")
    if tokens not in TOKENS:
        raise InvalidField(
            f"{param}.tokens", f"'{param}.tokens' must be one of {', '.join(TOKENS)}"
        )
    reduce = obj.get("reduce", "mean")
    if reduce not in REDUCES:
        raise InvalidField(
            f"{param}.reduce", f"'{param}.reduce' must be one of {', '.join(REDUCES)}"
        )
    raw_sites = obj.get("sites")
    if not isinstance(raw_sites, list) or not raw_sites:
        raise InvalidField(f"{param}.sites", f"'{param}.sites' must be a non-empty array")
    if len(raw_sites) > limits.max_sites:  # before looking inside each
        raise _too_large(f"'{param}.sites' has {len(raw_sites)} entries", limits)
    sites: list[Site] = []
    seen: set[Site] = set()
    for i, entry in enumerate(raw_sites):
        for site in _parse_site(entry, shape, f"{param}.sites[{i}]", limits):
            if site in seen:
                raise InvalidField(
                    f"{param}.sites[{i}]",
                    f"'{param}.sites[{i}]' repeats {site[0]} layer {site[1]}",
                )
            seen.add(site)
            sites.append(site)
            if len(sites) > limits.max_sites:
                raise _too_large(f"'{param}' names more than {limits.max_sites} sites", limits)
    return CaptureSpec(sites=tuple(sites), tokens=tokens, reduce=reduce)


def _parse_site(
    obj: Any, shape: ModelShape | None, param: str, limits: CaptureLimits
) -> list[Site]:
    if not isinstance(obj, dict):
        raise InvalidField(param, f"'{param}' must be an object")
    reject_unknown(obj, {"hook", "layers"}, param)
    hook = obj.get("hook")
    if hook not in HOOKS:
        raise InvalidField(
            f"{param}.hook", f"'{param}.hook' must be one of {', '.join(HOOKS)}; got {_short(hook)}"
        )
    layers = obj.get("layers")
    if not isinstance(layers, list) or not layers:
        raise InvalidField(
            f"{param}.layers", f"'{param}.layers' must be a non-empty array of layer indices"
        )
    if len(layers) > limits.max_sites:
        raise _too_large(f"'{param}.layers' has {len(layers)} entries", limits)
    out: list[Site] = []
    for j, layer in enumerate(layers):
        p = f"{param}.layers[{j}]"
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise InvalidField(p, f"'{p}' must be an integer layer index; got {_short(layer)}")
        if layer < 0 or (shape is not None and layer >= shape.num_layers):
            bound = f"0..{shape.num_layers - 1}" if shape is not None else ">= 0"
            raise InvalidField(p, f"'{p}': layer {layer} is out of range ({bound})")
        out.append((str(hook), layer))
    return out


def check_capture_bytes(
    spec: CaptureSpec,
    hidden_size: int,
    rows: int,
    limits: CaptureLimits | None = None,
    param: str = "capture",
) -> int:
    """Raise ``capture_too_large`` when the capture can exceed the byte bound;
    return its bound in bytes. ``rows``: the most rows per site, all choices together
    (the sum of each choice's ``spec.max_rows``). Arithmetic only: a request's ``n``
    is the client's number, so nothing here is sized by it."""
    limits = limits or CaptureLimits()
    total = spec.nbytes(hidden_size, rows)
    if total > limits.max_bytes:
        raise APIError(
            "capture_too_large",
            f"'{param}' can produce {total} bytes ({len(spec.sites)} sites x "
            f"{rows} rows x {hidden_size} float32); at most "
            f"{limits.max_bytes} are allowed per request",
            param=param,
        )
    return total


def _too_large(what: str, limits: CaptureLimits) -> APIError:
    return APIError(
        "capture_too_large",
        f"{what}; at most {limits.max_sites} capture sites are allowed per request",
        param="capture",
    )


def reduce_rows(rows: np.ndarray, reduce: str) -> np.ndarray:
    """``[n, hidden]`` rows reduced as asked, float32 (the mean is taken in float64:
    the reference comparison is at 1e-4 and long prompts sum many rows)."""
    rows = np.asarray(rows, dtype=np.float32)
    if reduce == "none" or rows.shape[0] == 0:
        return rows
    if reduce == "last":
        return rows[-1:].copy()
    return rows.astype(np.float64).mean(axis=0, keepdims=True).astype(np.float32)


def encode_site(index: int, hook: str, layer: int, rows: np.ndarray) -> dict[str, Any]:
    m = np.ascontiguousarray(rows, dtype="<f4")
    return {
        "index": int(index),
        "hook": hook,
        "layer": int(layer),
        "shape": [int(m.shape[0]), int(m.shape[1])],
        "data": base64.b64encode(m.tobytes()).decode("ascii"),
    }


def capture_answer(spec: CaptureSpec, sites: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The answer's top-level ``capture`` object around already-encoded sites."""
    return {"dtype": "float32", "tokens": spec.tokens, "reduce": spec.reduce, "sites": list(sites)}


def answer_bytes(obj: Any) -> int:
    """Captured float32 bytes an answer's ``capture`` object carries (for metering)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("sites"), list):
        return 0
    total = 0
    for site in obj["sites"]:
        shape = site.get("shape") if isinstance(site, dict) else None
        if isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) for d in shape):
            total += FLOAT32_BYTES * shape[0] * shape[1]
    return total


def decode_capture(obj: Any) -> dict[tuple[int, str, int], np.ndarray]:
    """An answer's ``capture`` object as ``{(index, hook, layer): float32 [rows, hidden]}``.
    Raises ``ValueError`` on a malformed object."""
    if not isinstance(obj, dict) or obj.get("dtype") != "float32":
        raise ValueError("capture must be an object with dtype float32")
    sites = obj.get("sites")
    if not isinstance(sites, list):
        raise ValueError("capture.sites must be an array")
    out: dict[tuple[int, str, int], np.ndarray] = {}
    for i, site in enumerate(sites):
        try:
            key = (int(site["index"]), str(site["hook"]), int(site["layer"]))
            rows, width = (int(d) for d in site["shape"])
            raw = b64decode_strict(site["data"])
        except (KeyError, TypeError, ValueError, CodecError) as exc:
            raise ValueError(f"capture.sites[{i}] is malformed: {exc}") from exc
        if rows < 0 or width <= 0 or len(raw) != rows * width * FLOAT32_BYTES:
            raise ValueError(f"capture.sites[{i}]: data does not hold shape [{rows}, {width}]")
        if key in out:
            raise ValueError(f"capture.sites[{i}] repeats {key}")
        out[key] = np.frombuffer(raw, dtype="<f4").astype(np.float32).reshape(rows, width)
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def count_choices(body: Mapping[str, Any], completions: bool) -> int:
    """Choices an answer will have: prompts (a ``/v1/completions`` list of texts or
    of token-id lists) times ``n``."""
    n = body.get("n", 1)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    prompt = body.get("prompt") if completions else None
    prompts = 1
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        prompts = len(prompt)
    return prompts * n


def check_up_front(
    spec: CaptureSpec,
    body: Mapping[str, Any],
    completions: bool,
    hidden_size: int,
    tokens_estimate: int,
    limits: CaptureLimits | None = None,
) -> int:
    """The gateway's byte bound, before admission: exact for ``mean``/``last`` (one
    row per choice and site); for ``none`` the rows are bounded by the admission's
    token estimate (prompt estimate + completion budget x n), the engine then checks
    the exact bound once it knows the model's context length."""
    if spec.reduce == "none":
        rows = max(1, tokens_estimate)
    else:
        rows = count_choices(body, completions)
    return check_capture_bytes(spec, hidden_size, rows, limits)
