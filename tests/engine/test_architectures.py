"""Exact steering on every supported architecture, and a clean refusal of the others.

For each architecture of :data:`engine.worker.conventions.SUPPORTED`: a tiny random
model (``steergate tiny-model --architecture``), served by the real engine at
``--dtype float32`` (one engine per architecture, shared by all its checks), equals
the float32 ``transformers`` reference with forward hooks at the same stream points
(``tests/engine/hf_reference.py``): unsteered, each hook at a middle layer in each
phase, ``pre_attn`` of layer 0, and three differently steered requests in one batch.
Greedy tokens are identical and every logprob is within ``TOL`` (1e-3).

Each check records its max |Δlogprob| in ``$STEERGATE_TEST_CACHE/architectures/``;
``scripts/support_table.py`` writes docs/steering-op.md's support table from those
records (``tests/engine/test_support_table.py`` checks the table against the
conventions table). One MoE model also runs under tensor parallelism 2.

Run one architecture: ``pytest tests/engine/test_architectures.py -k Gemma2``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest

from steergate.engine.worker.conventions import HOOKS, SUPPORTED
from tests.engine.hf_reference import (
    MULTIRANK_MAX_TOKENS,
    MULTIRANK_SITES,
    PROMPT,
    TOL,
    Generation,
    assert_matches,
    completion_body,
    engine_completion,
    iteration_buckets,
    max_abs_diff,
    reference,
    send_together,
    steering_field,
    unit_vector,
)
from tests.harness import CACHE, EngineProcess

pytestmark = [pytest.mark.engine, pytest.mark.architectures]

ARCHITECTURES = sorted(SUPPORTED)
#: The MoE architecture also run with --tensor-parallel-size 2.
TP_ARCHITECTURE = "Qwen3MoeForCausalLM"
#: An architecture vLLM serves natively that has no verified convention (Gemma 1).
UNSUPPORTED = "GemmaForCausalLM"
MID = 2  # the middle layer of the tiny models' 4
N = 10  # greedy tokens per check
#: Steering norms per architecture. Gemma norms each sublayer's output to
#: sqrt(hidden) before adding it, so its stream is ~4x the Llama's; the vector is
#: scaled with it so every hook visibly changes the greedy tokens.
NORM = {"Gemma2ForCausalLM": 24.0, "Gemma3ForCausalLM": 24.0}
RESULTS = CACHE / "architectures"


def model_dir(architecture: str) -> Path:
    """The architecture's tiny model, generated once per cache folder (deterministic)."""
    from steergate.engine.tiny_model import generate_architecture

    path = CACHE / "arch-models" / architecture
    if not (path / "config.json").exists():
        generate_architecture(path, architecture)
    return path


@dataclass
class Served:
    architecture: str
    model: Path
    engine: EngineProcess
    checks: dict[str, float] = field(default_factory=dict)

    def vector(self, seed: int, scale: float = 1.0) -> np.ndarray:
        return unit_vector(seed, NORM.get(self.architecture, 6.0) * scale)

    def complete(self, sites=None, phase: str = "all", max_tokens: int = N) -> Generation:
        steering = steering_field(sites, phase) if sites else None
        return engine_completion(self.engine, PROMPT, max_tokens, steering)[0]

    def check(self, name: str, got: Generation, want: Generation) -> None:
        """Tokens identical, logprobs within TOL; records the max |Δlogprob|."""
        self.checks[name] = max(self.checks.get(name, 0.0),
                                max_abs_diff(got.logprobs, want.logprobs))
        assert_matches(got, want)


def shows(steered: Generation, unsteered: Generation) -> bool:
    """The steering visibly changed the answer: other tokens, or logprobs moved by
    10x the tolerance (so an engine that ignored it could not pass the reference)."""
    if steered.tokens != unsteered.tokens:
        return True
    return max_abs_diff(steered.logprobs, unsteered.logprobs) > 10 * TOL


def _record(served: Served, convention: str, started_s: float) -> None:
    """One JSON file per architecture for scripts/support_table.py."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {
        "architecture": served.architecture,
        "convention": convention,
        "hooks": list(HOOKS),
        "engine_start_s": round(started_s, 1),
        "checks": served.checks,
        "max_abs_dlogprob": max(served.checks.values(), default=None),
    }
    name = served.architecture + ("-tp2" if "--tensor-parallel-size" in
                                  served.engine.extra_args else "")
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")


@pytest.fixture(scope="module", params=ARCHITECTURES)
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    architecture = request.param
    model = model_dir(architecture)
    t0 = time.monotonic()
    engine = EngineProcess(model, extra_args=["--dtype", "float32"]).start(timeout=900)
    state = Served(architecture, model, engine)
    started_s = time.monotonic() - t0
    try:
        yield state
    finally:
        engine.stop()
        _record(state, SUPPORTED[architecture].convention.name, started_s)


@pytest.fixture(scope="module")
def unsteered(served: Served) -> Generation:
    got = served.complete()
    served.check("unsteered", got, reference(served.model, PROMPT, None, max_tokens=N))
    return got


def test_info_reports_the_architecture_its_convention_and_hooks(served: Served) -> None:
    r = httpx.get(f"{served.engine.url}/v1/steering/info", headers=served.engine.headers,
                  timeout=30)
    info = r.json()
    support = SUPPORTED[served.architecture]
    assert info["architecture"] == served.architecture
    assert info["vllm_class"] == support.vllm_class
    assert info["layer_convention"] == support.convention.name
    assert info["steering"] == "on" and info["hooks"] == list(HOOKS)
    log = served.engine.log_tail(10**9)
    assert f"steering {served.architecture} ({support.convention.name} convention)" in log


def test_unsteered_request_matches_reference(unsteered: Generation) -> None:
    assert len(unsteered.tokens) == N  # the fixture compared it with the reference


@pytest.mark.parametrize("phase", ["all", "prefill", "decode"])
@pytest.mark.parametrize("hook", HOOKS)
def test_middle_layer_hook_matches_reference(
    served: Served, unsteered: Generation, hook: str, phase: str
) -> None:
    sites = {(hook, MID): served.vector(11)}
    got = served.complete(sites, phase)
    served.check(f"{hook}@{MID}/{phase}", got,
                 reference(served.model, PROMPT, sites, phase, max_tokens=N))
    assert got.tokens != unsteered.tokens  # the steering is strong enough to show
    if phase == "decode":  # the first token comes from the (unsteered) prompt
        assert got.tokens[0] == unsteered.tokens[0]


def test_layer0_pre_attn_matches_reference(served: Served, unsteered: Generation) -> None:
    sites = {("pre_attn", 0): served.vector(21)}
    got = served.complete(sites)
    served.check("pre_attn@0/all", got, reference(served.model, PROMPT, sites, max_tokens=N))
    assert got.tokens != unsteered.tokens


def test_three_differently_steered_requests_in_one_batch(served: Served) -> None:
    a = {("post_block", MID): served.vector(31), ("pre_attn", 1): served.vector(32, 1 / 3)}
    b = {("post_attn", 0): served.vector(33)}
    cases = [(None, "all"), (a, "all"), (b, "decode")]
    n = 48
    alone = [served.complete(s, p, n) for s, p in cases]
    bodies = []
    for sites, phase in cases:
        body = completion_body(str(served.engine.model), PROMPT, n)
        if sites:
            body["steering"] = steering_field(sites, phase)
        bodies.append(body)
    # Scheduling is the engine's: a run in which the three did not share enough steps
    # is sent again (at most 3 times) before judging.
    for _attempt in range(3):
        before = iteration_buckets(served.engine)
        batched = send_together(served.engine, bodies)
        after = iteration_buckets(served.engine)
        shared = (after["8.0"] - after["1.0"]) - (before["8.0"] - before["1.0"])
        if shared >= n // 2:
            break
    assert shared >= n // 2, "the three requests never shared a batch"
    for i, ((sites, phase), got, solo) in enumerate(zip(cases, batched, alone, strict=True)):
        served.check(f"batch[{i}]", got,
                     reference(served.model, PROMPT, sites, phase, max_tokens=n))
        assert got.tokens == solo.tokens  # batching does not change any answer
    assert shows(batched[1], batched[0]) and shows(batched[2], batched[0])


# -- a mixture-of-experts model under tensor parallelism 2 ---------------------------


@pytest.fixture(scope="module")
def tp_served() -> Iterator[Served]:
    model = model_dir(TP_ARCHITECTURE)
    t0 = time.monotonic()
    engine = EngineProcess(
        model, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},  # see test_tensor_parallel.py
        extra_args=["--dtype", "float32", "--tensor-parallel-size", "2"],
    ).start(timeout=900)
    state = Served(TP_ARCHITECTURE, model, engine)
    started_s = time.monotonic() - t0
    try:
        yield state
    finally:
        engine.stop()
        _record(state, SUPPORTED[TP_ARCHITECTURE].convention.name, started_s)


def test_moe_on_tensor_parallel_2_matches_reference(tp_served: Served) -> None:
    log = tp_served.engine.log_tail(10**9)
    assert "world_size=2 rank=0" in log and "world_size=2 rank=1" in log
    n = MULTIRANK_MAX_TOKENS
    unsteered = tp_served.complete(max_tokens=n)
    tp_served.check("tp2/unsteered", unsteered,
                    reference(tp_served.model, PROMPT, None, max_tokens=n))
    for phase in ("all", "prefill", "decode"):
        got = tp_served.complete(MULTIRANK_SITES, phase, n)
        tp_served.check(f"tp2/3 sites/{phase}", got,
                        reference(tp_served.model, PROMPT, MULTIRANK_SITES, phase, max_tokens=n))
        assert got.tokens != unsteered.tokens


# -- an architecture without a verified convention -----------------------------------


def test_unsupported_architecture_refuses_to_start_naming_it_and_the_supported_list(
) -> None:
    engine = EngineProcess(model_dir(UNSUPPORTED), extra_args=["--dtype", "float32"])
    with pytest.raises(RuntimeError, match="engine exited early"):
        engine.start(timeout=900)
    engine.stop()
    message = engine.log_tail(10**9)
    assert f"no verified steering convention for {UNSUPPORTED}" in message
    assert "Supported: " + ", ".join(ARCHITECTURES) in message
    assert "STEERGATE_STEERING=off" in message


def test_unsupported_architecture_runs_unsteered_with_steering_off() -> None:
    model = model_dir(UNSUPPORTED)
    engine = EngineProcess(model, env={"STEERGATE_STEERING": "off"},
                           extra_args=["--dtype", "float32"]).start(timeout=900)
    try:
        info = httpx.get(f"{engine.url}/v1/steering/info", headers=engine.headers,
                         timeout=30).json()
        assert info["architecture"] == UNSUPPORTED
        assert info["steering"] == "off" and info["hooks"] == []
        assert info["layer_convention"] is None
        got, _ = engine_completion(engine, PROMPT, N)
        assert_matches(got, reference(model, PROMPT, None, max_tokens=N))
        body = completion_body(str(model), PROMPT, N,
                               steering=steering_field({("pre_attn", 1): unit_vector(1)}))
        r = httpx.post(f"{engine.url}/v1/completions", json=body, headers=engine.headers,
                       timeout=60)
        assert r.status_code == 501
        assert r.json()["error"]["code"] == "not_implemented"
        assert r.json()["error"]["param"] == "steering"
    finally:
        engine.stop()
