"""Clamps, ablations and token positions under chunked prefill and preemption, on an
engine of its own (issue 20's proof): a 32-token step budget splits each 250-token
prompt into eight chunks, and a KV cache of four usable 128-token blocks holds two
such requests at once, so a batch of six preempts (a running request is evicted when
the decodes cross into a third block, and recomputed later from its prompt and the
tokens it had generated). Adds, clamps, ablations, ``steering.tokens`` selections and
an unsteered request, sent at the same instant: each equals the float32
``transformers`` reference (greedy tokens identical, |Δlogprob| ≤ 1e-3).

Preemption depends on the scheduler's timing (and vLLM's metric on when it is logged),
so, as in test_capture_chunked.py, it is reported, not required; chunked prefill is
certain. The token selections cross chunk boundaries (the last 40 prompt tokens) and
the recomputation of a preempted request (generated tokens 0–19 of 40)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from steergate.shared.positions import parse_tokens
from tests.engine.hf_reference import (
    Clamp,
    Generation,
    add_term,
    assert_matches,
    clamp_term,
    completion_body,
    max_abs_diff,
    reference,
    send_together,
    unit_vector,
)
from tests.harness import EngineProcess

pytestmark = pytest.mark.engine

N = 40  # generated tokens: a 250-token prompt crosses into a third block at token 7
PROMPT_LEN = 250
Site = tuple[str, int]


@pytest.fixture(scope="module")
def small_engine(tiny_model: Path) -> Iterator[EngineProcess]:
    proc = EngineProcess(
        tiny_model,
        extra_args=[
            "--dtype",
            "float32",
            "--max-num-batched-tokens",
            "32",
            "--max-num-seqs",
            "4",
            "--max-model-len",
            "384",
            "--num-gpu-blocks-override",
            "5",
        ],
    ).start(timeout=900)
    yield proc
    proc.stop()


def _preemptions(engine: EngineProcess) -> float:
    text = httpx.get(f"{engine.url}/metrics", headers=engine.headers, timeout=30).text
    m = re.search(r"^vllm:num_preemptions_total\{[^}]*\} (\S+)$", text, re.M)
    assert m, "vLLM no longer exports vllm:num_preemptions_total"
    return float(m.group(1))


# (adds, clamps, steering.tokens or None for all positions)
Case = tuple[dict[Site, np.ndarray], list[Clamp], dict[str, Any] | None]
CASES: list[Case] = [
    ({}, [], None),  # unsteered
    ({("post_block", 2): unit_vector(31)}, [], None),  # an add
    (
        {("post_attn", 0): unit_vector(33)},  # clamps after an add; one point, in order
        [
            Clamp(("pre_attn", 1), unit_vector(34), None, 1.0),
            Clamp(("post_block", 0), unit_vector(35), 3.0, None, 0.75),
        ],
        None,
    ),
    (
        {},
        [
            Clamp(("pre_attn", 0), unit_vector(36), 0.0, 0.0),  # ablations
            Clamp(("post_attn", 3), unit_vector(37), 0.0, 0.0),
        ],
        None,
    ),
    (
        {("post_block", 1): unit_vector(38)},  # last 40 prompt tokens: across chunks
        [Clamp(("post_attn", 2), unit_vector(39), 2.0, None)],
        {"prompt": {"last": 40}, "generated": {"from": 5}},
    ),
    (
        {("pre_attn", 2): unit_vector(40)},  # generated 0-19: across the recomputation
        [Clamp(("post_block", 3), unit_vector(41), 0.0, 0.0)],
        {"prompt": "none", "generated": {"first": 20}},
    ),
]


def _body(engine: EngineProcess, prompt: list[int], case: Case) -> dict[str, Any]:
    adds, clamps, tokens = case
    body = completion_body(str(engine.model), prompt, N)
    terms = [add_term(s, v) for s, v in adds.items()] + [clamp_term(c) for c in clamps]
    if terms:
        body["steering"] = {"vectors": terms}
        if tokens is not None:
            body["steering"]["tokens"] = tokens
    return body


def _want(model: Path, prompt: list[int], case: Case) -> Generation:
    adds, clamps, tokens = case
    phase = "all" if tokens is None else parse_tokens(tokens, "steering.tokens")
    return reference(model, prompt, adds, phase, max_tokens=N, clamps=clamps)


def _running(engine: EngineProcess) -> float:
    text = httpx.get(f"{engine.url}/metrics", headers=engine.headers, timeout=30).text
    m = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M)
    assert m, "vLLM no longer exports vllm:num_requests_running"
    return float(m.group(1))


def _send_watching(engine: EngineProcess, bodies: list[dict]) -> tuple[list[Generation], float]:
    """Send the bodies at the same instant; the answers, and the most requests vLLM
    reported running in one step while they ran (its gauge, sampled)."""
    seen = [0.0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen[0] = max(seen[0], _running(engine))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        answers = send_together(engine, bodies)
    finally:
        done.set()
        watcher.join()
    return answers, seen[0]


def test_mixed_batch_under_chunked_prefill_and_preemption_equals_reference(
    small_engine: EngineProcess, tiny_model: Path
) -> None:
    before = _preemptions(small_engine)
    checked: list[tuple[list[int], Case, Generation]] = []
    most_running = 0.0
    # Whether the batch preempts depends on timing: batches are sent until the engine
    # reports a preemption (at most 3; every answer of every batch is checked).
    for attempt in range(3):
        rng = np.random.default_rng(500 + attempt)
        prompts = [[int(x) for x in rng.integers(10, 600, PROMPT_LEN)] for _ in CASES]
        bodies = [_body(small_engine, p, c) for p, c in zip(prompts, CASES, strict=True)]
        answers, running = _send_watching(small_engine, bodies)
        most_running = max(most_running, running)
        checked += list(zip(prompts, CASES, answers, strict=True))
        if _preemptions(small_engine) > before:
            break
    preempted = _preemptions(small_engine) - before
    print(
        f"batches: {attempt + 1}; preemptions: {preempted:.0f}; "
        f"most requests running in one step (sampled): {most_running:.0f}"
    )
    # One request alone never preempts (it needs 3 of the 4 blocks): a preemption means
    # two held blocks in the same steps; so does the running gauge at 2 or more.
    assert preempted > 0 or most_running >= 2, "the requests never ran together"
    worst = 0.0
    for k, (prompt, case, got) in enumerate(checked):
        want = _want(tiny_model, prompt, case)
        assert_matches(got, want)
        worst = max(worst, max_abs_diff(got.logprobs, want.logprobs))
        if k < len(CASES) and (case[0] or case[1]):  # the first batch: the test's power
            _assert_each_part_shows(tiny_model, prompt, case, want)
    print(f"max |Δlogprob| against the reference: {worst:.1e}")


def _assert_each_part_shows(model: Path, prompt: list[int], case: Case, want: Generation) -> None:
    """The steering changes the answer, so does each clamp on its own, and a token
    selection steers otherwise than all positions: an engine that dropped any of them
    would leave the reference."""

    def differs(other: Generation) -> bool:
        return other.tokens != want.tokens or max_abs_diff(other.logprobs, want.logprobs) > 1e-2

    adds, clamps, tokens = case
    assert differs(reference(model, prompt, None, max_tokens=N)), case
    for i in range(len(clamps)):
        assert differs(_want(model, prompt, (adds, clamps[:i] + clamps[i + 1 :], tokens))), i
    if tokens is not None:
        assert differs(_want(model, prompt, (adds, clamps, None))), tokens
