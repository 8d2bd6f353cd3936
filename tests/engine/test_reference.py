"""Steered greedy decoding on the real vLLM CPU engine (default compile mode, over
HTTP through the public ``steering`` field) equals a float32 ``transformers``
reference with the vectors added by forward hooks at the same points."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.hf_reference import (
    PROMPT,
    Generation,
    assert_matches,
    completion_body,
    engine_completion,
    iteration_buckets,
    iteration_buckets_after,
    max_abs_diff,
    reference,
    send_together,
    steering_field,
    unit_vector,
)
from tests.harness import EngineProcess

pytestmark = pytest.mark.engine

def _complete(engine: EngineProcess, sites=None, phase: str = "all", max_tokens: int = 10,
              prompt: list[int] = PROMPT) -> Generation:
    steering = steering_field(sites, phase) if sites else None
    return engine_completion(engine, prompt, max_tokens, steering)[0]


@pytest.fixture(scope="module")
def unsteered(f32_engine: EngineProcess, tiny_model: Path) -> Generation:
    got = _complete(f32_engine)
    assert_matches(got, reference(tiny_model, PROMPT, None, max_tokens=10))
    return got


def test_unsteered_request_matches_reference(unsteered: Generation, tiny_model: Path) -> None:
    want = reference(tiny_model, PROMPT, None, max_tokens=10)
    assert unsteered.tokens == want.tokens
    assert max_abs_diff(unsteered.logprobs, want.logprobs) <= 1e-4


@pytest.mark.parametrize("phase", ["all", "prefill", "decode"])
@pytest.mark.parametrize("hook", ["pre_attn", "post_attn", "post_block"])
def test_steered_request_matches_reference(
    f32_engine: EngineProcess, tiny_model: Path, unsteered: Generation, hook: str, phase: str
) -> None:
    sites = {(hook, 1): unit_vector(11), (hook, 3): unit_vector(12, norm=3.0)}
    got = _complete(f32_engine, sites, phase)
    want = reference(tiny_model, PROMPT, sites, phase, max_tokens=10)
    assert_matches(got, want)
    assert got.tokens != unsteered.tokens  # the steering is strong enough to show
    if phase == "decode":  # the first token comes from the (unsteered) prompt
        assert got.tokens[0] == unsteered.tokens[0]


def test_layer0_pre_attn_steers_the_embeddings(
    f32_engine: EngineProcess, tiny_model: Path, unsteered: Generation
) -> None:
    sites = {("pre_attn", 0): unit_vector(21)}
    got = _complete(f32_engine, sites)
    assert_matches(got, reference(tiny_model, PROMPT, sites, max_tokens=10))
    assert got.tokens != unsteered.tokens


def test_three_differently_steered_requests_in_one_batch_each_match_their_reference(
    f32_engine: EngineProcess, tiny_model: Path
) -> None:
    a = {("post_block", 2): unit_vector(31), ("pre_attn", 1): unit_vector(32, norm=2.0)}
    b = {("post_attn", 0): unit_vector(33)}
    cases = [(None, "all"), (a, "all"), (b, "decode")]
    n = 48
    alone = [_complete(f32_engine, s, p, n) for s, p in cases]
    bodies = []
    for sites, phase in cases:
        body = completion_body(str(f32_engine.model), PROMPT, n)
        if sites:
            body["steering"] = steering_field(sites, phase)
        bodies.append(body)
    # Prompts are 14 tokens, so an engine step with 2..8 tokens is several requests
    # decoding together. Scheduling is the engine's, so a run in which the three did
    # not overlap enough is sent again (at most 3 times) before judging.
    for _attempt in range(3):
        before = iteration_buckets(f32_engine)
        batched = send_together(f32_engine, bodies)
        after = iteration_buckets_after(f32_engine, before, n)
        shared_steps = (after["8.0"] - after["1.0"]) - (before["8.0"] - before["1.0"])
        if shared_steps >= n // 2:
            break
    assert shared_steps >= n // 2, "the three requests never shared a batch"
    for (sites, phase), got, solo in zip(cases, batched, alone, strict=True):
        assert_matches(got, reference(tiny_model, PROMPT, sites, phase, max_tokens=n))
        assert got.tokens == solo.tokens  # batching does not change any answer
    unsteered, steered_a, steered_b = batched
    assert steered_a.tokens != unsteered.tokens and steered_b.tokens != unsteered.tokens
    assert unsteered.logprobs == alone[0].logprobs  # exactly plain vLLM's answer
