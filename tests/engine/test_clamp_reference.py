"""Directional clamps and ablation on the real vLLM CPU engine (float32, default
compile mode, over HTTP through the public ``steering`` field) equal a float32
``transformers`` reference that applies the definition by forward hooks:
``h' = h + s·(clip(h·v̂, min, max) − h·v̂)·v̂`` after the site's adds, clamps in the
order given, post_block l and pre_attn l+1 one point (docs/steering-op.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from steergate.shared.capture import decode_capture
from tests.engine.hf_reference import (
    PROMPT,
    Clamp,
    Generation,
    add_term,
    assert_matches,
    capture_field,
    clamp_term,
    completion_body,
    iteration_buckets,
    iteration_buckets_after,
    max_abs_diff,
    parse_completion,
    reference,
    send_together,
    unit_vector,
)
from tests.harness import EngineProcess

pytestmark = pytest.mark.engine

N = 10
Site = tuple[str, int]


def _body(engine: EngineProcess, adds: dict[Site, np.ndarray], clamps: list[Clamp],
          prompt: list[int] = PROMPT, n_tokens: int = N, **extra: Any) -> dict[str, Any]:
    body = completion_body(str(engine.model), prompt, n_tokens, **extra)
    terms = [add_term(s, v) for s, v in adds.items()] + [clamp_term(c) for c in clamps]
    if terms:
        body["steering"] = {"vectors": terms}
    return body


def _post(engine: EngineProcess, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(f"{engine.url}/v1/completions", json=body, headers=engine.headers,
                   timeout=300)
    assert r.status_code == 200, r.text
    return r


def _run(engine: EngineProcess, adds, clamps, prompt: list[int] = PROMPT,
         n: int = N) -> Generation:
    return parse_completion(_post(engine, _body(engine, adds, clamps, prompt, n_tokens=n)).json())


def _case(hook: str) -> tuple[dict[Site, np.ndarray], list[Clamp]]:
    """An add and a lifting clamp at layer 1, an ablation at 2, a one-sided half-strength
    clamp at 3: every kind of clamp at this hook, after an add at the same site."""
    adds = {(hook, 1): unit_vector(41, norm=3.0)}
    clamps = [
        Clamp((hook, 1), unit_vector(42), lo=2.0, hi=4.0),
        Clamp((hook, 2), unit_vector(43), 0.0, 0.0),  # ablate
        Clamp((hook, 3), unit_vector(44), None, -3.0, strength=0.5),
    ]
    return adds, clamps


@pytest.mark.parametrize("hook", ["pre_attn", "post_attn", "post_block"])
def test_clamps_and_ablation_match_the_reference_at_each_hook(
    f32_engine: EngineProcess, tiny_model: Path, hook: str
) -> None:
    adds, clamps = _case(hook)
    got = _run(f32_engine, adds, clamps)
    assert_matches(got, reference(tiny_model, PROMPT, adds, max_tokens=N, clamps=clamps))
    add_only = reference(tiny_model, PROMPT, adds, max_tokens=N)
    assert got.tokens != add_only.tokens  # the clamps are strong enough to show


def test_mixed_batch_of_adds_clamps_ablations_and_unsteered_requests(
    f32_engine: EngineProcess, tiny_model: Path
) -> None:
    n = 32
    cases: list[tuple[dict, list[Clamp]]] = [
        ({}, []),
        ({("post_block", 2): unit_vector(31)}, []),
        ({("post_attn", 0): unit_vector(33)},
         [Clamp(("pre_attn", 1), unit_vector(34), None, 1.0),
          Clamp(("post_block", 0), unit_vector(35), 3.0, None, 0.75)]),  # one point, in order
        ({}, [Clamp(("pre_attn", 0), unit_vector(36), 0.0, 0.0),
              Clamp(("post_attn", 3), unit_vector(37), 0.0, 0.0)]),
    ]
    alone = [_run(f32_engine, a, c, n=n) for a, c in cases]
    bodies = [_body(f32_engine, a, c, n_tokens=n) for a, c in cases]
    # Up to 6 tries: on a loaded machine (CI beside other work) the four requests may
    # reach the scheduler steps apart, and this test is about a batch they share.
    for _attempt in range(6):
        before = iteration_buckets(f32_engine)
        batched = send_together(f32_engine, bodies)
        after = iteration_buckets_after(f32_engine, before, n)
        shared_steps = (after["8.0"] - after["1.0"]) - (before["8.0"] - before["1.0"])
        if shared_steps >= n // 2:
            break
    assert shared_steps >= n // 2, "the requests never shared a batch"
    for (adds, clamps), got, solo in zip(cases, batched, alone, strict=True):
        assert_matches(got, reference(tiny_model, PROMPT, adds, max_tokens=n, clamps=clamps))
        assert got.tokens == solo.tokens
    assert batched[0].logprobs == alone[0].logprobs  # unsteered: plain vLLM's answer
    assert len({tuple(g.tokens) for g in batched}) == 4


def test_clamp_applies_after_the_add_and_strength_interpolates(
    f32_engine: EngineProcess, tiny_model: Path
) -> None:
    site = ("post_block", 1)
    v = unit_vector(61)
    adds = {site: v * 2.0}  # pushes the component up by 12
    clamp = Clamp(site, v, None, 1.0)
    got = _run(f32_engine, adds, [clamp])
    assert_matches(got, reference(tiny_model, PROMPT, adds, max_tokens=N, clamps=[clamp]))
    # Clamping first and adding after (the wrong order) gives another answer.
    wrong = reference(tiny_model, PROMPT, adds, max_tokens=N, clamps=[clamp], clamp_first=True)
    assert got.tokens != wrong.tokens or max_abs_diff(got.logprobs, wrong.logprobs) > 1e-2
    # strength 0 is no clamp at all (the very same bits as the add alone); 0.5 halfway.
    add_only = _run(f32_engine, adds, [])
    zero = _run(f32_engine, adds, [Clamp(site, v, None, 1.0, strength=0.0)])
    assert zero.tokens == add_only.tokens and zero.logprobs == add_only.logprobs
    half = Clamp(site, v, None, 1.0, strength=0.5)
    got_half = _run(f32_engine, adds, [half])
    assert_matches(got_half, reference(tiny_model, PROMPT, adds, max_tokens=N, clamps=[half]))
    assert got_half != got and got_half != add_only


@pytest.mark.parametrize("site", [("pre_attn", 0), ("post_attn", 2), ("post_block", 1)])
def test_ablation_leaves_the_component_zero_at_the_site(
    f32_engine: EngineProcess, site: Site
) -> None:
    """Read with capture (the stream at the site after its steering): the component
    along the ablated direction is 0 up to float32 rounding of the stream's size, for
    every prompt and generated token, even after an add along that very direction."""
    v = unit_vector(71, norm=1.0)
    adds = {site: v * 5.0}
    sites = [site] + ([("pre_attn", site[1] + 1)] if site[0] == "post_block" else [])
    cap = capture_field(sites, "all", "none")
    plain_body = _body(f32_engine, adds, [], n_tokens=4, capture=cap)
    plain = _post(f32_engine, plain_body).json()["capture"]
    body = _body(f32_engine, adds, [Clamp(site, v, 0.0, 0.0)], n_tokens=4, capture=cap)
    ablated = _post(f32_engine, body).json()["capture"]
    for key, rows in decode_capture(ablated).items():
        before = decode_capture(plain)[key] @ v
        comp = rows @ v
        scale = np.linalg.norm(rows, axis=1)
        assert np.abs(before).max() > 1.0, key  # there was something to remove
        assert np.all(np.abs(comp) <= 1e-5 * np.maximum(scale, 1.0)), (key, comp)


def test_clamp_requests_do_not_share_prefix_cache_with_unsteered_ones(
    f32_engine: EngineProcess, tiny_model: Path
) -> None:
    """A > 2-block prompt sent unsteered, then ablated, then clamped: each answer equals
    the uncached reference (the payload digest, and so the cache salt, covers clamps)."""
    prompt = [int(x) for x in np.random.default_rng(98).integers(10, 600, 300)]
    plain = _run(f32_engine, {}, [], prompt, n=6)
    assert_matches(plain, reference(tiny_model, prompt, None, max_tokens=6))
    for clamps in ([Clamp(("pre_attn", 0), unit_vector(81), 0.0, 0.0)],
                   [Clamp(("pre_attn", 0), unit_vector(81), 2.0, None)]):
        got = _run(f32_engine, {}, clamps, prompt, n=6)
        assert_matches(got, reference(tiny_model, prompt, None, max_tokens=6, clamps=clamps))


def test_engine_answers_bad_clamps_with_400s_naming_the_field(
    f32_engine: EngineProcess,
) -> None:
    v = unit_vector(91)
    bad = [
        ({**add_term(("post_block", 1), v), "op": "clamp", "min": 2, "max": 1},
         "steering.vectors[0].min"),
        ({**add_term(("post_block", 1), v), "op": "clamp"}, "steering.vectors[0].min"),
        ({**add_term(("post_block", 1), v * 0), "op": "ablate"}, "steering.vectors[0].layers.1"),
    ]
    for term, param in bad:
        body = completion_body(str(f32_engine.model), PROMPT, 2, steering={"vectors": [term]})
        r = httpx.post(f"{f32_engine.url}/v1/completions", json=body,
                       headers=f32_engine.headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    five = [{**add_term(("post_block", 1), unit_vector(i)), "op": "ablate"} for i in range(3)]
    five += [{**add_term(("pre_attn", 2), unit_vector(i + 10)), "op": "ablate"} for i in range(2)]
    body = completion_body(str(f32_engine.model), PROMPT, 2, steering={"vectors": five})
    r = httpx.post(f"{f32_engine.url}/v1/completions", json=body, headers=f32_engine.headers,
                   timeout=60)
    assert r.status_code == 400 and "4 clamp directions" in r.text, r.text
    # four at one point are served
    body["steering"]["vectors"] = five[:4]
    assert httpx.post(f"{f32_engine.url}/v1/completions", json=body,
                      headers=f32_engine.headers, timeout=60).status_code == 200


@pytest.mark.parametrize(
    "tokens",
    [
        {"prompt": {"last": 3}, "generated": "none"},
        {"prompt": "none", "generated": {"first": 2}},
        {"prompt": {"last": 1}, "generated": {"from": 3}},
    ],
)
def test_token_positions_match_the_reference(
    f32_engine: EngineProcess, tiny_model: Path, tokens: dict[str, Any]
) -> None:
    """``steering.tokens`` with an add and a clamp, also on a > 2-block prompt sent
    after the same prompt unsteered (a prefix-cache candidate)."""
    from steergate.shared.positions import parse_tokens

    phase = parse_tokens(tokens, "steering.tokens")
    adds = {("post_block", 1): unit_vector(101)}
    clamps = [Clamp(("post_attn", 2), unit_vector(102), 2.0, None)]
    long_prompt = [int(x) for x in np.random.default_rng(97).integers(10, 600, 300)]
    _run(f32_engine, {}, [], long_prompt, n=2)
    answers = []
    for prompt in (PROMPT, long_prompt):
        body = _body(f32_engine, adds, clamps, prompt, n_tokens=8)
        body["steering"]["tokens"] = tokens
        answers.append(parse_completion(_post(f32_engine, body).json()))
        assert_matches(answers[-1], reference(tiny_model, prompt, adds, phase, max_tokens=8,
                                              clamps=clamps))
    every = reference(tiny_model, PROMPT, adds, max_tokens=8, clamps=clamps)
    assert answers[0] != every  # the selection steered fewer positions than "all"


def test_compare_choice_1_is_the_request_without_steering(
    f32_engine: EngineProcess, tiny_model: Path
) -> None:
    """``steering.compare`` with n = 2 and sampling (one seed for both halves): the
    default choices equal the same request sent without steering (tokens identical,
    |Δlogprob| <= 1e-5), the steered ones the request sent steered alone."""
    adds = {("post_block", 1): unit_vector(111)}
    clamps = [Clamp(("post_attn", 2), unit_vector(112), None, -1.0)]
    extra = {"n": 2, "temperature": 0.8, "seed": 1234}

    def choices(doc: dict[str, Any]) -> dict[int, Generation]:
        out = {}
        for c in doc["choices"]:
            lp = c["logprobs"]
            out[c["index"]] = Generation([int(t.split(":", 1)[1]) for t in lp["tokens"]],
                                         [float(x) for x in lp["token_logprobs"]])
        return out

    body = _body(f32_engine, adds, clamps, n_tokens=8, **extra)
    steered = choices(_post(f32_engine, body).json())
    plain = choices(_post(f32_engine, _body(f32_engine, {}, [], n_tokens=8, **extra)).json())
    body["steering"]["compare"] = True
    both = choices(_post(f32_engine, body).json())
    assert sorted(both) == [0, 1, 2, 3]
    for i in (0, 1):
        assert both[i].tokens == steered[i].tokens
        assert max_abs_diff(both[i].logprobs, steered[i].logprobs) <= 1e-5
        assert both[2 + i].tokens == plain[i].tokens
        assert max_abs_diff(both[2 + i].logprobs, plain[i].logprobs) <= 1e-5
    assert both[0].tokens != both[2].tokens


def test_compare_numbers_the_default_choices_past_every_prompts_steered_ones(
    f32_engine: EngineProcess,
) -> None:
    """Found from outside: with two prompts the default half was shifted by ``n`` only,
    so indices came back 0, 1, 1, 2 and a client could not tell the halves apart. vLLM
    numbers a multi-prompt answer's choices prompt by prompt (``i * n + j``); the
    default ones now follow all of them: steered 0..3, default 4..7 in the same order."""
    adds = {("post_block", 1): unit_vector(111)}
    prompts = [PROMPT, PROMPT[:-3]]
    extra = {"n": 2, "temperature": 0.8, "seed": 99}
    body = _body(f32_engine, adds, [], n_tokens=6, **extra)
    body["prompt"] = prompts
    steered = {c["index"]: c["text"] for c in _post(f32_engine, body).json()["choices"]}
    plain_body = _body(f32_engine, {}, [], n_tokens=6, **extra)
    plain_body["prompt"] = prompts
    plain = {c["index"]: c["text"] for c in _post(f32_engine, plain_body).json()["choices"]}
    body["steering"]["compare"] = True
    both = {c["index"]: c["text"] for c in _post(f32_engine, body).json()["choices"]}
    assert sorted(both) == list(range(8)), sorted(both)
    assert {i: both[i] for i in range(4)} == steered
    assert {i: both[4 + i] for i in range(4)} == plain
    assert [both[i] for i in range(4)] != [both[4 + i] for i in range(4)]
