"""Beam search on the real engine: vLLM's beam search would drop the steering (fresh
SamplingParams each step) while keeping the steered cache salt, so a steered or
bridged beam-search turn is a 400 naming ``use_beam_search``, nothing reaches vLLM's
cache under the steered salt, and the requests after it are clean. Unsteered beam
search still works."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.engine.hf_reference import (
    completion_body,
    max_abs_diff,
    parse_completion,
    reference,
    steering_field,
)
from tests.engine.test_prefix_cache import BLOCK, _hits, _vec
from tests.harness import EngineProcess

pytestmark = pytest.mark.engine

PROMPT = [int(x) for x in np.random.default_rng(31).integers(10, 600, 2 * BLOCK + 10)]


def _post(engine: EngineProcess, body: dict) -> httpx.Response:
    return httpx.post(f"{engine.url}/v1/completions", json=body, headers=engine.headers,
                      timeout=300)


@pytest.mark.parametrize("phase", ["all", "decode"])
def test_steered_beam_search_is_refused_and_later_requests_are_exact(
    f32_engine: EngineProcess, tiny_model: Path, phase: str
) -> None:
    sites = {("post_block", 2): _vec(40 + len(phase))}
    model = str(f32_engine.model)
    beam = {"use_beam_search": True, "n": 2}
    cid = f"beam-{phase}"

    r = _post(f32_engine, {**completion_body(model, PROMPT, 4, **beam),
                           "steering": {**steering_field(sites, phase), "latch": True},
                           "conversation_id": cid})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"
    assert r.headers["x-steering-latch"] == "none"  # and no latch was stored:
    r = _post(f32_engine, {**completion_body(model, PROMPT[:5], 2), "conversation_id": cid})
    assert r.status_code == 200 and r.headers["x-steering-latch"] == "none"

    latch = {**steering_field(sites, phase), "latch": True}
    r = _post(f32_engine, {**completion_body(model, PROMPT[:5], 2), "steering": latch,
                           "conversation_id": cid})
    assert r.headers["x-steering-latch"] == "latched"
    r = _post(f32_engine, {**completion_body(model, PROMPT, 4, **beam), "conversation_id": cid})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"

    # Nothing was computed (let alone cached) under the steered salt: the same steered
    # request now misses the cache and equals the float32 reference.
    before = _hits(f32_engine)
    r = _post(f32_engine, {**completion_body(model, PROMPT, 8),
                           "steering": steering_field(sites, phase)})
    assert r.status_code == 200, r.text
    got, want = parse_completion(r.json()), reference(tiny_model, PROMPT, sites, phase, 8)
    assert got.tokens == want.tokens and max_abs_diff(got.logprobs, want.logprobs) <= 1e-3
    assert _hits(f32_engine) == before

    r = _post(f32_engine, completion_body(model, PROMPT, 8))  # unsteered after it: clean
    plain, want = parse_completion(r.json()), reference(tiny_model, PROMPT, None, max_tokens=8)
    assert plain.tokens == want.tokens and max_abs_diff(plain.logprobs, want.logprobs) <= 1e-3


def test_unsteered_beam_search_still_runs(f32_engine: EngineProcess) -> None:
    body = completion_body(str(f32_engine.model), PROMPT[:20], 3, use_beam_search=True, n=2)
    body.pop("logprobs")
    r = _post(f32_engine, {**body, "steering": {"vectors": []}})  # opted out of steering
    assert r.status_code == 200, r.text
    assert r.json()["steering"] == {"applied": False, "latch": "none"}
    assert len(r.json()["choices"]) == 2
