"""Exact steering on every supported architecture, and a clean refusal of the others.

For each architecture of :data:`engine.worker.conventions.SUPPORTED`: a tiny random
model (``steergate tiny-model --architecture``), served by the real engine at
``--dtype float32`` (one engine per architecture, shared by all its checks), equals
the float32 ``transformers`` reference with forward hooks at the same stream points
(``tests/engine/hf_reference.py``): unsteered, each hook at a middle layer in each
phase, ``pre_attn`` of layer 0, and three differently steered requests in one batch.
Greedy tokens are identical and every logprob is within ``TOL`` (1e-3). Activation
capture on the same engine reads the reference's residual stream at each site (all
three hooks at layer 0 and the middle layer, unsteered; and after steering at
``post_attn`` l and ``pre_attn`` l+1, the point ``post_block`` l shares), within
``CAPTURE_TOL`` relative error.

Each check records its max |Δlogprob| (and each capture its relative error) in
``$STEERGATE_TEST_CACHE/architectures/``; ``scripts/support_table.py`` writes
docs/steering-op.md's support table from those records
(``tests/engine/test_support_table.py`` checks the table against the conventions
table). One MoE model also runs under tensor parallelism 2.

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
from steergate.shared.capture import decode_capture
from tests.engine.hf_reference import (
    MULTIRANK_MAX_TOKENS,
    MULTIRANK_SITES,
    PROMPT,
    TOL,
    Clamp,
    Generation,
    Site,
    assert_matches,
    capture_field,
    completion_body,
    engine_completion,
    iteration_buckets,
    iteration_buckets_after,
    max_abs_diff,
    parse_completion,
    reference,
    reference_stream,
    rel_err,
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
#: Captured rows against the float32 reference's stream: max |Δ| / max |stream|.
CAPTURE_TOL = 1e-4


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
    #: capture site -> relative error against the reference stream
    captures: dict[str, float] = field(default_factory=dict)

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

    def check_capture(self, name: str, got: np.ndarray, want: np.ndarray) -> None:
        """Captured rows within CAPTURE_TOL of the reference's; records the error."""
        err = rel_err(got, want)
        self.captures[name] = max(self.captures.get(name, 0.0), err)
        assert err <= CAPTURE_TOL, (name, err)

    def captured(self, sites: list[Site], steer: dict | None,
                 tokens: str, max_tokens: int) -> tuple[Generation, dict]:
        """A greedy request with ``capture`` of ``sites`` (reduce none): what it
        generated and its capture, by (choice, hook, layer)."""
        body = completion_body(str(self.engine.model), PROMPT, max_tokens,
                               capture=capture_field(sites, tokens, "none"))
        if steer:
            body["steering"] = steering_field(steer)
        r = httpx.post(f"{self.engine.url}/v1/completions", json=body,
                       headers=self.engine.headers, timeout=300)
        assert r.status_code == 200, r.text
        return parse_completion(r.json()), decode_capture(r.json()["capture"])


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
        "captures": served.captures,
        "max_capture_rel_err": max(served.captures.values(), default=None),
    }
    name = served.architecture + ("-tp2" if "--tensor-parallel-size" in
                                  served.engine.extra_args else "")
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")


# -- the module's engines, started ahead ---------------------------------------------

#: Engines launched ahead of the one under test. An engine's start is mostly waiting
#: (three processes spawn and import; one compiles on the core it is bound to), and
#: an architecture's checks take a fraction of it, so the next engines start while
#: this one is checked. Consecutive engines are bound to different cores, so two
#: compilations never share one.
AHEAD = 2
TP = "tp2"  # the MoE model under tensor parallelism 2
REFUSED = "unsupported"  # the unsupported architecture, steering on: refuses to start
OFF = "unsupported-off"  # the same with STEERGATE_STEERING=off


def engine_for(key: str, n: int) -> EngineProcess:
    """The (unstarted) engine for ``key``, the ``n``-th this module launches."""
    f32 = ["--dtype", "float32"]
    core = {"VLLM_CPU_OMP_THREADS_BIND": str(n % 2)}
    if key == TP:
        return EngineProcess(model_dir(TP_ARCHITECTURE),  # binding: see test_tensor_parallel.py
                             env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                             extra_args=[*f32, "--tensor-parallel-size", "2"])
    if key == REFUSED:
        return EngineProcess(model_dir(UNSUPPORTED), env=core, extra_args=f32)
    if key == OFF:
        return EngineProcess(model_dir(UNSUPPORTED), env={**core, "STEERGATE_STEERING": "off"},
                             extra_args=f32)
    return EngineProcess(model_dir(key), env=core, extra_args=f32)


class Engines:
    """The module's engines in the order its collected tests use them. ``take`` launches
    the one asked for (unless launched already) and the ``AHEAD`` after it, then waits
    for it; what a deselected or failed test never took is stopped at the end."""

    def __init__(self, order: list[str]) -> None:
        self.order = order
        self.launched: dict[str, tuple[EngineProcess, float]] = {}
        self.count = 0

    def _launch(self, key: str) -> None:
        if key not in self.launched:
            engine = engine_for(key, self.count).launch()
            self.count += 1
            self.launched[key] = (engine, time.monotonic())

    def take(self, key: str, wait: bool = True) -> tuple[EngineProcess, float]:
        """The engine for ``key``, ready (unless not ``wait``), and seconds from its
        launch until then; it is the caller's to stop."""
        self._launch(key)
        if key in self.order:
            i = self.order.index(key)
            for ahead in self.order[i + 1:i + 1 + AHEAD]:
                self._launch(ahead)
        engine, launched_at = self.launched.pop(key)
        if wait:
            engine.wait_ready(timeout=900)
        return engine, time.monotonic() - launched_at

    def stop(self) -> None:
        for engine, _ in self.launched.values():
            engine.stop()
        self.launched.clear()


#: The fixture that takes each engine key other than an architecture's (``served``).
FIXTURE_KEYS = {"tp_served": TP, "refused_engine": REFUSED, "off_engine": OFF}


def _engine_key(item: pytest.Item) -> str | None:
    names = getattr(item, "fixturenames", ())
    if "served" in names:
        return item.callspec.params["served"]  # type: ignore[attr-defined]
    return next((key for name, key in FIXTURE_KEYS.items() if name in names), None)


@pytest.fixture(scope="module")
def engines(request: pytest.FixtureRequest) -> Iterator[Engines]:
    order: list[str] = []
    for item in request.session.items:
        key = _engine_key(item) if item.module is request.module else None
        if key is not None and key not in order:
            order.append(key)
    queue = Engines(order)
    try:
        yield queue
    finally:
        queue.stop()


@pytest.fixture(scope="module", params=ARCHITECTURES)
def served(request: pytest.FixtureRequest, engines: Engines) -> Iterator[Served]:
    architecture = request.param
    engine, started_s = engines.take(architecture)
    state = Served(architecture, model_dir(architecture), engine)
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
        after = iteration_buckets_after(served.engine, before, n)
        shared = (after["8.0"] - after["1.0"]) - (before["8.0"] - before["1.0"])
        if shared >= n // 2:
            break
    assert shared >= n // 2, "the three requests never shared a batch"
    for i, ((sites, phase), got, solo) in enumerate(zip(cases, batched, alone, strict=True)):
        served.check(f"batch[{i}]", got,
                     reference(served.model, PROMPT, sites, phase, max_tokens=n))
        assert got.tokens == solo.tokens  # batching does not change any answer
    assert shows(batched[1], batched[0]) and shows(batched[2], batched[0])


def _clamp_term(c: Clamp) -> dict:
    term: dict = {"hook": c.site[0], "layers": {str(c.site[1]): [float(x) for x in c.direction]},
                  "op": "clamp", "strength": c.strength}
    if c.lo is not None:
        term["min"] = c.lo
    if c.hi is not None:
        term["max"] = c.hi
    return term


@pytest.mark.parametrize("hook", HOOKS)
def test_clamps_and_ablation_at_each_hook_match_reference(
    served: Served, unsteered: Generation, hook: str
) -> None:
    """An add and a lifting clamp at layer 1, an ablation at the middle layer, a
    one-sided half-strength clamp at layer 3, all at this hook: the clamp reference
    hooks the stream per the layer's code (after Gemma's and OLMo 2's post-attention
    norm, Granite's multiplier), and each clamp changes the answer on its own."""
    s = NORM.get(served.architecture, 6.0) / 6.0  # bounds scale with the stream
    adds = {(hook, 1): served.vector(41)}
    clamps = [
        Clamp((hook, 1), unit_vector(42), lo=2.0 * s, hi=4.0 * s),
        Clamp((hook, MID), unit_vector(43), 0.0, 0.0),  # ablate
        Clamp((hook, 3), unit_vector(44), None, -3.0 * s, strength=0.5),
    ]
    steering = steering_field(adds)
    steering["vectors"] += [_clamp_term(c) for c in clamps]
    got = engine_completion(served.engine, PROMPT, N, steering)[0]
    want = reference(served.model, PROMPT, adds, max_tokens=N, clamps=clamps)
    served.check(f"clamp/{hook}@1,{MID},3", got, want)
    for i in range(len(clamps)):  # an engine that skipped any one clamp would fail
        without = reference(served.model, PROMPT, adds, max_tokens=N,
                            clamps=clamps[:i] + clamps[i + 1:])
        assert shows(want, without), (hook, clamps[i].site)
    assert shows(got, unsteered)


def test_capture_of_every_hook_at_layer_0_and_the_middle_equals_reference(
    served: Served,
) -> None:
    """Unsteered, prompt rows: each site reads the reference's stream at its point
    (for this architecture's layer code: e.g. after Gemma's post-attention norm)."""
    sites = [(hook, layer) for layer in (0, MID) for hook in HOOKS]
    _, got = served.captured(sites, None, "prompt", 2)
    stream = reference_stream(served.model, PROMPT, None, sites)
    for site in sites:
        served.check_capture(f"{site[0]}@{site[1]}", got[(0, *site)], stream[site])


def test_capture_after_steering_at_the_shared_point_equals_reference(
    served: Served,
) -> None:
    """Steering ``post_attn`` l and ``pre_attn`` l+1; capture of ``post_attn`` l and
    ``post_block`` l (the point ``pre_attn`` l+1 steers: on the shared table) reads the
    stream after that steering, prompt and generated rows."""
    steer = {("post_attn", MID): served.vector(61), ("pre_attn", MID + 1): served.vector(62)}
    sites = [("post_attn", MID), ("post_block", MID)]
    generation, got = served.captured(sites, steer, "all", N)
    served.check("capture/steered", generation,
                 reference(served.model, PROMPT, steer, max_tokens=N))
    ids = PROMPT + generation.tokens[:-1]  # the last token is never fed back
    stream = reference_stream(served.model, ids, steer, sites)
    for site in sites:
        served.check_capture(f"{site[0]}@{site[1]}/steered", got[(0, *site)], stream[site])
    # The check has power: post_block l without pre_attn l+1's vector is far off.
    without = reference_stream(served.model, ids, {("post_attn", MID): steer[("post_attn", MID)]},
                               [("post_block", MID)])
    assert rel_err(without[("post_block", MID)], stream[("post_block", MID)]) > 100 * CAPTURE_TOL


# -- a mixture-of-experts model under tensor parallelism 2 ---------------------------


@pytest.fixture(scope="module")
def tp_served(engines: Engines) -> Iterator[Served]:
    engine, started_s = engines.take(TP)
    state = Served(TP_ARCHITECTURE, model_dir(TP_ARCHITECTURE), engine)
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


@pytest.fixture()
def refused_engine(engines: Engines) -> EngineProcess:
    """The unsupported architecture's engine, launched and not waited for."""
    return engines.take(REFUSED, wait=False)[0]


@pytest.fixture()
def off_engine(engines: Engines) -> Iterator[EngineProcess]:
    engine, _ = engines.take(OFF)
    try:
        yield engine
    finally:
        engine.stop()


def test_unsupported_architecture_refuses_to_start_naming_it_and_the_supported_list(
    refused_engine: EngineProcess,
) -> None:
    engine = refused_engine
    with pytest.raises(RuntimeError, match="engine exited early"):
        engine.wait_ready(timeout=900)
    engine.stop()
    message = engine.log_tail(10**9)
    assert f"no verified steering convention for {UNSUPPORTED}" in message
    assert "Supported: " + ", ".join(ARCHITECTURES) in message
    assert "STEERGATE_STEERING=off" in message


def test_unsupported_architecture_runs_unsteered_with_steering_off(
    off_engine: EngineProcess,
) -> None:
    model, engine = model_dir(UNSUPPORTED), off_engine
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
