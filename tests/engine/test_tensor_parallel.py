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

import pytest

from tests.engine.hf_reference import (
    check_capture_matches_reference,
    check_latch_bridges_as_explicit_steering,
    check_steered_request_matches_reference,
)
from tests.harness import EngineProcess

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def tp_engine(tiny_model: Path) -> Iterator[EngineProcess]:
    proc = EngineProcess(
        tiny_model,
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        extra_args=["--dtype", "float32", "--tensor-parallel-size", "2"],
    ).start()
    try:
        yield proc
    finally:
        proc.stop()


def test_engine_really_runs_two_tensor_parallel_ranks(tp_engine: EngineProcess) -> None:
    log = tp_engine.log_tail(10**9)
    assert "tensor_parallel_size=2" in log
    assert "world_size=2 rank=0" in log and "world_size=2 rank=1" in log


def test_steered_request_on_tp2_matches_reference_and_differs_from_unsteered(
    tp_engine: EngineProcess, tiny_model: Path
) -> None:
    check_steered_request_matches_reference(tp_engine, tiny_model)


def test_latch_bridge_on_tp2_equals_explicit_steering(
    tp_engine: EngineProcess, tiny_model: Path
) -> None:
    check_latch_bridges_as_explicit_steering(tp_engine, tiny_model, "tp-conv")


def test_capture_on_tp2_matches_reference(tp_engine: EngineProcess, tiny_model: Path) -> None:
    check_capture_matches_reference(tp_engine, tiny_model)
