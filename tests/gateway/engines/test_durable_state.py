"""Durable tenant state (issue 8): Redis is the system of record for vectors and
latches, engines are bounded caches. Against stub engines (the real endpoint plugin,
its real latch controller and caps) and a real Redis: whatever falls out of an engine
(restart, cap eviction, an engine that was away, a newly added one) is installed again
from Redis before the turn that needs it, and the turn is steered exactly as before.

The stub model answers ``echo <digest of the steering it got>``, so equal answers
mean bit-identical steering.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from steergate.gateway.engines import client as engine_client
from steergate.gateway.engines.upstream import Engine
from steergate.gateway.store import key_names as keys
from steergate.gateway.store.connection import store_unavailable
from steergate.gateway.store.scripts import KeepLatch, Scripts
from steergate.shared.scoping import scope
from tests.gateway.conftest import ADMIN_KEY, FakeEngine, make_tenant, start_stub_engine
from tests.gateway.servers import ServerThread
from tests.harness import redis_client, wait_for

CHAT = "/v1/chat/completions"
FAST_POLL = {"reconcile_interval_s": 0.1, "engine_sync_interval_s": 3600.0}


def chat(gw: ServerThread, key: str, **extra: Any) -> httpx.Response:
    body = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], **extra}
    r = httpx.post(gw.url + CHAT, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r


def text(r: httpx.Response) -> str:
    return str(r.json()["choices"][0]["message"]["content"])


def put_vector(gw: ServerThread, key: str, name: str, value: float) -> httpx.Response:
    return httpx.put(
        gw.url + f"/v1/steering/vectors/{name}",
        json={"hook": "post_block", "layers": {"1": [value] * 8}},
        headers={"Authorization": f"Bearer {key}"},
        timeout=10,
    )


def inline(value: float, latch: bool = True) -> dict[str, Any]:
    return {"vectors": [{"hook": "post_attn", "layers": {"2": [value] * 8}}], "latch": latch}


def by_name(name: str) -> dict[str, Any]:
    return {"vectors": [{"name": name}], "latch": True}


@pytest.fixture()
def engines() -> Iterator[list[FakeEngine]]:
    """Stub engines a test starts with :func:`start_engines`; all stopped after it."""
    started: list[FakeEngine] = []
    yield started
    for e in started:
        e.server.stop()


def start_engines(engines: list[FakeEngine], n: int, **caps: Any) -> list[FakeEngine]:
    for _ in range(n):
        engines.append(start_stub_engine(**caps))
    return engines


def stop(engine: FakeEngine) -> None:
    engine.server.stop()


def bring_back(engine: FakeEngine) -> None:
    """The same engine process answering again after an outage (its state kept)."""
    engine.server = ServerThread(engine.state.app, port=engine.server.port).start()


def owner(gw: ServerThread, tenant: str, conv: str, engines: list[FakeEngine]) -> FakeEngine:
    picked = gw.app.state.services.engines.pick(scope(tenant, conv))
    return next(e for e in engines if e.url == picked.url)


# -- restarts ---------------------------------------------------------------------------


def test_engine_restart_loses_nothing_a_tenant_stored(
    start_gateway: Any, fake_engine: FakeEngine, redis_url: str
) -> None:
    gw = start_gateway(**FAST_POLL)
    key = make_tenant(redis_url, "acme")
    assert put_vector(gw, key, "calm", 0.25).status_code == 201
    by_ref = {"vectors": [{"name": "calm", "scale": 2.0}], "latch": True}
    latched_ref = text(chat(gw, key, conversation_id="c-ref", steering=by_ref))
    latched_val = text(chat(gw, key, conversation_id="c-val", steering=inline(0.5)))
    explicit = text(chat(gw, key, steering={"vectors": [{"name": "calm"}]}))
    assert latched_ref.startswith("echo ") and latched_val.startswith("echo ")

    fake_engine.state.restart()  # a crash, a deploy, an OOM kill: the cache is empty
    assert fake_engine.state.latches == {} and fake_engine.state.vectors == {}

    r = chat(gw, key, conversation_id="c-ref")
    assert r.headers["x-steering-latch"] == "restored" and text(r) == latched_ref
    assert r.json()["steering"] == {"applied": True, "latch": "restored"}
    r = chat(gw, key, conversation_id="c-val")
    assert r.headers["x-steering-latch"] == "restored" and text(r) == latched_val
    # restored once, bridged from then on
    assert chat(gw, key, conversation_id="c-val").headers["x-steering-latch"] == "bridged"
    # the named vector works again with the same output, and is still listed and counted
    assert text(chat(gw, key, steering={"vectors": [{"name": "calm"}]})) == explicit
    listed = httpx.get(
        gw.url + "/v1/steering/vectors", headers={"Authorization": f"Bearer {key}"}
    ).json()["data"]
    assert [v["name"] for v in listed] == ["calm"]
    client = redis_client(redis_url)
    assert client.zcard(keys.latches("acme")) == 2


@pytest.mark.parametrize(("stream", "named"), [(False, False), (True, False), (False, True)])
def test_a_turn_vllm_refuses_changes_no_latch(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str, stream: bool, named: bool
) -> None:
    """The engine stores a turn's latch before vLLM checks the rest of the request (here
    max_tokens 0). A refused turn used to leave it stored and say ``latched``: found from
    outside, a 400 replaced the conversation's steering and counted against the quota.
    Now the engine takes it back when vLLM's answer is an error and says ``none``: the
    conversation keeps its earlier latch (bridged, and restored after a restart, as it
    was), and a conversation that had none still has none. ``named``: by-reference
    latches, whose pending entry names both latches' vectors: settlement puts the
    earlier entry back only over the exact entry admission left."""
    key = make_tenant(redis_url, "acme")
    first, then = inline(0.1), inline(0.5)
    if named:
        assert put_vector(gateway, key, "v", 0.25).status_code == 201
        assert put_vector(gateway, key, "w", -0.5).status_code == 201
        first, then = by_name("v"), by_name("w")
    before = text(chat(gateway, key, conversation_id="c1", steering=first))
    refused_body = {"model": "stub", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 0, "stream": stream}  # fmt: skip
    for conversation in ("c1", "c2"):
        r = httpx.post(
            gateway.url + CHAT,
            json={**refused_body, "conversation_id": conversation, "steering": then},
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert r.status_code == 400 and r.headers["x-steering-latch"] == "none", r.text
    r = chat(gateway, key, conversation_id="c1")
    assert r.headers["x-steering-latch"] == "bridged" and text(r) == before
    r = chat(gateway, key, conversation_id="c2")
    assert r.headers["x-steering-latch"] == "none" and text(r) == "echo"
    assert set(fake_engine.state.latches) == {"acme~c1"}
    assert redis_client(redis_url).zcard(keys.latches("acme")) == 1
    fake_engine.state.restart()
    r = chat(gateway, key, conversation_id="c1")
    assert r.headers["x-steering-latch"] == "restored" and text(r) == before


def test_engine_cap_evictions_cost_a_restore_never_a_latch(
    start_gateway: Any, engines: list[FakeEngine], redis_url: str
) -> None:
    (engine,) = start_engines(engines, 1, max_latched=4)
    gw = start_gateway(engine_urls=engine.url, **FAST_POLL)
    ka = make_tenant(redis_url, "a", latch_count=64)
    kb = make_tenant(redis_url, "b", latch_count=64)
    b_answer = text(chat(gw, kb, conversation_id="b1", steering=inline(0.9)))
    a_answers = [
        text(chat(gw, ka, conversation_id=f"a{i}", steering=inline(0.01 * (i + 1))))
        for i in range(10)
    ]
    assert len(engine.state.latches) == 4  # the engine's caps hold, as designed
    r = chat(gw, kb, conversation_id="b1")  # another tenant's flood did not lose it
    assert r.headers["x-steering-latch"] == "restored" and text(r) == b_answer
    r = chat(gw, ka, conversation_id="a0")  # nor the tenant's own earliest
    assert r.headers["x-steering-latch"] == "restored" and text(r) == a_answers[0]
    assert len(engine.state.latches) <= 4


def test_a_stored_spec_that_is_not_the_conversations_latch_is_never_restored(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    """The spec a restore installs must be the latch the conversation's record names
    (its digest). Here c1's spec is replaced by c2's behind the gateway's back (as a
    concurrent turn replacing the latch between admission and the restore would): the
    turn is a 409 ``steering_state_changed``, the engine never caches c2's latch as c1's,
    and once the record and the spec agree again the restore steers as before."""
    key = make_tenant(redis_url, "acme")
    c1 = text(chat(gateway, key, conversation_id="c1", steering=inline(0.1)))
    chat(gateway, key, conversation_id="c2", steering=inline(0.2))
    client = redis_client(redis_url)
    specs = keys.latch_specs("acme")
    own = client.hget(specs, "c1")
    client.hset(specs, "c1", client.hget(specs, "c2"))
    fake_engine.state.restart()
    r = httpx.post(
        gateway.url + CHAT,
        json={
            "model": "stub",
            "messages": [{"role": "user", "content": "hi"}],
            "conversation_id": "c1",
        },
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "steering_state_changed"
    assert "acme~c1" not in fake_engine.state.latches
    client.hset(specs, "c1", own)
    r = chat(gateway, key, conversation_id="c1")
    assert r.headers["x-steering-latch"] == "restored" and text(r) == c1


def test_quota_eviction_is_the_only_way_a_latch_is_lost(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme", latch_count=2)
    for c, v in (("c1", 0.1), ("c2", 0.2), ("c3", 0.3)):
        chat(gateway, key, conversation_id=c, steering=inline(v))
    # c1 was evicted by the tenant's own quota: never steered again, on any engine
    r = chat(gateway, key, conversation_id="c1")
    assert r.headers["x-steering-latch"] == "none" and text(r) == "echo"
    wait_for(lambda: "acme~c1" not in fake_engine.state.latches, 5)


def test_a_latching_request_refused_with_400_evicts_no_other_latch(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    """The attack: with a quota of one latch, a request latching c2 that is then refused
    (an unknown vector, a layer of the wrong length, a bad option) used to have its
    admission evict c1 first, for good: "a 400 never drops a latch" did not hold."""
    key = make_tenant(redis_url, "acme", latch_count=1)
    latched = chat(gateway, key, conversation_id="c1", steering=inline(0.5))
    assert latched.headers["x-steering-latch"] == "latched"
    steered = text(latched)
    for bad, extra, param in [
        ({"vectors": [{"name": "nope"}], "latch": True}, {}, "steering.vectors[0].name"),
        (
            {"vectors": [{"hook": "post_attn", "layers": {"2": [0.5] * 7}}], "latch": True},
            {},
            "steering.vectors[0].layers.2",
        ),
        (inline(0.7), {"cache_salt": 5}, "cache_salt"),
        (inline(0.7), {"stream": True, "stream_options": "x"}, "stream_options"),
    ]:
        body = {"model": "stub", "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(
            gateway.url + CHAT,
            json={**body, "conversation_id": "c2", "steering": bad, **extra},
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        listed = httpx.get(
            gateway.url + "/v1/steering/latches", headers={"Authorization": f"Bearer {key}"}
        ).json()
        assert [lat["conversation_id"] for lat in listed] == ["c1"], (param, listed)
        r = chat(gateway, key, conversation_id="c1")  # still steered by its latch
        assert r.headers["x-steering-latch"] == "bridged" and text(r) == steered, param


def test_a_latching_turn_the_engine_refuses_or_that_fails_upstream_evicts_no_other_latch(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    """Found from outside: with a quota of one latch, a latching request on c2 that the
    engine refused (beam search, more clamp directions at a point than it allows) or
    that never reached it (502) evicted c1 for good at admission. Settlement now puts
    back what admission evicted when the turn's latch was not kept."""
    key = make_tenant(redis_url, "acme", latch_count=1)
    auth = {"Authorization": f"Bearer {key}"}
    steered = text(chat(gateway, key, conversation_id="c1", steering=inline(0.5)))
    client = redis_client(redis_url)
    spec = client.hget(keys.latch_specs("acme"), "c1")
    ablate = {"op": "ablate", "hook": "post_attn", "layers": {"2": [1.0] + [0.0] * 7}}
    body = {"model": "stub", "messages": [{"role": "user", "content": "hi"}]}
    body["conversation_id"] = "c2"

    def latched() -> list[str]:
        listed = httpx.get(gateway.url + "/v1/steering/latches", headers=auth).json()
        return [lat["conversation_id"] for lat in listed]

    for bad, extra, param in [
        (inline(0.7), {"use_beam_search": True}, "use_beam_search"),
        ({"vectors": [ablate] * 5, "latch": True}, {}, "steering.vectors"),
    ]:
        r = httpx.post(
            gateway.url + CHAT, json={**body, "steering": bad, **extra}, headers=auth, timeout=30
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        wait_for(lambda: latched() == ["c1"], 5)  # put back by the turn's settlement
        assert client.hget(keys.latch_specs("acme"), "c1") == spec
        r = chat(gateway, key, conversation_id="c1")  # still steered by its latch
        assert r.headers["x-steering-latch"] in ("bridged", "restored") and text(r) == steered
    stop(fake_engine)
    r = httpx.post(
        gateway.url + CHAT, json={**body, "steering": inline(0.7)}, headers=auth, timeout=30
    )
    assert r.status_code == 502, r.text
    wait_for(lambda: latched() == ["c1"], 5)
    assert client.hget(keys.latch_specs("acme"), "c1") == spec
    assert int(client.get(keys.latch_bytes("acme"))) == 32  # c1's 8 floats, nothing else


# -- vectors ----------------------------------------------------------------------------


def test_a_changed_vector_makes_its_by_reference_latch_stale_after_a_restart(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme")
    assert put_vector(gateway, key, "calm", 0.25).status_code == 201
    chat(gateway, key, conversation_id="c", steering={"vectors": [{"name": "calm"}], "latch": True})
    assert put_vector(gateway, key, "calm", 0.75).status_code == 200  # other content
    fake_engine.state.restart()
    r = chat(gateway, key, conversation_id="c")
    assert r.headers["x-steering-latch"] == "dropped_stale" and text(r) == "echo"
    client = redis_client(redis_url)
    wait_for(lambda: client.zcard(keys.latches("acme")) == 0, 5)


def test_a_deleted_vector_makes_its_by_reference_latch_stale_after_a_restart(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme")
    assert put_vector(gateway, key, "calm", 0.25).status_code == 201
    chat(gateway, key, conversation_id="c", steering={"vectors": [{"name": "calm"}], "latch": True})
    auth = {"Authorization": f"Bearer {key}"}
    assert httpx.delete(gateway.url + "/v1/steering/vectors/calm", headers=auth).status_code == 204
    fake_engine.state.restart()
    r = chat(gateway, key, conversation_id="c")
    assert r.headers["x-steering-latch"] == "dropped_stale" and text(r) == "echo"
    assert chat(gateway, key, conversation_id="c").headers["x-steering-latch"] == "none"


def test_vector_data_round_trips_from_redis_exactly(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme")
    auth = {"Authorization": f"Bearer {key}"}
    values = [0.1, -2.5, 3.25e-8, 1e30, -0.0, 7.0, 0.333333, 42.0]
    r = httpx.put(
        gateway.url + "/v1/steering/vectors/v",
        json={"hook": "pre_attn", "layers": {"3": values}, "description": "d"},
        headers=auth,
    )
    assert r.status_code == 201
    fake_engine.state.restart()
    full = httpx.get(gateway.url + "/v1/steering/vectors/v?include=data", headers=auth).json()
    again = httpx.put(
        gateway.url + "/v1/steering/vectors/v2",
        json={"hook": full["hook"], "packed": full["packed"]},
        headers=auth,
    ).json()
    assert again["digest"] == full["digest"] == r.json()["digest"]


# -- many engines -----------------------------------------------------------------------


def test_two_engines_failover_is_exact_and_a_returning_engine_is_hydrated_lazily(
    start_gateway: Any, engines: list[FakeEngine], redis_url: str
) -> None:
    start_engines(engines, 2)
    gw = start_gateway(engine_urls=",".join(e.url for e in engines), **FAST_POLL)
    wait_for(lambda: all(not e.dirty for e in gw.app.state.services.engines.engines), 5)
    key = make_tenant(redis_url, "acme")
    latched = text(chat(gw, key, conversation_id="c", steering=inline(0.5)))
    home = owner(gw, "acme", "c", engines)
    other = next(e for e in engines if e is not home)
    assert "acme~c" in home.state.latches
    # affinity: the conversation keeps its engine while it is up
    for _ in range(3):
        chat(gw, key, conversation_id="c")
    assert "acme~c" not in other.state.latches

    stop(home)
    r = chat(gw, key, conversation_id="c")  # served by the next engine, steered the same
    assert r.headers["x-steering-latch"] == "restored" and text(r) == latched
    assert "acme~c" in other.state.latches
    assert put_vector(gw, key, "calm", 0.25).status_code == 201  # registered meanwhile

    bring_back(home)
    wait_for(lambda: owner(gw, "acme", "c", engines) is home, 5)
    r = chat(gw, key, conversation_id="c")
    assert r.headers["x-steering-latch"] in ("bridged", "restored") and text(r) == latched
    # the vector registered while it was away works on both engines, identically
    answers = set()
    for target in engines:
        conv = next(f"v{i}" for i in range(1000) if owner(gw, "acme", f"v{i}", engines) is target)
        r = chat(gw, key, conversation_id=conv, steering={"vectors": [{"name": "calm"}]})
        answers.add(text(r))
        assert "acme~calm" in target.state.vectors
    assert len(answers) == 1 and answers != {"echo"}


def test_a_new_engine_gets_vectors_registered_before_it_joined(
    start_gateway: Any, engines: list[FakeEngine], redis_url: str
) -> None:
    (first,) = start_engines(engines, 1)
    gw1 = start_gateway(engine_urls=first.url, **FAST_POLL)
    key = make_tenant(redis_url, "acme")
    assert put_vector(gw1, key, "calm", 0.25).status_code == 201
    before = text(chat(gw1, key, steering={"vectors": [{"name": "calm"}]}))
    (_, second) = start_engines(engines, 1)
    gw2 = start_gateway(engine_urls=second.url, **FAST_POLL)  # the new engine only
    assert text(chat(gw2, key, steering={"vectors": [{"name": "calm"}]})) == before
    assert "acme~calm" in second.state.vectors


def conv_on(gw: ServerThread, tenant: str, target: FakeEngine, engines: list[FakeEngine]) -> str:
    """A conversation id that ``gw`` routes to ``target``."""
    return next(f"c{i}" for i in range(1000) if owner(gw, tenant, f"c{i}", engines) is target)


def replicas(
    start_gateway: Any, engines: list[FakeEngine]
) -> tuple[FakeEngine, FakeEngine, ServerThread, ServerThread]:
    """Engines A and B; gateway 1 serves both (once it has synced them), gateway 2 only
    A: a replica that cannot reach B, so B misses the vector writes made through it."""
    a, b = start_engines(engines, 2)
    gw1 = start_gateway(engine_urls=f"{a.url},{b.url}", **FAST_POLL)
    gw2 = start_gateway(engine_urls=a.url, **FAST_POLL)
    wait_for(lambda: all(not e.dirty for e in gw1.app.state.services.engines.engines), 5)
    return a, b, gw1, gw2


def beside_hung(
    start_gateway: Any, engines: list[FakeEngine], hung_url: str, reconcile_interval_s: float
) -> tuple[FakeEngine, ServerThread, Engine]:
    """A gateway serving a stub engine and ``hung_url``; returns the stub, the gateway and
    its record of the hung engine."""
    (a,) = start_engines(engines, 1)
    gw = start_gateway(
        engine_urls=f"{a.url},{hung_url}",
        reconcile_interval_s=reconcile_interval_s,
        engine_sync_interval_s=3600.0,
    )
    hung = next(e for e in gw.app.state.services.engines.engines if e.url == hung_url)
    return a, gw, hung


def test_an_engine_that_missed_a_vector_write_never_bridges_a_latch_with_the_old_content(
    start_gateway: Any, engines: list[FakeEngine], redis_url: str
) -> None:
    """Found from outside: a gateway replica that could not reach engine B replaced
    ``v``; the other replica's turns on B, latched by name to ``v``, were bridged with the
    old vector. The latch's vectors now come with the digests Redis holds (admission
    reads them with the latch's entry), so B installs the new content and finds the latch
    stale, as a restart would have."""
    a, b, gw1, gw2 = replicas(start_gateway, engines)
    key = make_tenant(redis_url, "acme")
    assert put_vector(gw1, key, "v", 0.25).status_code == 201
    conv = conv_on(gw1, "acme", b, engines)
    latched = text(chat(gw1, key, conversation_id=conv, steering=by_name("v")))
    assert chat(gw1, key, conversation_id=conv).headers["x-steering-latch"] == "bridged"
    old = b.state.vectors["acme~v"]["digest"]

    assert put_vector(gw2, key, "v", 0.75).status_code == 200  # B never hears of it
    assert b.state.vectors["acme~v"]["digest"] == old  # B is behind Redis now
    r = chat(gw1, key, conversation_id=conv)
    assert r.headers["x-steering-latch"] == "dropped_stale", text(r)
    assert text(r) == "echo" != latched
    current = redis_client(redis_url).hget(keys.vectors("acme"), "v")
    assert b.state.vectors["acme~v"]["digest"] == json.loads(current)["digest"] != old
    assert chat(gw1, key, conversation_id=conv).headers["x-steering-latch"] == "none"


def test_a_latch_made_with_the_current_vector_survives_a_move_to_an_engine_that_missed_it(
    start_gateway: Any, engines: list[FakeEngine], redis_url: str
) -> None:
    """The other side of the same race: a latch made on A with ``v``'s new content,
    whose conversation moves to B (A went down), which still held the old content. B
    used to find it stale against its own copy and drop a valid latch; now it installs
    Redis's ``v`` and restores the latch, steering exactly as on A."""
    a, b, gw1, gw2 = replicas(start_gateway, engines)
    key = make_tenant(redis_url, "acme")
    assert put_vector(gw1, key, "v", 0.25).status_code == 201
    assert put_vector(gw2, key, "v", 0.75).status_code == 200  # B keeps 0.25
    conv = conv_on(gw1, "acme", a, engines)
    latched = text(chat(gw1, key, conversation_id=conv, steering=by_name("v")))
    assert latched != "echo"

    stop(a)
    r = chat(gw1, key, conversation_id=conv)
    assert r.headers["x-steering-latch"] == "restored", text(r)
    assert text(r) == latched
    assert chat(gw1, key, conversation_id=conv).headers["x-steering-latch"] == "bridged"


def test_a_turn_while_another_stores_the_latch_is_checked_against_redis_too(
    start_gateway: Any, engines: list[FakeEngine], redis_url: str
) -> None:
    """Found from outside: while a latching turn runs, the ledger entry is pending (no
    digest yet), and a plain turn of the conversation was bridged unchecked, here with
    the old copy of a vector B missed a write to. A pending entry now names the vectors
    of the latch being stored and of the one before it, so the plain turn is checked
    against Redis (B installs the new content and finds the latch stale); and its
    ``dropped_stale`` does not take the other turn's pending entry with it."""
    a, b, gw1, gw2 = replicas(start_gateway, engines)
    key = make_tenant(redis_url, "acme")
    client = redis_client(redis_url)
    assert put_vector(gw1, key, "v", 0.25).status_code == 201
    conv = conv_on(gw1, "acme", b, engines)
    latched = text(chat(gw1, key, conversation_id=conv, steering=by_name("v")))

    def entry() -> keys.LatchEntry:
        return keys.LatchEntry.parse(client.hget(keys.latch_info("acme"), conv))

    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(
            chat, gw1, key, conversation_id=conv, steering=by_name("v"), fake_delay=3
        )
        wait_for(lambda: entry().digest == "", 5)  # pending while it runs
        assert entry().names == ("v",)
        assert put_vector(gw2, key, "v", 0.75).status_code == 200  # B misses it
        r = chat(gw1, key, conversation_id=conv)
        assert r.headers["x-steering-latch"] == "dropped_stale", text(r)
        assert text(r) == "echo" != latched
        gw1.call(gw1.app.state.services.settler.drain())
        assert entry().digest == ""  # still the other turn's, pending
        assert slow.result(timeout=30).status_code == 200
    gw1.call(gw1.app.state.services.settler.drain())
    assert entry().digest  # recorded by the turn that stored it


def test_concurrent_vector_writes_leave_every_engine_with_what_redis_holds(
    start_gateway: Any, engines: list[FakeEngine], redis_url: str
) -> None:
    """Found from outside: two PUTs of one name at once (X, then Y) could reach an engine
    in the other order, leaving it with X while Redis holds Y, and not marked dirty.
    Forced here: X's engine install is held back until Y has been written everywhere.
    After its install a write reads Redis again and offers what Redis holds."""
    (a,) = start_engines(engines, 1)
    gw = start_gateway(engine_urls=a.url, **FAST_POLL)
    key = make_tenant(redis_url, "acme")
    client = redis_client(redis_url)
    svc = gw.app.state.services
    original = svc.engines.put_vector_everywhere
    go_on = threading.Event()

    async def late_x(tenant_id: str, name: str, body: bytes) -> None:
        if b'"description":"x"' in body:
            await asyncio.to_thread(go_on.wait, 20)
        await original(tenant_id, name, body)

    svc.engines.put_vector_everywhere = late_x
    auth = {"Authorization": f"Bearer {key}"}

    def put(value: float, label: str) -> httpx.Response:
        body = {"hook": "post_block", "layers": {"1": [value] * 8}, "description": label}
        return httpx.put(gw.url + "/v1/steering/vectors/v", json=body, headers=auth, timeout=30)

    def digest_in_redis() -> str | None:
        meta = client.hget(keys.vectors("acme"), "v")
        return json.loads(meta)["digest"] if meta else None

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(put, 0.25, "x")
        wait_for(lambda: digest_in_redis() is not None, 10)  # X stored, install held
        assert put(0.75, "y").status_code == 200  # Y stored and installed
        y = digest_in_redis()
        assert a.state.vectors["acme~v"]["digest"] == y
        go_on.set()  # now X's install lands, after Y's
        assert first.result(timeout=30).status_code == 201
    assert digest_in_redis() == y
    assert a.state.vectors["acme~v"]["digest"] == y


def test_tenant_delete_with_an_engine_down_leaves_no_trace_after_it_returns(
    start_gateway: Any, engines: list[FakeEngine], redis_url: str
) -> None:
    start_engines(engines, 2)
    gw = start_gateway(engine_urls=",".join(e.url for e in engines), **FAST_POLL)
    key = make_tenant(redis_url, "acme")
    keep = make_tenant(redis_url, "other")
    assert put_vector(gw, key, "calm", 0.25).status_code == 201
    assert put_vector(gw, keep, "calm", 0.5).status_code == 201
    for i in range(8):
        chat(gw, key, conversation_id=f"c{i}", steering=inline(0.1))
    chat(gw, keep, conversation_id="k", steering=inline(0.2))
    down = owner(gw, "acme", "c0", engines)
    assert any(c.startswith("acme~") for c in down.state.latches)
    stop(down)
    r = httpx.delete(
        gw.url + "/admin/tenants/acme", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert r.status_code == 204
    bring_back(down)

    def clean() -> bool:
        return not any(
            k.startswith("acme~") for e in engines for k in (*e.state.latches, *e.state.vectors)
        )

    wait_for(clean, 5)
    assert any(k.startswith("other~") for e in engines for k in e.state.vectors)


@pytest.mark.parametrize("stream", [False, True])
def test_a_latch_redis_could_not_record_as_its_turn_ended_is_recorded_by_settlement(
    start_gateway: Any,
    fake_engine: FakeEngine,
    redis_url: str,
    stream: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found from outside: when recording a latch failed (Redis paused as the turn
    ended), the ledger kept a pending entry for good: later turns got no expectation
    (an engine bridged its own copies unchecked), and an engine that lost the latch
    answered ``none``, losing a latch Redis was to hold. Settlement, retried until Redis
    takes it, now records it."""
    gw = start_gateway(**FAST_POLL)
    key = make_tenant(redis_url, "acme")
    assert put_vector(gw, key, "v", 0.25).status_code == 201
    svc = gw.app.state.services
    original = Scripts.run
    failed: list[str] = []

    async def keep_fails(self: Scripts, call: Any) -> Any:
        if isinstance(call, KeepLatch) and not failed:
            failed.append(call.conversation_id)
            raise store_unavailable()
        return await original(self, call)

    monkeypatch.setattr(Scripts, "run", keep_fails)
    body = {
        "model": "stub",
        "messages": [{"role": "user", "content": "hi"}],
        "conversation_id": "c",
        "steering": by_name("v"),
        "stream": stream,
    }
    r = httpx.post(gw.url + CHAT, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200 and r.headers["x-steering-latch"] == "latched"
    latched = text(chat(gw, key, conversation_id="c"))  # bridged by the engine
    assert failed == ["c"]
    gw.call(svc.settler.drain())
    client = redis_client(redis_url)
    entry = keys.LatchEntry.parse(client.hget(keys.latch_info("acme"), "c"))
    assert entry.digest and entry.names == ("v",)
    assert client.hget(keys.latch_specs("acme"), "c")
    fake_engine.state.restart()  # the engine loses it: Redis has it to restore
    r = chat(gw, key, conversation_id="c")
    assert r.headers["x-steering-latch"] == "restored" and text(r) == latched


@pytest.fixture()
def hung_engine_url() -> Iterator[str]:
    """An engine that is SIGSTOPped: the kernel takes connections, nothing answers."""
    with socket.create_server(("127.0.0.1", 0), backlog=128) as sock:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_an_engine_found_down_holds_no_vector_write_and_no_tenant_delete(
    start_gateway: Any, engines: list[FakeEngine], redis_url: str, hung_engine_url: str
) -> None:
    """Found from outside: with one engine hung (SIGSTOP) and already marked down, a
    vector PUT or DELETE, and a tenant delete, each waited on it up to the engine read
    timeout (600 s). Writes now skip an engine the poller found down: it is dirty, and
    synced from Redis when it is back."""
    a, gw, hung = beside_hung(start_gateway, engines, hung_engine_url, 0.2)
    wait_for(lambda: not hung.healthy, 15)
    key = make_tenant(redis_url, "acme")
    auth = {"Authorization": f"Bearer {key}"}
    assert put_vector(gw, key, "v", 0.25).status_code == 201  # timeout=10 s
    assert "acme~v" in a.state.vectors and hung.dirty
    chat(gw, key, conversation_id="c", steering=by_name("v"))
    r = httpx.delete(gw.url + "/v1/steering/vectors/v", headers=auth, timeout=10)
    assert r.status_code == 204 and "acme~v" not in a.state.vectors
    r = httpx.delete(
        gw.url + "/admin/tenants/acme",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=10,
    )
    assert r.status_code == 204
    assert not any(k.startswith("acme~") for k in (*a.state.latches, *a.state.vectors))


def test_an_engine_that_hangs_before_the_poller_notices_holds_a_write_seconds_not_minutes(
    start_gateway: Any,
    engines: list[FakeEngine],
    redis_url: str,
    hung_engine_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine still thought healthy that does not answer a cache write is given up
    after ``WRITE_TIMEOUT_S`` (10 s; 0.5 s here) and marked dirty, as for any missed
    write: the vector is stored and installed on the others."""
    monkeypatch.setattr(engine_client, "WRITE_TIMEOUT_S", 0.5)
    a, gw, hung = beside_hung(start_gateway, engines, hung_engine_url, 3600.0)
    key = make_tenant(redis_url, "acme")
    hung.healthy, hung.dirty = True, False  # as if it hung just now
    assert put_vector(gw, key, "v", 0.25).status_code == 201  # timeout=10 s
    assert "acme~v" in a.state.vectors and hung.dirty


# -- sync and the hot path -------------------------------------------------------------


def test_engine_sync_removes_only_what_redis_does_not_hold(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme")
    chat(gateway, key, conversation_id="kept", steering=inline(0.5))
    fake_engine.state.plant_latch("acme~ghost")  # drift: Redis never heard of it
    fake_engine.state.plant_latch("gone~x")  # a tenant that does not exist
    fake_engine.state.plant_latch("direct-caller")  # unscoped: not the gateway's
    svc = gateway.app.state.services
    (engine,) = svc.engines.engines
    assert gateway.call(svc.sync.sync(engine)) is True
    assert set(fake_engine.state.latches) == {"acme~kept", "direct-caller"}


def test_an_ordinary_request_is_one_redis_round_trip_and_a_restore_one_more(
    start_gateway: Any, fake_engine: FakeEngine, redis_url: str
) -> None:
    gw = start_gateway(reconcile_interval_s=3600.0, engine_sync_interval_s=3600.0)
    key = make_tenant(redis_url, "acme")
    svc = gw.app.state.services
    chat(gw, key, conversation_id="c", steering=inline(0.5))
    chat(gw, key)  # warm: key cached, scripts loaded
    settle_sha = svc.scripts.settle_request.sha
    calls: list[tuple[Any, ...]] = []
    original = svc.redis.execute_command

    async def counting(*args: Any, **kw: Any) -> Any:
        calls.append(args)
        return await original(*args, **kw)

    svc.redis.execute_command = counting

    def round_trips(fn: Callable[[], Any]) -> int:
        """Commands a request sends (settlement, batched off the path, and background
        work are not the request's)."""
        gw.call(svc.settler.drain())
        calls.clear()
        fn()
        return sum(1 for c in calls if not (c[0] == "EVALSHA" and c[1] == settle_sha))

    try:
        assert round_trips(lambda: chat(gw, key)) == 1
        assert round_trips(lambda: chat(gw, key, conversation_id="c")) == 1  # bridged
        fake_engine.state.restart()
        # + one read of the latch spec, to restore it
        r: list[httpx.Response] = []
        assert round_trips(lambda: r.append(chat(gw, key, conversation_id="c"))) == 2
        assert r[0].headers["x-steering-latch"] == "restored"
    finally:
        svc.redis.execute_command = original


def test_a_vector_the_engines_registry_evicted_is_reinstalled_from_redis(
    start_gateway: Any, fake_engine: FakeEngine, redis_url: str
) -> None:
    """The engine's registry is a bounded cache (``STEERGATE_MAX_VECTORS``): a vector
    it evicted is installed again, from Redis, when a request names it."""
    gw = start_gateway(**FAST_POLL)
    key = make_tenant(redis_url, "acme")
    fake_engine.state.runtime.registry.max_count = 1
    assert put_vector(gw, key, "a", 0.25).status_code == 201
    steered_by_a = text(chat(gw, key, steering={"vectors": [{"name": "a"}]}))
    assert put_vector(gw, key, "b", -0.5).status_code == 201
    assert set(fake_engine.state.vectors) == {"acme~b"}  # a was evicted
    assert text(chat(gw, key, steering={"vectors": [{"name": "a"}]})) == steered_by_a
    assert "acme~a" in fake_engine.state.vectors
