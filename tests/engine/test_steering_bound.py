"""One request's steering never reaches another request's answer through the KV cache.

Found from outside: scale 3e38 on a vector of ones at ``pre_attn`` and ``post_attn`` of
every layer was within float32 at each point of the stream, so it was accepted. The
stream summed to inf, the request's NaN hidden states were written to KV-cache blocks,
and the requests given those blocks next (other tenants' among them) answered empty or
garbled, unsteered. Each point now takes at most 1e6 per element
(``shared.steering.SteeringBound``): the attack is a 400, and steering at that bound at
every point of the real engine leaves every later unsteered answer exactly as before."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.engine.hf_reference import HIDDEN, completion_body, parse_completion
from tests.harness import EngineProcess

pytestmark = pytest.mark.engine

LAYERS = 4  # the tiny model's
PROMPTS = [[int(x) for x in np.random.default_rng(seed).integers(10, 600, 40)]
           for seed in range(4)]  # fmt: skip


def _post(engine: EngineProcess, body: dict) -> httpx.Response:
    return httpx.post(f"{engine.url}/v1/completions", json=body, headers=engine.headers,
                      timeout=300)  # fmt: skip


def _everywhere(scale: float) -> dict:
    layers = {str(i): [1.0] * HIDDEN for i in range(LAYERS)}
    return {"vectors": [{"hook": hook, "layers": layers, "scale": scale}
                        for hook in ("pre_attn", "post_attn")]}  # fmt: skip


def _unsteered(engine: EngineProcess) -> list[list[int]]:
    answers = []
    for prompt in PROMPTS:
        r = _post(engine, completion_body(str(engine.model), prompt, 12))
        assert r.status_code == 200, r.text
        answers.append(parse_completion(r.json()).tokens)
    return answers


def test_steering_at_the_bound_everywhere_leaves_later_unsteered_answers_unchanged(
    f32_engine: EngineProcess,
) -> None:
    before = _unsteered(f32_engine)
    attack = completion_body(str(f32_engine.model), PROMPTS[0], 40, steering=_everywhere(3e38))
    r = _post(f32_engine, attack)
    assert r.status_code == 400, r.text
    assert "takes at most 1e+06 per point" in r.json()["error"]["message"]
    # The bound itself, at every point, with long answers: served, and finite.
    for prompt in PROMPTS:
        body = completion_body(str(f32_engine.model), prompt, 40, steering=_everywhere(1e6))
        r = _post(f32_engine, body)
        assert r.status_code == 200, r.text
        logprobs = r.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert len(logprobs) == 40 and all(np.isfinite(x) for x in logprobs), logprobs
    assert _unsteered(f32_engine) == before
