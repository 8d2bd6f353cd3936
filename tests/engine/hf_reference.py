"""A ``transformers`` reference for steered greedy decoding, and an HTTP client
for the engine's completions route that returns token ids and logprobs.

The reference runs the model's ``transformers`` class (``AutoModelForCausalLM``,
eager attention) in float32 on the same weights and adds the steering vectors with
forward hooks at the points of the residual stream the hooks name, placed from each
architecture's ``transformers`` modeling code (independently of the engine's
conventions, which it checks):

* ``pre_attn``  l: forward pre-hook on layer l (the stream entering it; for Gemma
  after the embedding scaling, which the model applies before layer 0);
* ``post_attn`` l: the stream right after attention's residual add. Most layers do
  ``residual + self_attn(...)``: forward hook on ``self_attn``. Gemma 2/3 and OLMo 2
  do ``residual + post_attention_layernorm(self_attn(...))``: forward hook on that
  norm. Granite does ``residual + self_attn(...) * residual_multiplier``: forward
  hook on ``self_attn`` adding ``v / residual_multiplier``;
* ``post_block`` l: forward hook on layer l (its output).

Each greedy step is a full forward over prompt + generated tokens (no KV cache), so
the phase mask is simply "position < prompt length".
"""

from __future__ import annotations

import base64
import math
import re
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

Site = tuple[str, int]

#: The tiny model's hidden size, and the prompt the engine tests decode from.
HIDDEN = 128
PROMPT = [int(x) for x in np.random.default_rng(7).integers(10, 600, 14)]


def unit_vector(seed: int, norm: float = 6.0) -> np.ndarray:
    """A random float32 steering vector of this ``norm`` (reproducible by ``seed``)."""
    v = np.random.default_rng(seed).normal(size=HIDDEN).astype(np.float32)
    return (v / np.linalg.norm(v) * norm).astype(np.float32)


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    logprobs: list[float]


#: Architectures whose attention output is normed before the residual add.
_POST_ATTN_NORMED = {"Gemma2ForCausalLM", "Gemma3ForCausalLM", "Olmo2ForCausalLM"}


@cache
def _model(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@dataclass(frozen=True)
class Clamp:
    """One directional clamp for the reference: ``h += s·(clip(h·v̂, lo, hi) − h·v̂)·v̂``."""

    site: Site
    direction: np.ndarray  # any non-zero length; normalised here in float64
    lo: float | None = None
    hi: float | None = None
    strength: float = 1.0

    def unit(self) -> torch.Tensor:
        v = np.asarray(self.direction, dtype=np.float64)
        return torch.as_tensor((v / np.linalg.norm(v)).astype(np.float32))


def _point(site: Site) -> Site:
    hook, layer = site
    return ("post_block", layer - 1) if hook == "pre_attn" and layer > 0 else site


def _post_attn_hook(model: Any, layer: int, vec: torch.Tensor,
                    add: Any) -> torch.utils.hooks.RemovableHandle:
    """A hook that adds ``vec`` to the stream right after attention's residual add."""
    arch = model.config.architectures[0]
    decoder = model.model.layers[layer]
    if arch in _POST_ATTN_NORMED:
        def normed(mod: Any, args: tuple, out: torch.Tensor) -> torch.Tensor:
            return add(out, vec)
        return decoder.post_attention_layernorm.register_forward_hook(normed)
    # Granite scales attention's output by residual_multiplier at the add.
    scaled = vec / float(getattr(model.config, "residual_multiplier", 1.0) or 1.0)

    def attn(mod: Any, args: tuple, out: Any) -> Any:
        return (add(out[0], scaled), *out[1:])
    return decoder.self_attn.register_forward_hook(attn)


def _steering_hooks(model: Any, sites: Mapping[Site, np.ndarray] | None,
                    add: Any) -> list[torch.utils.hooks.RemovableHandle]:
    """Forward hooks adding each site's vector (through ``add(tensor, vec)``) at its
    point of the stream (see the module doc)."""
    layers = model.model.layers
    handles = []
    for (hook, layer), raw in (sites or {}).items():
        vec = torch.as_tensor(np.asarray(raw, dtype=np.float32))
        if hook == "pre_attn":
            def pre(mod: Any, args: tuple, kwargs: dict, vec: torch.Tensor = vec) -> Any:
                if args:
                    return (add(args[0], vec), *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": add(kwargs["hidden_states"], vec)}
            handles.append(layers[layer].register_forward_pre_hook(pre, with_kwargs=True))
        elif hook == "post_attn":
            handles.append(_post_attn_hook(model, layer, vec, add))
        elif hook == "post_block":
            def block(mod: Any, args: tuple, out: Any, vec: torch.Tensor = vec) -> Any:
                if isinstance(out, tuple):
                    return (add(out[0], vec), *out[1:])
                return add(out, vec)
            handles.append(layers[layer].register_forward_hook(block))
        else:
            raise ValueError(hook)
    return handles


def reference(
    model_dir: str | Path,
    prompt: Sequence[int],
    sites: Mapping[Site, np.ndarray] | None = None,
    phase: str = "all",
    max_tokens: int = 8,
    clamps: Sequence[Clamp] = (),
    clamp_first: bool = False,
) -> Generation:
    """``clamp_first``: the wrong order (clamps, then adds), to show the order matters."""
    model = _model(str(model_dir))
    mask_box: list[torch.Tensor] = []
    if clamps:
        handles = _point_hooks(model, sites or {}, clamps, mask_box, clamp_first)
        return _greedy(model, prompt, phase, max_tokens, mask_box, handles)

    def add(t: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        return t + mask_box[0][None, :, None] * vec

    handles = _steering_hooks(model, sites, add)
    return _greedy(model, prompt, phase, max_tokens, mask_box, handles)


def _point_hooks(
    model: Any, sites: Mapping[Site, np.ndarray], clamps: Sequence[Clamp],
    mask_box: list[torch.Tensor], clamp_first: bool = False,
) -> list[Any]:
    """Adds and clamps by point of the stream: at each point the adds (of both names
    where post_block l and pre_attn l+1 meet), then the clamps in the order given.
    The ``post_attn`` point is the stream after attention's residual add, per the
    layer's ``transformers`` code (as in :func:`_post_attn_hook`): the stream is
    ``residual + out`` with ``out`` attention's output (Llama family), its
    ``post_attention_layernorm`` (Gemma 2/3, OLMo 2), or ``out · residual_multiplier``
    (Granite, where the change is fed back divided by the multiplier)."""
    layers = model.model.layers
    normed = model.config.architectures[0] in _POST_ATTN_NORMED
    mult = float(getattr(model.config, "residual_multiplier", 1.0) or 1.0)
    adds: dict[Site, torch.Tensor] = {}
    for site, vec in sites.items():
        p = _point(site)
        t = torch.as_tensor(np.asarray(vec, dtype=np.float32))
        adds[p] = adds[p] + t if p in adds else t
    by_point: dict[Site, list[Clamp]] = {}
    for c in clamps:
        by_point.setdefault(_point(c.site), []).append(c)

    def steer(stream: torch.Tensor, p: Site) -> torch.Tensor:
        """The change at point ``p`` of a [1, T, H] stream, masked by phase."""
        mask = mask_box[0][None, :, None]
        h = stream
        if p in adds and not clamp_first:
            h = h + mask * adds[p]
        for c in by_point.get(p, ()):
            v = c.unit()
            comp = (h * v).sum(-1, keepdim=True)
            lo = -math.inf if c.lo is None else c.lo
            hi = math.inf if c.hi is None else c.hi
            h = h + mask * c.strength * (comp.clamp(lo, hi) - comp) * v
        if p in adds and clamp_first:
            h = h + mask * adds[p]
        return h - stream

    points = set(adds) | set(by_point)
    stash: dict[int, torch.Tensor] = {}
    handles = []
    for layer_no, layer in enumerate(layers):
        def pre(mod: Any, args: tuple, kwargs: dict, n: int = layer_no) -> Any:
            hidden = args[0] if args else kwargs["hidden_states"]
            if n == 0 and ("pre_attn", 0) in points:
                hidden = hidden + steer(hidden, ("pre_attn", 0))
            stash[n] = hidden
            if args:
                return (hidden, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": hidden}

        def attn(mod: Any, args: tuple, out: Any, n: int = layer_no) -> Any:
            p = ("post_attn", n)
            if p not in points:
                return out
            if normed:  # the hook is on post_attention_layernorm: out is a tensor
                return out + steer(stash[n] + out, p)
            return (out[0] + steer(stash[n] + out[0] * mult, p) / mult, *out[1:])

        def block(mod: Any, args: tuple, out: Any, n: int = layer_no) -> Any:
            p = ("post_block", n)
            if p not in points:
                return out
            if isinstance(out, tuple):
                return (out[0] + steer(out[0], p), *out[1:])
            return out + steer(out, p)

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        attn_out = layer.post_attention_layernorm if normed else layer.self_attn
        handles.append(attn_out.register_forward_hook(attn))
        handles.append(layer.register_forward_hook(block))
    return handles


def position_mask(phase: str, n_prompt: int, length: int) -> torch.Tensor:
    """1.0 at the positions a phase (or ``steering.tokens`` selection) steers."""
    from steergate.shared.positions import window

    pos = torch.arange(length)
    (p_lo, p_hi), (g_lo, g_hi) = window(phase).spans(n_prompt)
    prompt = (pos >= p_lo) & (pos < p_hi)
    gen = (pos >= g_lo) & (pos < (length if g_hi is None else g_hi))
    return (prompt | gen).to(torch.float32)


def _greedy(
    model: Any, prompt: Sequence[int], phase: str, max_tokens: int,
    mask_box: list[torch.Tensor], handles: list[Any],
) -> Generation:
    n_prompt = len(prompt)
    try:
        ids = list(prompt)
        logprobs: list[float] = []
        with torch.no_grad():
            for _ in range(max_tokens):
                mask_box[:] = [position_mask(phase, n_prompt, len(ids))]
                logits = model(torch.tensor([ids])).logits[0, -1].to(torch.float64)
                lp = torch.log_softmax(logits, dim=-1)
                tok = int(torch.argmax(logits))
                ids.append(tok)
                logprobs.append(float(lp[tok]))
        return Generation(ids[n_prompt:], logprobs)
    finally:
        for h in handles:
            h.remove()


def add_term(site: Site, vec: np.ndarray) -> dict[str, Any]:
    """One ``steering.vectors[]`` add term as JSON arrays."""
    return {"hook": site[0], "layers": {str(site[1]): [float(x) for x in vec]}}


def clamp_term(c: Clamp) -> dict[str, Any]:
    """The request term of a reference :class:`Clamp` (one-sided bounds left out)."""
    term: dict[str, Any] = {**add_term(c.site, c.direction), "op": "clamp", "strength": c.strength}
    if c.lo is not None:
        term["min"] = c.lo
    if c.hi is not None:
        term["max"] = c.hi
    return term


def steering_field(sites: Mapping[Site, np.ndarray], phase: str = "all") -> dict[str, Any]:
    """The public ``steering`` request field for these sites (packed float32 terms)."""
    by_hook: dict[str, list[tuple[int, np.ndarray]]] = {}
    for (hook, layer), vec in sorted(sites.items()):
        by_hook.setdefault(hook, []).append((layer, np.asarray(vec, dtype="<f4")))
    vectors = []
    for hook, rows in by_hook.items():
        matrix = np.stack([v for _, v in rows])
        vectors.append({"hook": hook, "packed": {
            "dtype": "float32", "shape": list(matrix.shape),
            "layer_indices": [layer for layer, _ in rows],
            "data": base64.b64encode(matrix.astype("<f4").tobytes()).decode(),
        }})
    return {"vectors": vectors, "phase": phase}


def completion_body(
    model: str, prompt: Sequence[int], max_tokens: int, **extra: Any
) -> dict[str, Any]:
    return {
        "model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0,
        "logprobs": 0, "ignore_eos": True, "return_tokens_as_token_ids": True, **extra,
    }


def parse_completion(doc: Mapping[str, Any]) -> Generation:
    lp = doc["choices"][0]["logprobs"]
    tokens = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
    return Generation(tokens, [float(x) for x in lp["token_logprobs"]])


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) if len(a) else 0.0


#: A float32 engine against the float32 ``transformers`` reference: greedy tokens equal,
#: every logprob within this.
TOL = 1e-3


def engine_completion(
    engine: Any,
    prompt: Sequence[int],
    max_tokens: int,
    steering: dict[str, Any] | None = None,
    **extra: Any,
) -> tuple[Generation, Any]:
    """A greedy completion from ``engine`` (``tests.harness.EngineProcess``) with
    logprobs: (what it generated, the HTTP response, for its headers)."""

    body = completion_body(str(engine.model), prompt, max_tokens, **extra)
    if steering is not None:
        body["steering"] = steering
    r = httpx.post(f"{engine.url}/v1/completions", json=body, headers=engine.headers, timeout=300)
    assert r.status_code == 200, r.text
    return parse_completion(r.json()), r


def iteration_buckets(engine: Any) -> dict[str, float]:
    text = httpx.get(f"{engine.url}/metrics", headers=engine.headers, timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^vllm:iteration_tokens_total_bucket\{[^}]*le="([^"]+)"[^}]*\} (\S+)$', text, re.M)}


def iteration_buckets_after(engine: Any, before: Mapping[str, float], steps: int,
                            timeout_s: float = 10.0) -> dict[str, float]:
    """:func:`iteration_buckets` once the histogram counts at least ``steps`` more engine
    steps than ``before`` (or ``timeout_s`` passed): vLLM hands the engine core's step
    statistics to the API server's ``/metrics`` asynchronously, so a read made as the
    answers arrive can miss the steps that produced them."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = iteration_buckets(engine)
        if now.get("+Inf", 0.0) - before.get("+Inf", 0.0) >= steps:
            return now
        if time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def send_together(engine: Any, bodies: list[dict]) -> list[Generation]:
    """Post every body at the same instant (one shared client, a barrier), so the
    engine admits them into the same running batch."""
    barrier = threading.Barrier(len(bodies))
    with httpx.Client(headers=engine.headers, timeout=300) as client:

        def post(body: dict) -> Generation:
            barrier.wait()
            r = client.post(f"{engine.url}/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return parse_completion(r.json())

        with ThreadPoolExecutor(len(bodies)) as pool:
            return list(pool.map(post, bodies))


def assert_matches(got: Generation, want: Generation, tol: float = TOL) -> None:
    assert got.tokens == want.tokens
    assert max_abs_diff(got.logprobs, want.logprobs) <= tol



# -- the checks every multi-rank engine passes (tensor parallel, Ray) ----------------------

MULTIRANK_MAX_TOKENS = 10
#: Sites on an early, a middle and the last layer, at all three hook points: a rank
#: that skipped any of them would leave the reference.
MULTIRANK_SITES = {
    ("pre_attn", 1): unit_vector(41),
    ("post_attn", 2): unit_vector(42, norm=4.0),
    ("post_block", 3): unit_vector(43, norm=3.0),
}


def _multirank_completion(
    engine: Any, steering: dict[str, Any] | None = None, **extra: Any
) -> tuple[Generation, Any]:
    return engine_completion(engine, PROMPT, MULTIRANK_MAX_TOKENS, steering, **extra)


def check_steered_request_matches_reference(engine: Any, model: Path) -> None:
    """Unsteered and steered greedy decoding both equal the float32 reference."""
    n = MULTIRANK_MAX_TOKENS
    unsteered, _ = _multirank_completion(engine)
    assert_matches(unsteered, reference(model, PROMPT, None, max_tokens=n))
    steered, r = _multirank_completion(engine, steering_field(MULTIRANK_SITES))
    assert r.json()["steering"] == {"applied": True, "latch": "none"}
    assert_matches(steered, reference(model, PROMPT, MULTIRANK_SITES, max_tokens=n))
    assert steered.tokens != unsteered.tokens


def check_latch_bridges_as_explicit_steering(
    engine: Any, model: Path, conversation_id: str
) -> None:
    """A latch set on one turn steers the next exactly as the explicit field does
    (tokens and logprobs identical, and equal to the reference); then it is deleted."""

    decode = steering_field(MULTIRANK_SITES, "decode")
    explicit, _ = _multirank_completion(engine, decode)
    latched, r = _multirank_completion(
        engine, {**decode, "latch": True}, conversation_id=conversation_id
    )
    assert r.headers["x-steering-latch"] == "latched"
    bridged, r = _multirank_completion(engine, conversation_id=conversation_id)
    assert r.headers["x-steering-latch"] == "bridged"
    assert r.json()["steering"] == {"applied": True, "latch": "bridged"}
    assert latched == explicit
    assert bridged == explicit  # identical tokens and logprobs
    want = reference(model, PROMPT, MULTIRANK_SITES, "decode", MULTIRANK_MAX_TOKENS)
    assert_matches(bridged, want)
    unsteered, _ = _multirank_completion(engine)
    assert bridged.tokens != unsteered.tokens
    r = httpx.delete(
        f"{engine.url}/v1/steering/latches/{conversation_id}", headers=engine.headers, timeout=30
    )
    assert r.status_code == 204


# -- activation capture: the residual stream at each site, after its steering -----------


#: The module whose input is the stream right after attention's residual add (the
#: first thing that reads it), per architecture; ``post_attention_layernorm`` for the
#: others (Llama family, MoE, Phi 3, Granite).
_POST_ATTN_READER = {
    "Gemma2ForCausalLM": "pre_feedforward_layernorm",
    "Gemma3ForCausalLM": "pre_feedforward_layernorm",
    "Olmo2ForCausalLM": "mlp",
}


def _first_input(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def reference_stream(
    model_dir: str | Path,
    ids: Sequence[int],
    sites: Mapping[Site, np.ndarray] | None,
    capture: Sequence[Site],
) -> dict[Site, np.ndarray]:
    """One float32 forward over ``ids`` with ``sites`` steered at every position (the
    same hooks as :func:`reference`); the stream ``[len(ids), hidden]`` at each
    ``capture`` site after all the steering of that point, read where the model's
    ``transformers`` code holds it:

    * ``pre_attn`` l: the (steered) input of layer l;
    * ``post_attn`` l: the input of the module that first reads the stream after
      attention's residual add (:data:`_POST_ATTN_READER`), so whatever the layer does
      to attention's output before the add (a norm, Granite's multiplier), and the
      ``post_attn`` steering, are in it;
    * ``post_block`` l: the same point as ``pre_attn`` l+1 (it includes the steering
      of both); the (steered) output of the last layer.

    Reading hooks are registered after the steering hooks, so they run after them."""
    model = _model(str(model_dir))
    layers = model.model.layers
    reader = _POST_ATTN_READER.get(model.config.architectures[0], "post_attention_layernorm")
    handles = _steering_hooks(model, sites, lambda t, vec: t + vec)
    seen: dict[Site, torch.Tensor] = {}

    def keep(site: Site, t: torch.Tensor) -> None:
        seen[site] = t.detach().clone()

    last = len(layers) - 1
    for layer in range(len(layers)):
        def pre(mod: Any, args: tuple, kwargs: dict, layer: int = layer) -> None:
            keep(("pre_attn", layer), _first_input(args, kwargs))
            if layer > 0:
                keep(("post_block", layer - 1), _first_input(args, kwargs))

        def attn(mod: Any, args: tuple, kwargs: dict, layer: int = layer) -> None:
            keep(("post_attn", layer), _first_input(args, kwargs))

        handles.append(layers[layer].register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(getattr(layers[layer], reader).register_forward_pre_hook(
            attn, with_kwargs=True))
    handles.append(layers[last].register_forward_hook(
        lambda mod, args, out: keep(("post_block", last),
                                    out[0] if isinstance(out, tuple) else out)))
    try:
        with torch.no_grad():
            model(torch.tensor([list(ids)]))
        return {s: seen[s][0].to(torch.float32).numpy() for s in capture}
    finally:
        for h in handles:
            h.remove()


def capture_field(sites: Sequence[Site], tokens: str = "all", reduce: str = "none") -> dict:
    by_hook: dict[str, list[int]] = {}
    for hook, layer in sites:
        by_hook.setdefault(hook, []).append(layer)
    return {"sites": [{"hook": h, "layers": ls} for h, ls in by_hook.items()],
            "tokens": tokens, "reduce": reduce}


def expected_capture(
    stream: np.ndarray, n_prompt: int, tokens: str, reduce: str
) -> np.ndarray:
    """Rows of a full-sequence stream (prompt + generated tokens fed back) as the
    capture answer holds them."""
    rows = {"prompt": stream[:n_prompt], "generated": stream[n_prompt:], "all": stream}[tokens]
    if reduce == "none" or len(rows) == 0:
        return rows
    if reduce == "last":
        return rows[-1:]
    return rows.astype(np.float64).mean(axis=0, keepdims=True).astype(np.float32)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want| (the stream's scale), 0 for two empty arrays."""
    assert got.shape == want.shape, (got.shape, want.shape)
    if want.size == 0:
        return 0.0
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def check_capture_matches_reference(engine: Any, model: Path) -> None:
    """A steered request's capture (every hook, tokens all, reduce none) equals the
    reference: on a multi-rank engine exactly one rank reported each row."""
    import httpx

    from steergate.shared.capture import decode_capture

    sites = [(h, layer) for h in ("pre_attn", "post_attn", "post_block") for layer in (0, 3)]
    body = completion_body(str(engine.model), PROMPT, 4,
                           steering=steering_field(MULTIRANK_SITES),
                           capture=capture_field(sites, "all", "none"))
    r = httpx.post(f"{engine.url}/v1/completions", json=body, headers=engine.headers,
                   timeout=300)
    assert r.status_code == 200, r.text
    generated = parse_completion(r.json()).tokens
    stream = reference_stream(model, PROMPT + generated[:-1], MULTIRANK_SITES, sites)
    got = decode_capture(r.json()["capture"])
    for site in sites:
        assert rel_err(got[(0, *site)], stream[site]) <= 1e-4, site
