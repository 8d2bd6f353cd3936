"""Seeded sampling through a chunked prefill no longer kills the CPU engine.

Found from outside: a few concurrent ``seed``-ed completions with longer prompts, or any
sampled ``steering.compare`` (its halves share a seed the engine draws), crashed the
shared engine for every tenant: vLLM rewinds a mid-prefill request's generator with
``set_offset``, which a CPU generator does not have (``engine/worker/cpu_seeds.py``).
Here the step budget (512 tokens) is below the prompt (700), so every prompt is
chunked, alone or in a crowd. The engine stays up, and a seeded request samples the
same tokens whatever the chunking: alone, and among eleven others."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.engine.hf_reference import completion_body, parse_completion, send_together
from tests.harness import EngineProcess

pytestmark = pytest.mark.engine

PROMPT_LEN = 700


def _prompt(seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(10, 600, PROMPT_LEN)]


@pytest.fixture(scope="module")
def chunking_engine(tiny_model: Path) -> Iterator[EngineProcess]:
    proc = EngineProcess(
        tiny_model, extra_args=["--dtype", "float32", "--max-num-batched-tokens", "512"]
    ).start()
    yield proc
    proc.stop()


def _seeded(engine: EngineProcess, prompt: list[int], seed: int, **extra) -> dict:
    return completion_body(str(engine.model), prompt, 8, temperature=0.8, seed=seed,
                           ignore_eos=True, **extra)  # fmt: skip


def test_seeded_requests_through_chunked_prefills_keep_the_engine_and_their_tokens(
    chunking_engine: EngineProcess,
) -> None:
    engine = chunking_engine
    mine = _seeded(engine, _prompt(0), seed=7)
    r = httpx.post(f"{engine.url}/v1/completions", json=mine, headers=engine.headers,
                   timeout=300)  # fmt: skip
    assert r.status_code == 200, r.text
    alone = parse_completion(r.json())
    crowd = [_seeded(engine, _prompt(i), seed=i) for i in range(1, 12)]
    together = send_together(engine, [mine, *crowd])
    assert together[0].tokens == alone.tokens  # the discarded draws were rewound
    # A sampled compare: both halves share a seed the engine draws.
    compare = _seeded(engine, _prompt(20), seed=None, n=2)
    compare.pop("seed")
    compare["steering"] = {"vectors": [{"hook": "post_block", "layers": {"1": [0.5] * 128}}],
                           "compare": True}  # fmt: skip
    r = httpx.post(f"{engine.url}/v1/completions", json=compare, headers=engine.headers,
                   timeout=300)  # fmt: skip
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1, 2, 3]
    health = httpx.get(f"{engine.url}/health", headers=engine.headers, timeout=30)
    assert health.status_code == 200
