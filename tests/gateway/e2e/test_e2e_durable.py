"""Durable tenant state against real vLLM CPU engines (issue 8's proof): two engines
with a latch cap of 16, real Redis, the gateway in front.

Every comparison is of greedily generated tokens (float32 model), and every steering
used here is checked to change them, so "equal" means "steered exactly as before".
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from steergate.gateway.app import create_app
from steergate.shared.scoping import scope
from tests.gateway.conftest import ADMIN_KEY, gateway_settings, make_tenant
from tests.gateway.servers import ServerThread
from tests.harness import EngineProcess, wait_for

pytestmark = pytest.mark.engine

CAP = 16
PROMPT = "The weather today is"


@pytest.fixture(scope="module")
def pair(tiny_model: Any) -> Iterator[list[EngineProcess]]:
    """Two engines with a latch cap of 16, started side by side."""
    engines = [
        EngineProcess(
            tiny_model,
            env={"STEERGATE_MAX_LATCHED_CONVERSATIONS": str(CAP)},
            extra_args=["--dtype", "float32"],
        )
        for _ in range(2)
    ]
    errors: list[BaseException] = []

    def start(e: EngineProcess) -> None:
        try:
            e.start(timeout=900)
        except BaseException as exc:  # reported below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for e in engines:
            e.stop()
        raise errors[0]
    yield engines
    for e in engines:
        e.stop()


@pytest.fixture()
def start_gateway(redis_url: str) -> Iterator[Callable[..., ServerThread]]:
    started: list[ServerThread] = []

    def start(engines: list[EngineProcess], **kw: Any) -> ServerThread:
        kw.setdefault("reconcile_interval_s", 0.5)
        settings = gateway_settings(
            redis_url,
            ",".join(e.url for e in engines),
            engine_token=engines[0].token,
            **kw,
        )
        server = ServerThread(create_app(settings)).start()
        started.append(server)
        wait_for(
            lambda: all(
                e.healthy and not e.dirty for e in server.app.state.services.engines.engines
            ),
            60,
        )
        return server

    yield start
    for s in started:
        s.stop()



def hidden(engine: EngineProcess) -> int:
    info = httpx.get(engine.url + "/v1/steering/info", headers=engine.headers).json()
    return int(info["hidden_size"])


def vector(engine: EngineProcess, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    return [float(x) for x in rng.standard_normal(hidden(engine)).astype(np.float32) * 4.0]


def complete(gw: ServerThread, key: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL[0], "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **extra}
    r = httpx.post(
        gw.url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r


def text(r: httpx.Response) -> str:
    return str(r.json()["choices"][0]["text"])


def latch_inline(engine: EngineProcess, seed: int) -> dict[str, Any]:
    return {
        "vectors": [{"hook": "post_block", "layers": {"1": vector(engine, seed)}}],
        "latch": True,
    }


def put_vector(gw: ServerThread, key: str, name: str, values: list[float]) -> None:
    r = httpx.put(
        gw.url + f"/v1/steering/vectors/{name}",
        json={"hook": "post_attn", "layers": {"0": values}},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert r.status_code in (200, 201), r.text


def kill_9(engine: EngineProcess) -> None:
    assert engine.proc is not None
    os.killpg(engine.proc.pid, signal.SIGKILL)
    engine.proc.wait(30)
    engine.proc = None


MODEL: list[str] = []


@pytest.fixture(autouse=True)
def _model_name(pair: list[EngineProcess]) -> None:
    if not MODEL:
        e = pair[0]
        MODEL.append(httpx.get(e.url + "/v1/models", headers=e.headers).json()["data"][0]["id"])


def test_kill_9_between_turns_loses_neither_latches_nor_vectors(
    pair: list[EngineProcess], start_gateway: Any, redis_url: str
) -> None:
    a = pair[0]
    gw = start_gateway([a])
    key = make_tenant(redis_url, "crash")
    unsteered = text(complete(gw, key))
    put_vector(gw, key, "calm", vector(a, 1))
    by_ref = {"vectors": [{"name": "calm", "scale": 1.5}], "latch": True}
    ref_turn = text(complete(gw, key, conversation_id="r", steering=by_ref))
    val_turn = text(complete(gw, key, conversation_id="v", steering=latch_inline(a, 2)))
    named = text(complete(gw, key, steering={"vectors": [{"name": "calm"}]}))
    assert unsteered not in {ref_turn, val_turn, named}, "steering must change the tokens"
    # the same turns without a crash: bridged, and equal to the turns that latched
    assert text(complete(gw, key, conversation_id="r")) == ref_turn
    assert text(complete(gw, key, conversation_id="v")) == val_turn

    kill_9(a)
    a.start(timeout=900)
    wait_for(lambda: all(e.healthy for e in gw.app.state.services.engines.engines), 60)

    r = complete(gw, key, conversation_id="r")
    assert r.headers["x-steering-latch"] == "restored" and text(r) == ref_turn
    r = complete(gw, key, conversation_id="v")
    assert r.headers["x-steering-latch"] == "restored" and text(r) == val_turn
    assert text(complete(gw, key, steering={"vectors": [{"name": "calm"}]})) == named


def test_a_flood_over_the_engine_cap_loses_no_latch(
    pair: list[EngineProcess], start_gateway: Any, redis_url: str
) -> None:
    b = pair[1]
    gw = start_gateway([b])
    kb = make_tenant(redis_url, "bystander", latch_count=64)
    ka = make_tenant(redis_url, "flood", latch_count=64, rpm=100_000, max_concurrency=64)
    b_turn = text(complete(gw, kb, conversation_id="b0", steering=latch_inline(b, 10)))
    a_turns = [
        text(complete(gw, ka, conversation_id=f"a{i}", steering=latch_inline(b, 100 + i)))
        for i in range(50)
    ]
    status = httpx.get(b.url + "/v1/steering/status", headers=b.headers).json()
    assert status["latched_conversations"] <= CAP and status["evictions"] > 0
    r = complete(gw, kb, conversation_id="b0")
    assert r.headers["x-steering-latch"] == "restored" and text(r) == b_turn
    r = complete(gw, ka, conversation_id="a0")
    assert r.headers["x-steering-latch"] == "restored" and text(r) == a_turns[0]


def test_two_engines_failover_and_return(
    pair: list[EngineProcess], start_gateway: Any, redis_url: str
) -> None:
    gw = start_gateway(pair)
    svc = gw.app.state.services
    key = make_tenant(redis_url, "pair")

    def owner(conv: str) -> EngineProcess:
        url = svc.engines.pick(scope("pair", conv)).url
        return next(e for e in pair if e.url == url)

    latched = text(complete(gw, key, conversation_id="c", steering=latch_inline(pair[0], 7)))
    calm = vector(pair[0], 3)
    home = owner("c")
    kill_9(home)
    r = complete(gw, key, conversation_id="c")  # the other engine, steered identically
    assert r.headers["x-steering-latch"] == "restored" and text(r) == latched
    put_vector(gw, key, "calm", calm)  # registered while home is down

    home.start(timeout=900)
    wait_for(lambda: owner("c") is home, 120)
    assert text(complete(gw, key, conversation_id="c")) == latched
    answers = []
    for target in pair:
        conv = next(f"v{i}" for i in range(1000) if owner(f"v{i}") is target)
        r = complete(gw, key, conversation_id=conv, steering={"vectors": [{"name": "calm"}]})
        answers.append(text(r))
    assert answers[0] == answers[1] != text(complete(gw, key))


def test_tenant_delete_while_an_engine_is_down_leaves_no_trace_when_it_returns(
    pair: list[EngineProcess], start_gateway: Any, redis_url: str
) -> None:
    gw = start_gateway(pair, engine_read_timeout_s=3.0)
    key = make_tenant(redis_url, "gone")
    put_vector(gw, key, "calm", vector(pair[0], 4))
    for i in range(6):
        complete(gw, key, conversation_id=f"c{i}", steering=latch_inline(pair[0], 200 + i))

    def held(e: EngineProcess) -> list[str]:
        latches = httpx.get(
            e.url + "/v1/steering/latches", params={"prefix": "gone~"}, headers=e.headers
        ).json()
        vectors = httpx.get(
            e.url + "/v1/steering/vectors", params={"prefix": "gone~"}, headers=e.headers
        ).json()
        return [x["conversation_id"] for x in latches] + [x["name"] for x in vectors]

    down = next(e for e in pair if any(x.startswith("gone~c") for x in held(e)))
    assert down.proc is not None
    os.killpg(down.proc.pid, signal.SIGSTOP)  # down, with everything it held
    try:
        r = httpx.delete(
            gw.url + "/admin/tenants/gone",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=60,
        )
        assert r.status_code == 204, r.text
    finally:
        os.killpg(down.proc.pid, signal.SIGCONT)
    wait_for(lambda: not held(pair[0]) and not held(pair[1]), 60)
