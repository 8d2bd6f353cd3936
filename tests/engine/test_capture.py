"""Activation capture on the real vLLM CPU engine (float32, default compile mode)
equals a float32 ``transformers`` reference: every hook, reduce none/mean/last,
tokens prompt/generated/all, in a batch with steered and unsteered requests; the
choice index of prompt lists and ``n``; prefix caching never hides prompt rows; the
API server keeps no files after answering; capture errors are 400s naming the field."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from steergate.engine import capture_io
from steergate.shared.capture import decode_capture
from tests.engine.hf_reference import (
    PROMPT,
    capture_field,
    completion_body,
    expected_capture,
    parse_completion,
    reference_stream,
    rel_err,
    steering_field,
    unit_vector,
)
from tests.harness import EngineProcess

pytestmark = pytest.mark.engine

TOL = 1e-4
SITES = [(h, layer) for h in ("pre_attn", "post_attn", "post_block") for layer in (0, 2, 3)]
STEER = {
    ("pre_attn", 0): unit_vector(51),
    ("post_attn", 2): unit_vector(52, norm=4.0),
    ("post_block", 2): unit_vector(53, norm=3.0),
}
PROMPT_B = [int(x) for x in np.random.default_rng(8).integers(10, 600, 9)]
MAX_TOKENS = 5


def _post(engine: EngineProcess, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{engine.url}/v1/completions", json=body, headers=engine.headers, timeout=300
    )


def _body(engine: EngineProcess, prompt: list[int], capture: dict | None, steer: dict | None,
          **extra: Any) -> dict[str, Any]:
    body = completion_body(str(engine.model), prompt, MAX_TOKENS, **extra)
    if capture is not None:
        body["capture"] = capture
    if steer is not None:
        body["steering"] = steering_field(steer)
    return body


def _check(model: Path, prompt: list[int], generated: list[int], steer: dict | None,
           answer: dict, tokens: str, reduce: str, index: int = 0) -> None:
    # Fed back: every generated token but the last (see docs/steering-op.md).
    stream = reference_stream(model, prompt + generated[:-1], steer, SITES)
    got = decode_capture(answer)
    for site in SITES:
        want = expected_capture(stream[site], len(prompt), tokens, reduce)
        err = rel_err(got[(index, *site)], want)
        assert err <= TOL, (site, err)


@pytest.mark.parametrize("reduce", ["none", "mean", "last"])
def test_capture_equals_reference_in_a_mixed_steered_batch(
    f32_engine: EngineProcess, tiny_model: Path, reduce: str
) -> None:
    """Four requests at once: captured+steered (all tokens), captured+unsteered
    (prompt), captured+steered (generated) and steered without capture."""
    cases = [
        (PROMPT, capture_field(SITES, "all", reduce), STEER),
        (PROMPT_B, capture_field(SITES, "prompt", reduce), None),
        (PROMPT_B, capture_field(SITES, "generated", reduce), STEER),
        (PROMPT, None, {("post_block", 1): unit_vector(54)}),
    ]
    with ThreadPoolExecutor(len(cases)) as pool:
        responses = list(pool.map(
            lambda c: _post(f32_engine, _body(f32_engine, c[0], c[1], c[2])), cases
        ))
    for (prompt, cap, steer), r in zip(cases, responses, strict=True):
        assert r.status_code == 200, r.text
        doc = r.json()
        if cap is None:
            assert "capture" not in doc
            continue
        answer = doc["capture"]
        assert answer["dtype"] == "float32"
        assert (answer["tokens"], answer["reduce"]) == (cap["tokens"], reduce)
        assert [(s["index"], s["hook"], s["layer"]) for s in answer["sites"]] == [
            (0, *s) for s in SITES
        ]
        generated = parse_completion(doc).tokens
        _check(tiny_model, prompt, generated, steer, answer, cap["tokens"], reduce)
    assert not list(capture_io.capture_dir().glob("*.cap"))  # 0 bytes retained


def test_prompt_list_and_n_map_rows_to_choice_indices(
    f32_engine: EngineProcess, tiny_model: Path
) -> None:
    """Two prompts x n=2 are choices 0..3 (prompt i, child j -> i*2+j); prompt rows
    are equal for both choices of a prompt."""
    body = _body(f32_engine, PROMPT, capture_field(SITES, "prompt", "none"), STEER, n=2)
    body.update(prompt=[PROMPT, PROMPT_B], temperature=1.0, seed=3)  # n > 1 must sample
    r = _post(f32_engine, body)
    assert r.status_code == 200, r.text
    got = decode_capture(r.json()["capture"])
    assert {k[0] for k in got} == {0, 1, 2, 3}
    for index, prompt in ((0, PROMPT), (1, PROMPT), (2, PROMPT_B), (3, PROMPT_B)):
        stream = reference_stream(tiny_model, prompt, STEER, SITES)
        for site in SITES:
            assert rel_err(got[(index, *site)], stream[site]) <= TOL, (index, site)


def test_a_prefix_cache_hit_does_not_skip_prompt_rows(f32_engine: EngineProcess) -> None:
    """A > 2-block prompt (CPU blocks are 128 tokens) sent twice: the second capture
    equals the first (capture requests never read the prefix cache)."""
    long_prompt = [int(x) for x in np.random.default_rng(9).integers(10, 600, 300)]
    cap = capture_field([("post_block", 3)], "prompt", "none")
    warm = _post(f32_engine, _body(f32_engine, long_prompt, None, None))  # fills the cache
    assert warm.status_code == 200
    first = decode_capture(_post(f32_engine, _body(f32_engine, long_prompt, cap, None)).json()[
        "capture"])
    second = decode_capture(_post(f32_engine, _body(f32_engine, long_prompt, cap, None)).json()[
        "capture"])
    a, b = first[(0, "post_block", 3)], second[(0, "post_block", 3)]
    assert a.shape == (300, 128)
    np.testing.assert_array_equal(a, b)


def test_streamed_capture_arrives_in_a_final_chunk_before_done(
    f32_engine: EngineProcess, tiny_model: Path
) -> None:
    body = _body(f32_engine, PROMPT, capture_field(SITES, "all", "mean"), STEER, stream=True)
    events = []
    with httpx.stream("POST", f"{f32_engine.url}/v1/completions", json=body,
                      headers=f32_engine.headers, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == [] and last["object"] == "text_completion"
    assert all("capture" not in json.loads(e) for e in events[:-2])
    generated = [int(t.split(":", 1)[1]) for e in events[:-2]
                 for t in json.loads(e)["choices"][0]["logprobs"]["tokens"]]
    _check(tiny_model, PROMPT, generated, STEER, last["capture"], "all", "mean")


@pytest.mark.parametrize(
    ("capture", "status", "code", "param"),
    [
        ({"sites": [{"hook": "pre_attn", "layers": [0, 1, 99]}]}, 400, "invalid_request",
         "capture.sites[0].layers[2]"),
        ({"sites": [{"hook": "mlp", "layers": [0]}]}, 400, "invalid_request",
         "capture.sites[0].hook"),
        ({"sites": [{"hook": "pre_attn", "layers": [0]}], "x": 1}, 400, "invalid_request",
         "capture.x"),
        ({"sites": [{"hook": "pre_attn", "layers": [0]}] * 300}, 400, "capture_too_large",
         "capture"),
    ],
)
def test_bad_capture_specs_are_400s_naming_the_field(
    f32_engine: EngineProcess, capture: dict, status: int, code: str, param: str
) -> None:
    r = _post(f32_engine, _body(f32_engine, PROMPT, capture, None))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == (code, param)


def test_capture_bytes_are_bounded_up_front(f32_engine: EngineProcess) -> None:
    """reduce none on 4 sites x 100 prompts x (14 + 5000 - 1) rows x 128 x 4 bytes is
    over 64 MiB: refused before any work."""
    body = _body(f32_engine, PROMPT, capture_field(SITES[:4], "all", "none"), None)
    body["prompt"] = [PROMPT] * 100
    body["max_tokens"] = 5000
    r = _post(f32_engine, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "capture_too_large"


def test_a_client_cannot_smuggle_a_capture_payload(f32_engine: EngineProcess) -> None:
    """Workers trust ``vllm_xargs["steergate_capture"]``; a client's is dropped."""
    evil = capture_io.encode_payload("0" * 32, [("pre_attn", 0)], "all", "none")
    body = _body(f32_engine, PROMPT, None, None, vllm_xargs={capture_io.XARGS_KEY: evil})
    r = _post(f32_engine, body)
    assert r.status_code == 200, r.text
    assert "capture" not in r.json()
    assert not list(capture_io.capture_dir().glob(f"{'0' * 32}.*"))
