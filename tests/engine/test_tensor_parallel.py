"""Steering on a tensor-parallel engine: the real vLLM CPU engine with
``--tensor-parallel-size 2`` (two ``CPUWorker`` processes, gloo all-reduce).

The tiny model has 2 attention heads and 1 KV head, so each rank computes one
query head and vLLM replicates the single KV head on both ranks; ``o_proj`` and
``down_proj`` are row-parallel and all-reduce, so ``hidden_states`` is replicated
and each rank adds the full steering vector to its own copy. If any rank skipped
the vector, the next layer's attention head on that rank (and its shard of the
vocab-parallel ``lm_head``) would see an unsteered stream and the logprobs would
leave the float32 ``transformers`` reference; matching it within 1e-3 is therefore
evidence that every rank applied the same steering.

vLLM CPU's default ``VLLM_CPU_OMP_THREADS_BIND=auto`` binds one NUMA node per rank
and refuses TP=2 on a one-node host ("Not enough allowed NUMA nodes to bind threads
of 2 local CPUWorkers"), so the fixture binds the ranks to CPUs 0 and 1 explicitly.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.engine.hf_reference import (
    Generation,
    assert_matches,
    engine_completion,
    reference,
    steering_field,
)
from tests.harness import EngineProcess

pytestmark = pytest.mark.engine

HIDDEN = 128
MAX_TOKENS = 10
PROMPT = [int(x) for x in np.random.default_rng(7).integers(10, 600, 14)]


def _vec(seed: int, norm: float = 6.0) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=HIDDEN).astype(np.float32)
    return (v / np.linalg.norm(v) * norm).astype(np.float32)


# Sites on an early, a middle and the last layer, at all three hook points.
SITES = {
    ("pre_attn", 1): _vec(41),
    ("post_attn", 2): _vec(42, norm=4.0),
    ("post_block", 3): _vec(43, norm=3.0),
}


@pytest.fixture(scope="module")
def tp_engine(tiny_model: Path) -> Iterator[EngineProcess]:
    proc = EngineProcess(
        tiny_model,
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        extra_args=["--dtype", "float32", "--tensor-parallel-size", "2"],
    ).start(timeout=600)
    try:
        yield proc
    finally:
        proc.stop()


def _complete(
    engine: EngineProcess, steering: dict | None = None, **extra: object
) -> tuple[Generation, httpx.Response]:
    return engine_completion(engine, PROMPT, MAX_TOKENS, steering, **extra)


def test_engine_really_runs_two_tensor_parallel_ranks(tp_engine: EngineProcess) -> None:
    log = tp_engine.log_tail(10**9)
    assert "tensor_parallel_size=2" in log
    assert "world_size=2 rank=0" in log and "world_size=2 rank=1" in log


def test_steered_request_on_tp2_matches_reference_and_differs_from_unsteered(
    tp_engine: EngineProcess, tiny_model: Path
) -> None:
    unsteered, _ = _complete(tp_engine)
    assert_matches(unsteered, reference(tiny_model, PROMPT, None, max_tokens=MAX_TOKENS))

    steered, r = _complete(tp_engine, steering_field(SITES))
    assert r.json()["steering"] == {"applied": True, "latch": "none"}
    assert_matches(steered, reference(tiny_model, PROMPT, SITES, max_tokens=MAX_TOKENS))
    assert steered.tokens != unsteered.tokens


def test_latch_bridge_on_tp2_equals_explicit_steering(
    tp_engine: EngineProcess, tiny_model: Path
) -> None:
    explicit, _ = _complete(tp_engine, steering_field(SITES, "decode"))
    latched, r = _complete(
        tp_engine, {**steering_field(SITES, "decode"), "latch": True}, conversation_id="tp-conv"
    )
    assert r.headers["x-steering-latch"] == "latched"
    bridged, r = _complete(tp_engine, conversation_id="tp-conv")
    assert r.headers["x-steering-latch"] == "bridged"
    assert r.json()["steering"] == {"applied": True, "latch": "bridged"}
    assert latched == explicit
    assert bridged == explicit  # identical tokens and logprobs
    assert_matches(bridged, reference(tiny_model, PROMPT, SITES, "decode", MAX_TOKENS))
    unsteered, _ = _complete(tp_engine)
    assert bridged.tokens != unsteered.tokens
    r = httpx.delete(
        f"{tp_engine.url}/v1/steering/latches/tp-conv", headers=tp_engine.headers, timeout=30
    )
    assert r.status_code == 204
