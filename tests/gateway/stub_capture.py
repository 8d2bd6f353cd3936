"""Activation capture for the stub engine (``stub_engine.py``), standing in for the
workers only: the REAL endpoint plugin takes the ``capture`` field, puts its payload
in ``vllm_xargs`` and builds the answer from the worker files; this module writes
those files (``steergate/engine/capture_io.py``'s format) as a worker would, with a
deterministic fake activation per (prompt, hook, layer, reduce). A prompt mentioning
"ocean" is pushed along the first axis by ``layer + 1``: a planted concept direction,
so ``from-examples`` can be tested end to end without a model. Only ``tokens:
"prompt"`` captures are faked (one row per prompt); text after a "|" is ignored (two
different texts with the same activations)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from steergate.engine import capture_io


def fake_activation(
    prompt: str | list[int], hook: str, layer: int, reduce: str, hidden: int
) -> np.ndarray:
    text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
    # What follows a "|" changes nothing (two texts the engine sees as one prompt).
    text = text.split("|")[0]
    seed = hashlib.sha256(f"{text}\0{hook}\0{layer}\0{reduce}".encode()).digest()
    row = np.random.default_rng(int.from_bytes(seed[:8], "little")).normal(size=hidden)
    if "ocean" in text:
        row[0] += layer + 1
    if "overflow" in text:  # a broken engine's activations
        row[1] = np.inf
    return row.astype(np.float32)


def prompts_of(body: dict[str, Any]) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return list(prompt)
    return [prompt]  # type: ignore[list-item]


def write_worker_files(body: dict[str, Any], hidden: int) -> int:
    """What the workers write for a /v1/completions request carrying a capture
    payload: one file per prompt, one record (a one-row "prompt"). Returns the number
    of prompts (0 when the request captures nothing)."""
    raw = (body.get("vllm_xargs") or {}).get(capture_io.XARGS_KEY)
    if not raw:
        return 0
    payload = capture_io.decode_payload(raw)
    if payload.tokens != "prompt":
        # The stub generates nothing real: only a prompt capture (what from-examples
        # asks for) is faked; any other leaves every site with zero rows.
        return 0
    directory = capture_io.ensure_dir(capture_io.capture_dir())
    prompts = prompts_of(body)
    for i, prompt in enumerate(prompts):
        req_id = f"cmpl-stub-{i}-0123abcd"  # vLLM's shape: <base>-<prompt i>-<8 hex>
        header = {
            "req_id": req_id,
            "sites": [[h, layer] for h, layer in payload.sites],
            "reduce": payload.reduce,
            "hidden": hidden,
        }
        dtype = np.float64 if payload.reduce == "mean" else np.float32  # a sum, or rows
        rows = [
            fake_activation(prompt, h, layer, payload.reduce, hidden).astype(dtype)
            for h, layer in payload.sites
        ]
        path = directory / capture_io.file_name(payload.cid, req_id, 0)
        capture_io.append_step(path, header, 0, 1, rows)
    return len(prompts)


def completion(body: dict[str, Any], n: int) -> dict[str, Any]:
    return {
        "id": "cmpl-capture",
        "object": "text_completion",
        "created": 1,
        "model": body.get("model", "stub"),
        "choices": [{"index": i, "text": "x", "finish_reason": "length"} for i in range(n)],
        "usage": {"prompt_tokens": 5 * n, "completion_tokens": n, "total_tokens": 6 * n},
    }
