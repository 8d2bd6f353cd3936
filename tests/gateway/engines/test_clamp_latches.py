"""Latches with clamps (issue 20) through the gateway, against stub engines (the real
endpoint plugin and latch controller) and a real Redis: by value and by reference,
they are stored in Redis with their clamps and restored after an engine restart,
steering bit-identically (the stub answers ``echo <digest of the steering it got>``,
and the digest covers every clamp's direction, bounds and order)."""

from __future__ import annotations

from typing import Any

import httpx

from tests.gateway.conftest import FakeEngine, make_tenant
from tests.gateway.engines.test_durable_state import FAST_POLL, chat, put_vector, text

ADD = {"hook": "post_attn", "layers": {"2": [0.5] * 8}}
CLAMP = {"hook": "post_block", "layers": {"1": [1.0, -2.0] * 4}, "op": "clamp",
         "min": -0.5, "max": 2.0, "strength": 0.75}
ABLATE = {"hook": "pre_attn", "layers": {"3": [0.0, 1.0] * 4}, "op": "ablate"}


def _latched(*terms: dict[str, Any]) -> dict[str, Any]:
    return {"vectors": list(terms), "latch": True}


def test_latches_with_clamps_survive_an_engine_restart(
    start_gateway: Any, fake_engine: FakeEngine, redis_url: str
) -> None:
    gw = start_gateway(**FAST_POLL)
    key = make_tenant(redis_url, "acme")
    assert put_vector(gw, key, "bias", 0.25).status_code == 201
    by_value = text(chat(gw, key, conversation_id="c-val", steering=_latched(ADD, CLAMP, ABLATE)))
    by_ref = text(chat(gw, key, conversation_id="c-ref", steering=_latched(
        ADD, {"name": "bias", "op": "clamp", "max": 1.0})))
    add_only = text(chat(gw, key, steering={"vectors": [ADD]}))
    reordered = text(chat(gw, key, steering={"vectors": [ADD, ABLATE, CLAMP]}))
    assert len({by_value, by_ref, add_only, reordered}) == 4  # clamps and their order count

    fake_engine.state.restart()
    assert fake_engine.state.latches == {}
    for conv, answer in (("c-val", by_value), ("c-ref", by_ref)):
        r = chat(gw, key, conversation_id=conv)
        assert r.headers["x-steering-latch"] == "restored", conv
        assert text(r) == answer, conv
        assert chat(gw, key, conversation_id=conv).headers["x-steering-latch"] == "bridged"
    # A bridged turn steers as the explicit request does.
    assert text(chat(gw, key, steering={"vectors": [ADD, CLAMP, ABLATE]})) == by_value


def test_a_changed_vector_makes_a_clamp_latch_stale(
    start_gateway: Any, fake_engine: FakeEngine, redis_url: str
) -> None:
    gw = start_gateway(**FAST_POLL)
    key = make_tenant(redis_url, "acme")
    assert put_vector(gw, key, "bias", 0.25).status_code == 201
    chat(gw, key, conversation_id="c", steering=_latched({"name": "bias", "op": "ablate"}))
    assert put_vector(gw, key, "bias", -0.5).status_code in (200, 201)
    r = chat(gw, key, conversation_id="c")
    assert r.headers["x-steering-latch"] == "dropped_stale" and text(r) == "echo"


def test_bad_clamps_are_400s_naming_the_field(gateway: Any, redis_url: str) -> None:
    key = make_tenant(redis_url, "acme")
    cases = [
        ({**CLAMP, "min": 3.0}, "steering.vectors[0].min"),
        ({**CLAMP, "strength": 2}, "steering.vectors[0].strength"),
        ({"hook": "post_block", "layers": {"1": [0.0] * 8}, "op": "ablate"},
         "steering.vectors[0].layers.1"),
        ({**ABLATE, "value": 1}, "steering.vectors[0].value"),
    ]
    for term, param in cases:
        body = {"model": "stub", "messages": [{"role": "user", "content": "hi"}],
                "steering": {"vectors": [term]}}
        r = httpx.post(gateway.url + "/v1/chat/completions", json=body,
                       headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    # K cap (4 per point by default): post_block 1 and pre_attn 2 are one point.
    many = [{**ABLATE, "hook": "post_block", "layers": {"1": [float(i + 1), 1.0] * 4}}
            for i in range(3)] + [{**ABLATE, "layers": {"2": [1.0, 0.0] * 4}}] * 2
    body = {"model": "stub", "messages": [{"role": "user", "content": "hi"}],
            "steering": {"vectors": many}}
    r = httpx.post(gateway.url + "/v1/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "steering.vectors"


def test_clamp_directions_count_against_the_latch_bytes_quota(
    gateway: Any, redis_url: str
) -> None:
    """The attack: one add and four clamps at one site, latched. Admission counted the
    latch as one site (32 bytes at hidden 8) while the engine keeps five vectors, so a
    tenant with a 32-byte quota held 160 bytes (the quota read "used 160, limit 32").
    Now admission sizes the latch as the engine stores it: one vector per distinct add
    site, one per clamp direction."""
    add = {"hook": "post_block", "layers": {"1": [0.5] * 8}}
    clamps = [{**CLAMP, "layers": {"1": [float(i + 1), 1.0] * 4}} for i in range(4)]
    body = {"model": "stub", "messages": [{"role": "user", "content": "hi"}],
            "conversation_id": "c", "steering": _latched(add, *clamps)}  # fmt: skip
    key = make_tenant(redis_url, "small", latch_bytes=32, latch_policy="reject")
    headers = {"Authorization": f"Bearer {key}"}
    r = httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 429 and r.json()["error"]["code"] == "latch_quota_exceeded", r.text
    usage = httpx.get(gateway.url + "/v1/usage", headers=headers, timeout=10).json()
    assert usage["quotas"]["latch_bytes"]["used"] == 0

    key = make_tenant(redis_url, "fits", latch_bytes=160, latch_policy="reject")
    headers = {"Authorization": f"Bearer {key}"}
    r = httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 200 and r.headers["x-steering-latch"] == "latched", r.text
    usage = httpx.get(gateway.url + "/v1/usage", headers=headers, timeout=10).json()
    assert usage["quotas"]["latch_bytes"]["used"] == 160
