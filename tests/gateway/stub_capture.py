"""Activation capture for the stub engine (``stub_engine.py``): a deterministic fake
activation per (prompt, hook, layer, reduce), in the answer shape of the capture
contract (``shared/capture.py``), so the gateway's ``from-examples`` route can be
tested end to end without a model. A prompt mentioning "ocean" is pushed along the
first axis by ``layer + 1``: a planted concept direction."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from steergate.shared.capture import encode_site


def fake_activation(prompt: str | list[int], hook: str, layer: int, reduce: str, hidden: int):
    text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
    seed = hashlib.sha256(f"{text}\0{hook}\0{layer}\0{reduce}".encode()).digest()
    row = np.random.default_rng(int.from_bytes(seed[:8], "little")).normal(size=hidden)
    if "ocean" in text:
        row[0] += layer + 1
    return row.astype(np.float32)


def answer(body: dict[str, Any], hidden: int) -> dict[str, Any]:
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    if prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    spec = body["capture"]
    reduce = spec.get("reduce", "mean")
    sites = [
        encode_site(
            i, s["hook"], layer, fake_activation(p, s["hook"], layer, reduce, hidden)[None, :]
        )
        for i, p in enumerate(prompts)
        for s in spec["sites"]
        for layer in s["layers"]
    ]
    n = len(prompts)
    return {
        "id": "cmpl-capture",
        "object": "text_completion",
        "created": 1,
        "model": body.get("model", "stub"),
        "choices": [{"index": i, "text": "x", "finish_reason": "length"} for i in range(n)],
        "usage": {"prompt_tokens": 5 * n, "completion_tokens": n, "total_tokens": 6 * n},
        "capture": {"dtype": "float32", "tokens": "prompt", "reduce": reduce, "sites": sites},
    }
