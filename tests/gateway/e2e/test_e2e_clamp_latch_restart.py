"""Latches with clamps survive an engine restart on the real vLLM CPU engine (issue 20):
real Redis, the gateway, and the tiny model served at ``--dtype float32``.

Two conversations latch steering on their first turn: one by value (an add, a clamp
and an ablation, inline), one by reference (a clamp and an ablation of two named
vectors). Their second turn (greedy, fixed ``max_tokens``, logprobs) is recorded,
checked against the float32 ``transformers`` reference and against the answers
without the clamps. Then the engine process is stopped and a fresh one started on the
same port (its latch and vector caches empty): the same second turn is restored from
Redis and gives the identical tokens, every logprob within 1e-5.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from steergate.gateway.app import create_app
from tests.engine.hf_reference import (
    PROMPT,
    Clamp,
    Generation,
    add_term,
    assert_matches,
    clamp_term,
    completion_body,
    max_abs_diff,
    parse_completion,
    reference,
    unit_vector,
)
from tests.gateway.conftest import gateway_settings, make_tenant
from tests.gateway.servers import ServerThread
from tests.harness import EngineProcess, wait_for

pytestmark = pytest.mark.engine

N = 10  # greedy tokens per turn
SECOND_TURN = PROMPT + [int(x) for x in np.random.default_rng(11).integers(10, 600, 6)]
#: Logprobs of the same request before and after the restart.
RESTORE_TOL = 1e-5

# By value: an add and a lifting clamp at post_block 1, an ablation at post_attn 3.
ADD = (("post_block", 1), unit_vector(41, norm=3.0))
VALUE_CLAMPS = [
    Clamp(("post_block", 1), unit_vector(42), lo=2.0, hi=4.0),
    Clamp(("post_attn", 3), unit_vector(43), 0.0, 0.0),
]
# By reference: named vectors "lift" (post_attn 1) and "erase" (pre_attn 2).
NAMED = {"lift": (("post_attn", 1), unit_vector(52)), "erase": (("pre_attn", 2), unit_vector(53))}
REF_CLAMPS = [
    Clamp(NAMED["lift"][0], NAMED["lift"][1], lo=None, hi=-2.0, strength=0.75),
    Clamp(NAMED["erase"][0], NAMED["erase"][1], 0.0, 0.0),
]


BY_VALUE = {"vectors": [add_term(*ADD)] + [clamp_term(c) for c in VALUE_CLAMPS]}
BY_REF = {
    "vectors": [
        {"name": "lift", "op": "clamp", "max": -2.0, "strength": 0.75},
        {"name": "erase", "op": "ablate"},
    ]
}


@pytest.fixture(scope="module")
def engine_proc(tiny_model: Path) -> Iterator[EngineProcess]:
    proc = EngineProcess(tiny_model, extra_args=["--dtype", "float32"]).start(timeout=900)
    yield proc
    proc.stop()


@pytest.fixture()
def start_gateway(redis_url: str) -> Iterator[Callable[[EngineProcess], ServerThread]]:
    started: list[ServerThread] = []

    def start(engine: EngineProcess) -> ServerThread:
        settings = gateway_settings(
            redis_url, engine.url, engine_token=engine.token, reconcile_interval_s=0.5
        )
        server = ServerThread(create_app(settings)).start()
        started.append(server)
        _wait_healthy(server)
        return server

    yield start
    for s in started:
        s.stop()


def _wait_healthy(gw: ServerThread) -> None:
    wait_for(
        lambda: all(e.healthy and not e.dirty for e in gw.app.state.services.engines.engines), 120
    )


def _turn(
    gw: ServerThread, key: str, engine: EngineProcess, prompt: list[int], **extra: Any
) -> tuple[Generation, httpx.Response]:
    body = completion_body(str(engine.model), prompt, N, **extra)
    r = httpx.post(
        gw.url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return parse_completion(r.json()), r


def _engine_holds(engine: EngineProcess, what: str) -> list[Any]:
    r = httpx.get(f"{engine.url}/v1/steering/{what}", headers=engine.headers, timeout=30)
    assert r.status_code == 200, r.text
    return list(r.json())


def test_clamp_latches_survive_an_engine_restart_with_identical_tokens(
    engine_proc: EngineProcess,
    start_gateway: Callable[[EngineProcess], ServerThread],
    redis_url: str,
    tiny_model: Path,
) -> None:
    gw = start_gateway(engine_proc)
    key = make_tenant(redis_url, "clamps")
    for name, (site, vec) in NAMED.items():
        r = httpx.put(
            gw.url + f"/v1/steering/vectors/{name}",
            json=add_term(site, vec),
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert r.status_code in (200, 201), r.text

    # First turns latch; second turns are bridged from the engine's cache.
    recorded: dict[str, Generation] = {}
    for conv, steering in (("c-val", BY_VALUE), ("c-ref", BY_REF)):
        _, r = _turn(
            gw, key, engine_proc, PROMPT, conversation_id=conv, steering={**steering, "latch": True}
        )
        assert r.headers["x-steering-latch"] == "latched", conv
        recorded[conv], r = _turn(gw, key, engine_proc, SECOND_TURN, conversation_id=conv)
        assert r.headers["x-steering-latch"] == "bridged", conv

    # What was recorded is the clamped steering, exactly: the float32 reference, and
    # not the answer without the clamps (nor the unsteered one).
    unsteered, _ = _turn(gw, key, engine_proc, SECOND_TURN)
    adds = dict([ADD])
    for conv, adds_, clamps in (("c-val", adds, VALUE_CLAMPS), ("c-ref", {}, REF_CLAMPS)):
        got = recorded[conv]
        assert_matches(got, reference(tiny_model, SECOND_TURN, adds_, max_tokens=N, clamps=clamps))
        assert got.tokens != unsteered.tokens, conv
        for i in range(len(clamps)):  # each clamp changes the answer on its own
            without = reference(
                tiny_model, SECOND_TURN, adds_, max_tokens=N, clamps=clamps[:i] + clamps[i + 1 :]
            )
            assert (
                without.tokens != got.tokens or max_abs_diff(without.logprobs, got.logprobs) > 1e-2
            ), (conv, i)

    # A fresh engine process on the same port: nothing cached.
    engine_proc.stop()
    engine_proc.start(timeout=900)
    _wait_healthy(gw)
    assert _engine_holds(engine_proc, "latches") == []

    for conv in ("c-val", "c-ref"):
        again, r = _turn(gw, key, engine_proc, SECOND_TURN, conversation_id=conv)
        assert r.headers["x-steering-latch"] == "restored", conv
        assert again.tokens == recorded[conv].tokens, conv
        assert max_abs_diff(again.logprobs, recorded[conv].logprobs) <= RESTORE_TOL, conv
        bridged, r = _turn(gw, key, engine_proc, SECOND_TURN, conversation_id=conv)
        assert r.headers["x-steering-latch"] == "bridged", conv
        assert bridged.tokens == recorded[conv].tokens, conv
    # The restored latches are back in the engine's cache, clamps and all.
    held = [x["conversation_id"] for x in _engine_holds(engine_proc, "latches")]
    assert sorted(c.rsplit("~", 1)[-1] for c in held) == ["c-ref", "c-val"]
