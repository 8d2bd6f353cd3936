"""Prefix caching never shares KV blocks between differently steered requests.

A > 2-block prompt (CPU block size 128) is sent steered, then unsteered, then
steered differently, then steered like the first time. Each answer must equal the
same request computed without any cache (the float32 reference, which is what a
fresh engine gives), and the engine's own counters must show that the cache was
hit only by the repeat with identical steering — so the test would notice both a
leak (wrong answers) and salting that is too coarse (no reuse at all)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.engine.hf_reference import (
    Generation,
    completion_body,
    max_abs_diff,
    parse_completion,
    reference,
    steering_field,
)
from tests.harness import EngineProcess

pytestmark = pytest.mark.engine

BLOCK = 128
PROMPT = [int(x) for x in np.random.default_rng(99).integers(10, 600, 2 * BLOCK + 44)]
HIDDEN = 128


def _vec(seed: int, norm: float = 6.0) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=HIDDEN).astype(np.float32)
    return (v / np.linalg.norm(v) * norm).astype(np.float32)


def _hits(engine: EngineProcess) -> float:
    text = httpx.get(f"{engine.url}/metrics", headers=engine.headers, timeout=30).text
    m = re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M)
    assert m, "vLLM no longer exports vllm:prefix_cache_hits_total"
    return float(m.group(1))


def _complete(engine: EngineProcess, sites) -> tuple[Generation, float]:
    body = completion_body(str(engine.model), PROMPT, 8)
    if sites:
        body["steering"] = steering_field(sites)
    before = _hits(engine)
    r = httpx.post(f"{engine.url}/v1/completions", json=body, headers=engine.headers, timeout=300)
    assert r.status_code == 200, r.text
    return parse_completion(r.json()), _hits(engine) - before


def test_differently_steered_requests_do_not_share_prefix_cache(
    f32_engine: EngineProcess, tiny_model: Path
) -> None:
    a = {("pre_attn", 0): _vec(1)}  # changes every layer's KV for the whole prompt
    b = {("post_attn", 1): _vec(2)}
    sequence = [("steered A", a), ("unsteered", None), ("steered B", b), ("steered A again", a)]
    answers = {}
    for label, sites in sequence:
        got, hits = _complete(f32_engine, sites)
        want = reference(tiny_model, PROMPT, sites, max_tokens=8)
        assert got.tokens == want.tokens, label
        assert max_abs_diff(got.logprobs, want.logprobs) <= 1e-3, label
        answers[label] = (got, hits)
    assert answers["unsteered"][1] == 0  # no reuse of A's blocks
    assert answers["steered B"][1] == 0  # no reuse of A's or the unsteered blocks
    assert answers["steered A again"][1] >= 2 * BLOCK  # identical steering does reuse
    assert answers["steered A"][0].tokens != answers["unsteered"][0].tokens
    assert answers["steered B"][0].tokens != answers["unsteered"][0].tokens
