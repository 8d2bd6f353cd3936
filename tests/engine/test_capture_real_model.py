"""Capture on the real model (SmolLM2-135M-Instruct, float32 engine) equals a float32
``transformers`` reference: every hook at early, middle and last layers, reduce
none/mean/last, in a batch with a steered request and a steered request without
capture; relative error <= 1e-4 (max |diff| / max |reference| per site)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from steergate.shared.capture import decode_capture
from tests.engine.hf_reference import (
    capture_field,
    completion_body,
    expected_capture,
    parse_completion,
    reference_stream,
    rel_err,
    steering_field,
)
from tests.harness import EngineProcess

pytestmark = pytest.mark.engine

TOL = 1e-4
HIDDEN = 576
SITES = [(h, layer) for h in ("pre_attn", "post_attn", "post_block") for layer in (0, 9, 29)]
MAX_TOKENS = 6


def _vec(seed: int, norm: float) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=HIDDEN).astype(np.float32)
    return (v / np.linalg.norm(v) * norm).astype(np.float32)


STEER = {("pre_attn", 4): _vec(61, 4.0), ("post_attn", 9): _vec(62, 3.0),
         ("post_block", 12): _vec(63, 3.0)}


def _ids(model: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(model))(text)["input_ids"])


def _post(engine: EngineProcess, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{engine.url}/v1/completions", json=body, headers=engine.headers,
                      timeout=600)


@pytest.mark.parametrize("reduce", ["none", "mean", "last"])
def test_real_model_capture_equals_reference(
    real_engine: EngineProcess, real_model: Path, reduce: str
) -> None:
    a = _ids(real_model, "The ocean is vast and deep, and its waves")
    b = _ids(real_model, "What is the capital of France?")
    cases = [
        (a, capture_field(SITES, "all", reduce), STEER),
        (b, capture_field(SITES, "prompt", reduce), None),
        (b, capture_field(SITES, "generated", reduce), STEER),
        (a, None, {("post_block", 20): _vec(64, 5.0)}),
    ]

    def run(case: tuple) -> httpx.Response:
        prompt, cap, steer = case
        body = completion_body(str(real_engine.model), prompt, MAX_TOKENS)
        if cap is not None:
            body["capture"] = cap
        if steer is not None:
            body["steering"] = steering_field(steer)
        return _post(real_engine, body)

    with ThreadPoolExecutor(len(cases)) as pool:
        responses = list(pool.map(run, cases))
    for (prompt, cap, steer), r in zip(cases, responses, strict=True):
        assert r.status_code == 200, r.text
        doc = r.json()
        if cap is None:
            assert "capture" not in doc
            continue
        generated = parse_completion(doc).tokens
        stream = reference_stream(real_model, prompt + generated[:-1], steer, SITES)
        got = decode_capture(doc["capture"])
        for site in SITES:
            want = expected_capture(stream[site], len(prompt), cap["tokens"], reduce)
            err = rel_err(got[(0, *site)], want)
            assert err <= TOL, (cap["tokens"], site, err)


def _chat_ids(engine: EngineProcess, messages: list[dict]) -> list[int]:
    r = httpx.post(f"{engine.url}/tokenize", headers=engine.headers, timeout=60,
                   json={"model": str(engine.model), "messages": messages,
                         "add_generation_prompt": True})
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def test_chat_and_responses_capture_their_templated_prompt(
    real_engine: EngineProcess, real_model: Path
) -> None:
    """Chat (non-stream) and Responses (stream: ``response.completed`` carries it)
    capture the chat-templated prompt, equal to the reference over the same ids."""
    import json

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = _chat_ids(real_engine, messages)
    sites = [("post_block", 9), ("pre_attn", 29)]
    cap = capture_field(sites, "prompt", "none")
    stream = reference_stream(real_model, ids, None, sites)
    r = httpx.post(f"{real_engine.url}/v1/chat/completions", headers=real_engine.headers,
                   timeout=600, json={"model": str(real_engine.model), "messages": messages,
                                      "max_tokens": 3, "temperature": 0, "capture": cap})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    got = decode_capture(r.json()["capture"])
    for site in sites:
        assert rel_err(got[(0, *site)], stream[site]) <= TOL, site
    body = {"model": str(real_engine.model), "input": messages, "max_output_tokens": 3,
            "temperature": 0, "stream": True, "capture": cap}
    with httpx.stream("POST", f"{real_engine.url}/v1/responses", json=body,
                      headers=real_engine.headers, timeout=600) as r:
        assert r.status_code == 200
        datas = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    completed = [d for d in datas if d.get("type") == "response.completed"]
    assert len(completed) == 1
    got = decode_capture(completed[0]["response"]["capture"])
    assert completed[0]["response"]["usage"]["input_tokens"] == len(ids)  # same template
    for site in sites:
        assert rel_err(got[(0, *site)], stream[site]) <= TOL, site


def test_an_answer_ended_by_a_stop_string_leaves_no_files(real_engine: EngineProcess) -> None:
    """Found from outside: every capture answer that ended on a ``stop`` string left one
    file per choice in the capture directory (2 KB here, 25 MB with every site and
    ``n`` 64) until a later capture's stale sweep, 10 minutes on. The API server's
    detokenizer finds stop strings, so the engine core ran the request one more step,
    and wrote its rows, after the answer had collected the files. Those are removed
    again a second later (``LATE_WRITES_S``)."""
    import time

    from steergate.engine import capture_io

    before = set(capture_io.capture_dir().glob("*.cap"))
    body = {"model": str(real_engine.model), "prompt": "1, 2, 3,", "max_tokens": 20,
            "temperature": 0.0, "stop": [","],
            "capture": capture_field([("post_block", 2)], "generated", "none")}  # fmt: skip
    for _ in range(3):
        r = _post(real_engine, body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and r.json()["usage"]["completion_tokens"] < 20
        assert decode_capture(r.json()["capture"])[(0, "post_block", 2)].shape[0] >= 1
    time.sleep(3.0)  # past LATE_WRITES_S[0]
    assert set(capture_io.capture_dir().glob("*.cap")) - before == set()
