"""Prefix caching never shares KV blocks between differently steered requests, nor
between a steered turn and its continuation where the two would steer a position
differently.

A > 2-block prompt (CPU block size 128) is sent steered, then unsteered, then
steered differently, then steered like the first time. Each answer must equal the
same request computed without any cache (the float32 reference, which is what a
fresh engine gives), and the engine's own counters must show that the cache was
hit only by the repeat with identical steering — so the test would notice both a
leak (wrong answers) and salting that is too coarse (no reuse at all).

Continuations: a latched turn whose answer fills the prompt's second block, then a
bridged turn whose prompt is that prompt + answer + more, for each phase. With
``all`` the bridged turn reuses both blocks (the second holds generated tokens, now
prompt); with ``prefill``/``decode`` those positions are steered differently as
prompt than as generated tokens, so it must reuse nothing (the salt covers the
prompt), yet an identical repeat of it still does."""

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


def _complete(engine: EngineProcess, sites, prompt: list[int] = PROMPT, max_tokens: int = 8,
              phase: str = "all", latch: bool = False, **extra) -> tuple[Generation, float, str]:
    """(answer, prefix-cache hits it caused, latch header)."""
    body = completion_body(str(engine.model), prompt, max_tokens, **extra)
    if sites:
        body["steering"] = {**steering_field(sites, phase), "latch": latch}
    before = _hits(engine)
    r = httpx.post(f"{engine.url}/v1/completions", json=body, headers=engine.headers, timeout=300)
    assert r.status_code == 200, r.text
    return parse_completion(r.json()), _hits(engine) - before, r.headers["x-steering-latch"]


def test_differently_steered_requests_do_not_share_prefix_cache(
    f32_engine: EngineProcess, tiny_model: Path
) -> None:
    a = {("pre_attn", 0): _vec(1)}  # changes every layer's KV for the whole prompt
    b = {("post_attn", 1): _vec(2)}
    sequence = [("steered A", a), ("unsteered", None), ("steered B", b), ("steered A again", a)]
    answers = {}
    for label, sites in sequence:
        got, hits, _ = _complete(f32_engine, sites)
        want = reference(tiny_model, PROMPT, sites, max_tokens=8)
        assert got.tokens == want.tokens, label
        assert max_abs_diff(got.logprobs, want.logprobs) <= 1e-3, label
        answers[label] = (got, hits)
    assert answers["unsteered"][1] == 0  # no reuse of A's blocks
    assert answers["steered B"][1] == 0  # no reuse of A's or the unsteered blocks
    assert answers["steered A again"][1] >= 2 * BLOCK  # identical steering does reuse
    assert answers["steered A"][0].tokens != answers["unsteered"][0].tokens
    assert answers["steered B"][0].tokens != answers["unsteered"][0].tokens


# A 250-token prompt: a 10-token answer fills block 1 (positions 128..255) with 6
# generated tokens, so the continuation's block 1 hashes like turn 1's.
TURN1 = [int(x) for x in np.random.default_rng(5).integers(10, 600, 2 * BLOCK - 6)]
MORE = [int(x) for x in np.random.default_rng(6).integers(10, 600, 20)]


def _assert_reference(got: Generation, want: Generation, label: str) -> None:
    assert got.tokens == want.tokens, label
    assert max_abs_diff(got.logprobs, want.logprobs) <= 1e-3, label


@pytest.mark.parametrize("phase", ["all", "prefill", "decode"])
def test_continuation_after_a_steered_turn_equals_the_reference(
    f32_engine: EngineProcess, tiny_model: Path, phase: str
) -> None:
    sites = {("post_block", 1): _vec(3), ("pre_attn", 2): _vec(4, norm=4.0)}
    cid = f"continuation-{phase}"
    first, _, state = _complete(f32_engine, sites, TURN1, 10, phase, latch=True,
                                conversation_id=cid)
    assert state == "latched"
    _assert_reference(first, reference(tiny_model, TURN1, sites, phase, 10), "turn 1")

    turn2 = TURN1 + first.tokens + MORE
    want = reference(tiny_model, turn2, sites, phase, 8)
    got, hits, state = _complete(f32_engine, None, turn2, 8, conversation_id=cid)
    assert state == "bridged"
    _assert_reference(got, want, "bridged continuation")
    if phase == "all":
        assert hits >= 2 * BLOCK  # block 1 holds turn 1's generated tokens: reused, exact
    else:
        assert hits == 0  # those positions were steered as generated, now they are prompt

    again, hits, _ = _complete(f32_engine, None, turn2, 8, conversation_id=cid)
    _assert_reference(again, want, "repeat")
    assert hits >= 2 * BLOCK  # the same prompt still shares

    plain, _, _ = _complete(f32_engine, None, turn2, 8)  # unsteered after it: clean
    _assert_reference(plain, reference(tiny_model, turn2, None, max_tokens=8), "unsteered")
    assert plain.tokens != got.tokens
