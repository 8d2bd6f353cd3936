"""The engine plugin's side of issue 9, items 1 and 8, in front of a fake vLLM app (no
engine): ids with a trailing newline, bad numbers and 1,000-deep JSON are 400s in the
contract's shape, and none of it reaches vLLM or changes a latch."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import numpy as np
import pytest

from steergate.shared.gguf import encode_gguf_control_vector
from steergate.shared.jsondepth import json_too_deep
from tests.engine.test_engine_http_unit import AUTH, HIDDEN, LAYERS, chat, make_app


@asynccontextmanager
async def engine() -> AsyncIterator[tuple[httpx.AsyncClient, list[dict[str, Any]], Any]]:
    app, seen, plugin = await make_app()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://e") as client:
        yield client, seen, plugin


def error(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code", "request_id"}
    return dict(body["error"])


def deep(depth: int = 1000) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/responses"),  # one of vLLM's own JSON routes
        ("PUT", "/v1/steering/vectors/a~calm"),
    ],
)
async def test_json_nested_1000_deep_is_a_400_invalid_json(method: str, path: str) -> None:
    """Python's json raised RecursionError (a 500) on this before."""
    async with engine() as (client, seen, plugin):
        for raw in (deep(), b'{"model":"m","steering":' + deep() + b"}"):
            r = await client.request(
                method, path, content=raw, headers={**AUTH, "content-type": "application/json"}
            )
            assert (error(r)["code"], error(r)["param"]) == ("invalid_json", "body")
        assert seen == [] and plugin.runtime.get().controller.list() == []


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/chat/completions"), ("PUT", "/v1/steering/vectors/a~calm")],
)
@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16", "utf-32-be"])
async def test_json_in_utf16_or_utf32_is_a_400_not_a_500(
    method: str, path: str, encoding: str
) -> None:
    """The attack: 3,000 levels in UTF-16, with a string holding U+5C00 (the bytes
    ``00 5c`` in UTF-16-LE: a backslash to a scan of UTF-8), which hid every bracket
    after it from the depth bound; Python's json read the UTF-16 and raised
    RecursionError, a 500."""
    raw = ('["\u5c00",' * 3000 + "1" + "]" * 3000).encode(encoding)
    plain = '{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'.encode(encoding)
    async with engine() as (client, seen, plugin):
        for body in (raw, plain):
            r = await client.request(
                method, path, content=body, headers={**AUTH, "content-type": "application/json"}
            )
            assert (error(r)["code"], error(r)["param"]) == ("invalid_json", "body")
            assert "UTF-8" in error(r)["message"]
        assert seen == [] and plugin.runtime.get().controller.list() == []


async def test_the_depth_bound_runs_after_the_token_check() -> None:
    async with engine() as (client, _, _):
        r = await client.post("/v1/chat/completions", content=deep())
        assert r.status_code == 401


async def test_a_gguf_upload_is_not_scanned_as_json() -> None:
    """Binary bodies are full of bracket bytes; they must pass the bound untouched."""
    # Every float is the bytes "[[[[" (about 6.2e16, finite): 128 "[" in a row.
    vec = np.frombuffer(b"[" * 4 * HIDDEN, dtype=np.float32)
    raw = encode_gguf_control_vector({layer: vec for layer in range(LAYERS)})
    assert json_too_deep(raw)
    async with engine() as (client, _, _):
        r = await client.put(
            "/v1/steering/vectors/a~g",
            content=raw,
            headers={**AUTH, "content-type": "application/octet-stream"},
        )
        assert r.status_code == 201, r.text


def steer(layers: dict[str, Any] | None = None, **term: Any) -> dict[str, Any]:
    layers = layers if layers is not None else {"1": [0.5] * HIDDEN}
    return {"vectors": [{"hook": "post_block", "layers": layers, **term}], "latch": True}


@pytest.mark.parametrize(
    ("steering", "param"),
    [
        (steer(scale=1e300), "steering.vectors[0].scale"),
        (steer(scale=10**400), "steering.vectors[0].scale"),
        (steer({"1": [3e38] * HIDDEN}, scale=2), "steering.vectors[0].scale"),
        (steer({"²": [0.5] * HIDDEN}), "steering.vectors[0].layers.²"),
        (steer({"١": [0.5] * HIDDEN}), "steering.vectors[0].layers.١"),
        (steer({"1": [10**400] * HIDDEN}), "steering.vectors[0].layers.1"),
    ],
)
async def test_bad_numbers_are_a_400_and_store_no_latch(
    steering: dict[str, Any], param: str
) -> None:
    async with engine() as (client, seen, plugin):
        body = chat(conversation_id="a~c1", steering=steering)
        r = await client.post("/v1/chat/completions", json=body, headers=AUTH)
        assert error(r)["param"] == param
        assert r.headers["x-steering-latch"] == "none"
        assert seen == [] and plugin.runtime.get().controller.list() == []


async def test_trailing_newline_ids_are_refused_by_the_engine_too() -> None:
    """The engine's own checks, for a caller that is not the gateway."""
    async with engine() as (client, seen, _):
        body = chat(conversation_id="a~chat-1\n", steering=steer())
        r = await client.post("/v1/chat/completions", json=body, headers=AUTH)
        assert error(r)["code"] == "invalid_conversation_id"
        for path in ("/v1/steering/vectors/a~calm%0A", "/v1/steering/vectors/a~calm%20"):
            put = await client.put(
                path, json={"hook": "post_block", "layers": {"1": [0.5] * HIDDEN}}, headers=AUTH
            )
            assert error(put)["code"] == "invalid_vector_name"
        r = await client.delete("/v1/steering/latches/a~chat-1%0A", headers=AUTH)
        assert error(r)["code"] == "invalid_conversation_id"
        assert seen == []


async def test_a_sum_or_named_term_that_overflows_float32_is_a_400_and_stores_no_latch() -> None:
    """Each term is finite, yet their sum (or a stored vector times its scale) is Inf."""
    big = [3e38] * HIDDEN
    two_terms = {
        "vectors": [{"hook": "post_block", "layers": {"1": big}} for _ in range(2)],
        "latch": True,
    }
    named = {"vectors": [{"name": "a~big", "scale": 2}], "latch": True}
    async with engine() as (client, seen, plugin):
        put = await client.put(
            "/v1/steering/vectors/a~big",
            json={"hook": "post_block", "layers": {"1": big}},
            headers=AUTH,
        )
        assert put.status_code == 201, put.text
        for steering in (two_terms, named):
            body = chat(conversation_id="a~c1", steering=steering)
            r = await client.post("/v1/chat/completions", json=body, headers=AUTH)
            assert error(r)["param"] == "steering.vectors" and "overflows" in error(r)["message"]
        assert seen == [] and plugin.runtime.get().controller.list() == []


async def test_steering_that_overflows_at_a_shared_point_of_the_stream_is_a_400() -> None:
    """``post_block`` 1 and ``pre_attn`` 2 are one point of the stream: the worker sums
    them into one table row. Two terms of 3e38, one at each, were each finite and
    accepted, and the row was inf (the request's hidden states, then NaN). The bound
    is now 1e6 per point (shared.steering.SteeringBound): 6e5 at each is 1.2e6 there."""
    big = [6e5] * HIDDEN
    steering = {
        "vectors": [
            {"hook": "post_block", "layers": {"1": big}},
            {"hook": "pre_attn", "layers": {"2": big}},
        ],
        "latch": True,
    }
    async with engine() as (client, seen, plugin):
        r = await client.post(
            "/v1/chat/completions",
            json=chat(conversation_id="a~c1", steering=steering),
            headers=AUTH,
        )
        err = error(r)
        assert err["param"] == "steering.vectors" and "pre_attn layer 2" in err["message"]
        assert seen == [] and plugin.runtime.get().controller.list() == []
        # apart, at points of their own (pre_attn 3 is post_block 2), both are fine
        steering["vectors"][1]["layers"] = {"3": big}
        body = chat(conversation_id="a~c1", steering=steering)
        r = await client.post("/v1/chat/completions", json=body, headers=AUTH)
        assert r.status_code == 200, r.text


async def test_steering_beyond_a_float16_models_range_is_a_400() -> None:
    """On a float16 model the tables hold the steering in float16: 1e5 (finite in
    float32) became inf there. Every point of the stream at once (9 in this 4-layer
    model) stays within half of float16's range: 65504 / 18 = 3639 per point, for the
    summed steering and for a clamp's bounds."""
    async with engine() as (client, seen, plugin):
        plugin.runtime.get().dtype = "float16"
        assert plugin.runtime.get().bound.limit == 65504.0 / 18
        refused = [
            {"vectors": [{"hook": "post_block", "layers": {"1": [1e5] * HIDDEN}}]},
            {"vectors": [{"hook": "post_block", "layers": {"1": [2e3] * HIDDEN}}] * 2},
            {"vectors": [{"hook": "post_block", "layers": {"1": [1.0] * HIDDEN},
                          "op": "clamp", "value": 1e5}]},
        ]  # fmt: skip
        for steering in refused:
            r = await client.post(
                "/v1/chat/completions", json=chat(steering=steering), headers=AUTH
            )
            err = error(r)
            assert err["param"] == "steering.vectors" and "float16" in err["message"], steering
        assert seen == []
        fits = {"vectors": [{"hook": "post_block", "layers": {"1": [3.6e3] * HIDDEN}}]}
        r = await client.post("/v1/chat/completions", json=chat(steering=fits), headers=AUTH)
        assert r.status_code == 200, r.text


async def test_steering_at_many_points_that_would_overflow_the_stream_is_a_400() -> None:
    """Found from outside: scale 3e38 on unit-sized vectors at pre_attn and post_attn of
    every layer was within float32 at each point, so it was accepted; the stream summed
    to inf, and the NaN hidden states reached KV-cache blocks that the next requests,
    other tenants' included, were given (their unsteered answers came back empty). Each
    point now takes at most 1e6 per element, so all of them together stay finite."""
    layers = {str(i): [1.0] * HIDDEN for i in range(LAYERS)}
    attack = {"vectors": [{"hook": hook, "layers": layers, "scale": 3e38}
                          for hook in ("pre_attn", "post_attn")]}  # fmt: skip
    async with engine() as (client, seen, plugin):
        r = await client.post("/v1/chat/completions", json=chat(steering=attack), headers=AUTH)
        err = error(r)
        assert err["param"] == "steering.vectors", err
        assert "this float32 model takes at most 1e+06 per point" in err["message"], err
        assert seen == []
        for term in attack["vectors"]:
            term["scale"] = 1e6  # the bound itself is served
        r = await client.post("/v1/chat/completions", json=chat(steering=attack), headers=AUTH)
        assert r.status_code == 200, r.text


def test_the_served_dtype_is_read_from_vllms_model_config() -> None:
    from types import SimpleNamespace

    import torch

    from steergate.engine.http.plugin import dtype_name

    for dtype, name in ((torch.float16, "float16"), (torch.bfloat16, "bfloat16"),
                        (torch.float32, "float32"), (torch.float64, "float32")):  # fmt: skip
        assert dtype_name(SimpleNamespace(dtype=dtype)) == name
