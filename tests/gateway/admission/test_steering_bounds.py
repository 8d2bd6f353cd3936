"""Issue 23, defect 2: what one request's steering may make the gateway compute is
bounded before any of it is computed (``steering_too_large``, naming the term, before
admission), the bound fits a real model, and bodies parsed in the worker processes
are answered exactly as bodies parsed on the event loop."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import numpy as np
import pytest

from steergate.gateway.admission import request_shape
from steergate.gateway.admission.bodies import OFF_LOOP_BYTES, BodyParser, parse_in_worker
from steergate.gateway.admission.request_scoping import InlineBudget, prescan
from steergate.shared.errors import InvalidField
from steergate.shared.steering import ModelShape, parse_steering
from tests.gateway.conftest import FakeEngine, make_tenant
from tests.gateway.servers import ServerThread

CHAT = "/v1/chat/completions"
HIDDEN = 8


def chat(steering: dict[str, Any], pad: int = 0, **extra: Any) -> dict[str, Any]:
    """A chat body; ``pad`` characters of prompt make it a large body."""
    return {
        "model": "fake",
        "messages": [{"role": "user", "content": "hi " + "x" * pad}],
        "max_tokens": 4,
        "steering": steering,
        **extra,
    }


def term(layers: int, width: int, first: int = 0) -> dict[str, Any]:
    return {
        "hook": "post_block",
        "layers": {str(first + i): [0.25] * width for i in range(layers)},
    }


def post(gw: ServerThread, key: str, body: Any) -> httpx.Response:
    return httpx.post(
        gw.url + CHAT, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )


def test_a_term_past_its_inline_budget_is_refused_by_name_before_admission(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme", rpm=1)
    steering = {"vectors": [term(1, HIDDEN), term(2, 20_000)]}  # 40,000 > 32,768
    for _ in range(3):
        r = post(gateway, key, chat(steering))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["code"], err["param"]) == ("steering_too_large", "steering.vectors[1].layers")
        assert "per term" in err["message"] and "'packed'" in err["message"]
        assert "named vector" in err["message"]
    assert fake_engine.state.requests == []
    # rpm 1 was never spent by the refusals: the one request it allows is served.
    assert post(gateway, key, chat({"vectors": [term(1, HIDDEN)]})).status_code == 200


def test_terms_within_their_budget_past_the_requests_are_refused_at_the_one_that_crosses(
    gateway: ServerThread, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme")
    steering = {"vectors": [term(1, 30_000), term(1, 30_000, 1), term(1, 30_000, 2)]}
    r = post(gateway, key, chat(steering))
    err = r.json()["error"]
    assert r.status_code == 400
    assert (err["code"], err["param"]) == ("steering_too_large", "steering.vectors[2].layers")
    assert "per request (60,000 in earlier terms)" in err["message"]


def test_the_default_budget_fits_four_layers_per_term_and_eight_per_request_at_8192() -> None:
    """A legitimate inline use for a model of hidden size 8192 passes both the bound and
    the model's validation; one number more per term or per request does not."""
    shape = ModelShape(hidden_size=8192, num_layers=32)
    body = chat({"vectors": [term(4, 8192), term(4, 8192, 4)]})
    prescan(body)
    parsed = parse_steering(body["steering"], shape)
    assert sum(len(t.layers) for t in parsed.terms) == 8
    body["steering"]["vectors"][0]["layers"]["0"].append(0.25)
    with pytest.raises(InvalidField) as exc:
        prescan(body)
    assert exc.value.param == "steering.vectors[0].layers"
    three = chat({"vectors": [term(4, 8192), term(4, 8192, 4), term(1, 1, 8)]})
    with pytest.raises(InvalidField) as exc:
        prescan(three)
    assert exc.value.param == "steering.vectors[2].layers"
    assert exc.value.code == "steering_too_large"


def test_a_custom_budget_is_what_prescan_enforces() -> None:
    body = chat({"vectors": [term(2, 10)]})
    prescan(body, InlineBudget(per_term=20, per_request=20))
    with pytest.raises(InvalidField):
        prescan(body, InlineBudget(per_term=19, per_request=100))
    with pytest.raises(InvalidField):
        prescan(body, InlineBudget(per_term=100, per_request=19))


@pytest.mark.parametrize(
    "steering",
    [
        {"vectors": [term(1, HIDDEN)]},
        {"vectors": [{"hook": "post_block", "layers": {"1": [0.5] * HIDDEN}, "scale": 2}]},
    ],
)
def test_a_large_body_parsed_in_a_worker_is_steered_like_a_small_one(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str, steering: dict[str, Any]
) -> None:
    key = make_tenant(redis_url, "acme")
    small = post(gateway, key, chat(steering))
    large = post(gateway, key, chat(steering, pad=OFF_LOOP_BYTES + 1000))
    assert small.status_code == large.status_code == 200, large.text
    said = [r.json()["choices"][0]["message"]["content"] for r in (small, large)]
    assert said[0] == said[1] and said[0].startswith("echo ")  # the same steering digest
    assert fake_engine.state.requests[-1]["steering"] == steering


@pytest.mark.parametrize(
    ("bad", "param"),
    [
        ({"1": [0.5] * (HIDDEN - 1) + [True]}, "steering.vectors[0].layers.1"),
        ({"1": [0.5] * (HIDDEN - 1) + ["x"]}, "steering.vectors[0].layers.1"),
        ({"1": [0.5] * (HIDDEN + 1)}, "steering.vectors[0].layers.1"),
        ({"9": [0.5] * HIDDEN}, "steering.vectors[0].layers.9"),
        ({"1": [0.5] * (HIDDEN - 1) + [1e39]}, "steering.vectors[0].layers.1"),
    ],
)
def test_a_large_bad_body_gets_the_same_400_as_a_small_one(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str, bad: Any, param: str
) -> None:
    key = make_tenant(redis_url, "acme")
    steering = {"vectors": [{"hook": "post_block", "layers": bad}]}
    errors = []
    for pad in (0, OFF_LOOP_BYTES + 1000):
        r = post(gateway, key, chat(steering, pad=pad))
        assert r.status_code == 400, r.text
        errors.append({k: v for k, v in r.json()["error"].items() if k != "request_id"})
    assert errors[0] == errors[1] and errors[0]["param"] == param
    assert fake_engine.state.requests == []


def test_a_large_body_with_several_faults_gets_the_small_ones_first_error(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    """The worker checks a large body in the route's order (prescan, the request's shape,
    then its steering), so which fault is named does not depend on the body's size."""
    key = make_tenant(redis_url, "acme")
    steering = {"vectors": [{"hook": "post_block", "layers": {"0": [0.25] * 3}}]}  # wrong width
    errors = []
    for pad in (0, OFF_LOOP_BYTES + 1000):
        body = chat(steering, pad=pad)
        body["messages"].append({"role": 5, "content": "x"})
        r = post(gateway, key, body)
        assert r.status_code == 400, r.text
        errors.append({k: v for k, v in r.json()["error"].items() if k != "request_id"})
    assert errors[0] == errors[1] and errors[0]["param"] == "messages[1].role", errors
    assert fake_engine.state.requests == []


def test_a_large_latch_keeps_the_steering_the_worker_validated(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme")
    steering = {"vectors": [term(2, HIDDEN)], "latch": True}
    r = post(gateway, key, chat(steering, pad=OFF_LOOP_BYTES + 1000, conversation_id="c1"))
    assert r.status_code == 200 and r.headers["x-steering-latch"] == "latched", r.text
    body = chat({}, conversation_id="c1")
    del body["steering"]  # the next turn carries none: the latch steers it
    r2 = post(gateway, key, body)
    assert r2.status_code == 200 and r2.headers["x-steering-latch"] == "bridged", r2.text
    assert (
        r2.json()["choices"][0]["message"]["content"]
        == r.json()["choices"][0]["message"]["content"]
    )


def test_the_worker_answers_errors_as_data_and_bodies_with_their_steering() -> None:
    budget = InlineBudget()
    shape = ModelShape(HIDDEN, 4)
    ok = parse_in_worker(b'{"steering": {"vectors": [%s]}}' % _json(term(1, HIDDEN)), shape, budget)
    assert ok[0] == "ok" and isinstance(ok[2].terms[0].layers[0], np.ndarray)
    assert ok[3].steered and ok[3].latch_vectors == 0  # prescan's head, read once, there
    assert parse_in_worker(b"[1]", shape, budget)[0:2] == ("error", "body")
    assert parse_in_worker(b'{"a": ', shape, budget)[3] == "invalid_json"
    too_many = b'{"steering": {"vectors": [%s]}}' % _json(term(1, 40_000))
    assert parse_in_worker(too_many, shape, budget)[3] == "steering_too_large"
    bad_role = b'{"messages": [{"role": 5}]}'
    assert parse_in_worker(bad_role, shape, budget)[0] == "ok"
    refused = parse_in_worker(bad_role, shape, budget, request_shape.check_chat)
    assert refused[:2] == ("error", "messages[0].role")


def _json(obj: Any) -> bytes:
    import orjson

    return orjson.dumps(obj)


def test_a_tenants_large_bodies_wait_for_each_other_not_for_other_tenants() -> None:
    async def scenario() -> list[str]:
        parser = BodyParser(workers=0, budget=InlineBudget())
        events: list[str] = []
        release = asyncio.Event()

        async def hold(tenant: str, name: str) -> None:
            async with parser._turns.turn(tenant):
                events.append(f"{name} in")
                if name == "a1":
                    await release.wait()
                events.append(f"{name} out")

        a1 = asyncio.create_task(hold("a", "a1"))
        a2 = asyncio.create_task(hold("a", "a2"))
        await asyncio.sleep(0.01)
        await hold("b", "b1")  # not behind a's turn
        release.set()
        await asyncio.gather(a1, a2)
        assert len(parser._turns) == 0  # nothing kept per tenant once idle
        return events

    events = asyncio.run(scenario())
    assert events == ["a1 in", "b1 in", "b1 out", "a1 out", "a2 in", "a2 out"]


@pytest.mark.parametrize(
    ("layers", "status", "param"),
    [
        ({"1": [0.5] * HIDDEN}, 201, None),
        ({"1": [0.5] * (HIDDEN - 1) + [False]}, 400, "layers.1"),
        ({"1": [0.5] * (HIDDEN + 1)}, 400, "layers.1"),
    ],
)
def test_a_large_vector_upload_parsed_in_a_worker_is_answered_like_a_small_one(
    gateway: ServerThread, redis_url: str, layers: Any, status: int, param: str | None
) -> None:
    """Whitespace makes the same upload a large body (valid JSON, parsed in a worker)."""
    key = make_tenant(redis_url, "acme")
    answers = []
    for i, pad in enumerate((0, OFF_LOOP_BYTES + 1000)):
        r = httpx.put(
            gateway.url + f"/v1/steering/vectors/v{i}",
            content=_json({"hook": "post_block", "layers": layers}) + b" " * pad,
            headers={"Authorization": f"Bearer {key}", "content-type": "application/json"},
        )
        assert r.status_code == status, r.text
        doc = r.json()
        answers.append(doc["digest"] if status == 201 else doc["error"]["message"])
        if param:
            assert doc["error"]["param"] == param
    assert answers[0] == answers[1]


def test_a_dead_worker_fails_its_request_with_500_and_the_next_large_body_is_served() -> None:
    import os

    from steergate.shared.errors import APIError

    async def scenario() -> None:
        parser = BodyParser(workers=1, budget=InlineBudget())
        try:
            with pytest.raises(APIError) as exc:
                await parser._call("acme", os._exit, 1)  # the worker dies mid-request
            assert exc.value.code == "internal_error"
            raw = _json(chat({"vectors": [term(1, HIDDEN)]})) + b" " * OFF_LOOP_BYTES
            parsed = await parser.parse(raw, "acme", ModelShape(HIDDEN, 4))
            assert parsed.steering is not None and parsed.body["max_tokens"] == 4
        finally:
            parser.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "terms",
    [
        [{"hook": "post_block", "layers": {"1": [0.5] * 8}}],
        # the same site twice: summed into one vector
        [{"hook": "post_block", "layers": {"1": [0.5] * 8}}] * 2,
        # clamps and ablations: one vector per direction, never merged
        [{"hook": "post_block", "layers": {"1": [0.5] * 8}}]
        + [{"hook": "post_block", "layers": {"1": [1.0] * 8}, "op": "clamp", "max": 1.0}] * 4,
        [{"hook": "pre_attn", "layers": {"2": [1.0] * 8, "3": [2.0] * 8}, "op": "ablate"},
         {"hook": "post_attn", "layers": {"1": [1.0] * 8, "2": [1.0] * 8}}],
        [{"name": "bias"}, {"name": "bias", "op": "clamp", "max": 1.0}],  # by reference
    ],
)
def test_admission_sizes_a_latch_as_the_engine_stores_it(terms: list[dict[str, Any]]) -> None:
    """The quota is checked at admission against ``Head.latch_bytes``; the engine keeps
    ``inline_latch_bytes`` (recorded after the turn, unchecked): the two must agree."""
    shape = ModelShape(hidden_size=8, num_layers=4)
    body = {"steering": {"vectors": terms, "latch": True}, "conversation_id": "c"}
    head = prescan(body)
    stored = parse_steering(body["steering"], shape).inline_latch_bytes(shape.hidden_size)
    assert head.latch_bytes(shape) == stored
