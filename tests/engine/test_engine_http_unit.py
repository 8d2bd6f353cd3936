"""The engine's HTTP plugin in front of a fake vLLM app (no engine): auth, every
contract 400, the request rewrite, latch headers/objects, routes, and SSE passthrough."""

from __future__ import annotations

import asyncio
import base64
import json
import math
from argparse import Namespace
from collections.abc import AsyncIterator, MutableMapping
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import SecretStr

from steergate.engine.http.plugin import SteeringEndpointPlugin
from steergate.engine.http.rewrite import MAX_CACHE_SALT, SteeringRewriteMiddleware, salted
from steergate.engine.http.runtime import RuntimeRef, SteeringRuntime
from steergate.engine.payload import decode_payload, steering_digest
from steergate.shared.codecs import encode_packed
from steergate.shared.gguf import encode_gguf_control_vector
from steergate.shared.settings import EngineSettings
from steergate.shared.steering import ModelShape

TOKEN = "unit-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HIDDEN, LAYERS = 8, 4


class FakeModelConfig:
    architectures = ["LlamaForCausalLM"]  # config.json's
    architecture = "LlamaForCausalLM"  # the vLLM class serving it

    def get_hidden_size(self) -> int:
        return HIDDEN

    def get_total_num_hidden_layers(self) -> int:
        return LAYERS


FAKE_ENGINE = SimpleNamespace(vllm_config=SimpleNamespace(model_config=FakeModelConfig()))


def fake_vllm() -> tuple[FastAPI, list[dict[str, Any]]]:
    """Stands in for vLLM's routes: records what it received, echoes it back."""
    app = FastAPI()
    seen: list[dict[str, Any]] = []

    async def completion(request: Request) -> Any:
        body = await request.json()
        assert int(request.headers["content-length"]) == len(await request.body())
        seen.append(body)
        if body.get("fail"):
            return JSONResponse(
                {"error": {"message": "bad", "type": "x", "param": None, "code": "x"}}, 400
            )
        if body.get("stream"):

            async def events() -> AsyncIterator[bytes]:
                for i in range(3):
                    yield f'data: {{"i": {i}}}\n\n'.encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse({"id": "cmpl-1", "object": "chat.completion", "choices": []})

    app.post("/v1/chat/completions")(completion)
    app.post("/v1/completions")(completion)
    app.post("/v1/responses")(completion)
    app.post("/inference/v1/generate")(completion)  # token in, token out (scale-out)
    app.get("/health")(lambda: JSONResponse({}))
    return app, seen


async def make_app(**settings: Any) -> tuple[FastAPI, list[dict[str, Any]], SteeringEndpointPlugin]:
    app, seen = fake_vllm()
    plugin = SteeringEndpointPlugin(EngineSettings(engine_token=SecretStr(TOKEN), **settings))
    plugin.attach_router(app)
    await plugin.init_state(
        FAKE_ENGINE, app.state, Namespace(model="/models/tiny", served_model_name=None)
    )
    return app, seen, plugin


@pytest.fixture()
async def env() -> AsyncIterator[
    tuple[httpx.AsyncClient, list[dict[str, Any]], SteeringEndpointPlugin]
]:
    app, seen, plugin = await make_app()
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://e"
    ) as client:
        yield client, seen, plugin


def vec(value: float) -> list[float]:
    return [value] * HIDDEN


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def inline(
    layer: int = 1, value: float = 0.5, scale: float = 1.0, hook: str = "post_block"
) -> dict[str, Any]:
    return {"hook": hook, "layers": {str(layer): vec(value)}, "scale": scale}


def payload_of(body: dict[str, Any]):
    return decode_payload(body["vllm_xargs"]["steergate"])


# -- auth ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/steering/info", "/health"])
async def test_every_path_needs_the_engine_token(env, path: str) -> None:
    client, _, _ = env
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        r = await client.get(path, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.json()["error"]["type"] == "authentication_error"
    assert (await client.get(path, headers={"Authorization": f"bearer {TOKEN}"})).status_code == 200


async def test_a_repeated_authorization_header_is_401_whatever_the_copies_hold(env) -> None:
    """Found from outside: the first of two Authorization headers won (valid then wrong
    was 200), while a proxy in front may read the last. A repeated one is no token."""
    client, seen, _ = env
    for pair in ((TOKEN, TOKEN), (TOKEN, "wrong"), ("wrong", TOKEN)):
        headers = [("Authorization", f"Bearer {pair[0]}"), ("Authorization", f"Bearer {pair[1]}")]
        r = await client.post("/v1/chat/completions", json=chat(), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", pair
    assert seen == []


async def test_a_vector_body_past_what_the_model_can_hold_is_413_unread(env) -> None:
    """Found from outside: a 60 MB vector PUT was read whole and parsed on the event
    loop (every other request stalled 2 s) before its 400. A body past every layer once
    (``max_vector_body``) is refused as soon as it passes that, declared or streamed."""
    from steergate.engine.http.routes import max_vector_body
    from steergate.shared.steering import ModelShape

    client, _, plugin = env
    limit = max_vector_body(ModelShape(HIDDEN, LAYERS))
    big = b'{"hook": "post_block", "layers": {"1": [' + b"0.5, " * limit + b"0.5]}}"

    async def streamed():  # no content-length: chunked
        for i in range(0, len(big), 65_536):
            yield big[i:i + 65_536]

    for content in (big, streamed()):
        r = await client.put("/v1/steering/vectors/a~big", content=content,
                             headers={**AUTH, "content-type": "application/json"})  # fmt: skip
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large"
    assert plugin.runtime.get().registry.get("a~big") is None
    full = {"hook": "post_block", "layers": {str(i): [0.123456789] * HIDDEN for i in range(LAYERS)}}
    r = await client.put("/v1/steering/vectors/a~big", json=full, headers=AUTH)
    assert r.status_code == 201, r.text


async def test_completion_without_token_is_401_and_never_reaches_vllm(env) -> None:
    client, seen, _ = env
    r = await client.post("/v1/chat/completions", json=chat())
    assert r.status_code == 401 and seen == []


async def test_engine_refuses_to_start_without_token() -> None:
    app, _ = fake_vllm()
    plugin = SteeringEndpointPlugin(EngineSettings(engine_token=None))
    plugin.attach_router(app)
    with pytest.raises(RuntimeError, match="STEERGATE_ENGINE_TOKEN"):
        await plugin.init_state(FAKE_ENGINE, app.state, Namespace(model="m"))


async def test_more_than_one_api_server_is_refused() -> None:
    app, _ = fake_vllm()
    plugin = SteeringEndpointPlugin(EngineSettings(engine_token=SecretStr(TOKEN)))
    plugin.attach_router(app)
    with pytest.raises(RuntimeError, match="api-server-count"):
        await plugin.init_state(FAKE_ENGINE, app.state, Namespace(model="m", api_server_count=2))


# -- info / status ---------------------------------------------------------------------


async def test_info_and_status(env) -> None:
    client, _, _ = env
    info = (await client.get("/v1/steering/info", headers=AUTH)).json()
    assert info["model"] == "/models/tiny"
    assert (info["hidden_size"], info["num_layers"]) == (HIDDEN, LAYERS)
    assert info["hooks"] == ["pre_attn", "post_attn", "post_block"]
    assert info["max_latched_conversations"] == 1024 and info["max_latched_bytes"] == 268435456
    status = (await client.get("/v1/steering/status", headers=AUTH)).json()
    assert status["epoch"] == info["epoch"] and status["latched_conversations"] == 0


async def test_epoch_changes_per_start() -> None:
    (_, _, a), (_, _, b) = await make_app(), await make_app()
    assert a.runtime.get().epoch != b.runtime.get().epoch


# -- 400s ------------------------------------------------------------------------------

BAD = [
    (
        {"steering": {"vectors": [inline(hook="mid_block")]}},
        "steering.vectors[0].hook",
        "invalid_request",
    ),
    (
        {"steering": {"vectors": [inline(layer=LAYERS)]}},
        f"steering.vectors[0].layers.{LAYERS}",
        "invalid_request",
    ),
    (
        {"steering": {"vectors": [{"hook": "post_block", "layers": {"0": [1.0] * (HIDDEN - 1)}}]}},
        "steering.vectors[0].layers.0",
        "invalid_request",
    ),
    (
        {"steering": {"vectors": [{"name": "missing"}]}},
        "steering.vectors[0].name",
        "unknown_vector",
    ),
    (
        {
            "steering": {
                "vectors": [
                    {
                        "hook": "post_attn",
                        "packed": {
                            "dtype": "float32",
                            "shape": [1, HIDDEN],
                            "layer_indices": [0],
                            "data": "!!not base64!!",
                        },
                    }
                ]
            }
        },
        "steering.vectors[0].packed.data",
        "invalid_request",
    ),
    (
        {
            "steering": {
                "vectors": [
                    {
                        "hook": "post_attn",
                        "packed": {
                            "dtype": "float32",
                            "shape": [2, HIDDEN],
                            "layer_indices": [0, 1],
                            "data": base64.b64encode(b"\0" * 4 * HIDDEN).decode(),
                        },
                    }
                ]
            }
        },
        "steering.vectors[0].packed.data",
        "invalid_request",
    ),
    ({"steering": {"vectors": [inline()] * 257}}, "steering.vectors", "invalid_request"),
    (
        {"steering": {"vectors": [inline()], "latch": True}},
        "steering.latch",
        "latch_without_conversation_id",
    ),
    (
        {"steering": {"vectors": [inline()], "phase": "sometimes"}},
        "steering.phase",
        "invalid_request",
    ),
    ({"conversation_id": "has space"}, "conversation_id", "invalid_conversation_id"),
    ({"conversation_id": "x" * 257}, "conversation_id", "invalid_conversation_id"),
    ({"conversation_id": 7}, "conversation_id", "invalid_conversation_id"),
    ({"steering": "calm"}, "steering", "invalid_request"),
]


@pytest.mark.parametrize(("extra", "param", "code"), BAD, ids=[b[1] + ":" + b[2] for b in BAD])
async def test_invalid_steering_is_400_naming_the_field(env, extra, param: str, code: str) -> None:
    client, seen, plugin = env
    r = await client.post("/v1/chat/completions", json=chat(**extra), headers=AUTH)
    assert r.status_code == 400
    assert r.json() == {
        "error": {
            "message": r.json()["error"]["message"],
            "type": "invalid_request_error",
            "param": param,
            "code": code,
            "request_id": r.headers["x-request-id"],
        }
    }
    assert param in r.json()["error"]["message"]
    assert r.headers["x-steering-latch"] == "none"
    assert seen == []  # vLLM never saw it
    assert plugin.runtime.get().controller.count == 0


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity"])
async def test_nan_and_inf_are_400(env, bad: str) -> None:
    client, seen, _ = env
    values = ", ".join(["0.5"] * (HIDDEN - 1) + [bad])
    # Python's json accepts these bare tokens; the parser must still refuse them.
    term = '{"hook": "pre_attn", "layers": {"2": [' + values + "]}}"
    raw = '{"model": "m", "prompt": "x", "steering": {"vectors": [' + term + "]}}"
    r = await client.post(
        "/v1/completions", content=raw, headers={**AUTH, "content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "steering.vectors[0].layers.2"
    assert seen == []


async def test_inf_in_packed_data_is_400(env) -> None:
    client, _, _ = env
    packed = encode_packed(np.array([vec(math.inf)], dtype=np.float32), [0])
    r = await client.post(
        "/v1/chat/completions",
        headers=AUTH,
        json=chat(steering={"vectors": [{"hook": "post_block", "packed": packed}]}),
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "steering.vectors[0].packed.data"


async def test_rejected_latch_request_keeps_the_earlier_latch(env) -> None:
    client, _, plugin = env
    await client.post(
        "/v1/chat/completions",
        headers=AUTH,
        json=chat(conversation_id="c", steering={"vectors": [inline()], "latch": True}),
    )
    r = await client.post(
        "/v1/chat/completions",
        headers=AUTH,
        json=chat(
            conversation_id="c",
            steering={"vectors": [inline(), {"name": "missing"}], "latch": True},
        ),
    )
    assert r.status_code == 400
    assert plugin.runtime.get().controller.get("c") is not None


# -- rewrite ----------------------------------------------------------------------------


async def test_unsteered_request_passes_with_none_and_applied_false(env) -> None:
    client, seen, _ = env
    r = await client.post("/v1/chat/completions", json=chat(cache_salt="s"), headers=AUTH)
    assert r.status_code == 200
    assert r.headers["x-steering-latch"] == "none"
    assert r.json()["steering"] == {"applied": False, "latch": "none"}
    assert int(r.headers["content-length"]) == len(r.content)
    assert seen == [chat(cache_salt="s")]


async def test_steered_request_is_rewritten_for_vllm(env) -> None:
    client, seen, _ = env
    steering = {
        "vectors": [inline(1, 0.5, 2.0), inline(1, 0.25), inline(2, 1.0, hook="pre_attn")],
        "phase": "decode",
    }
    r = await client.post(
        "/v1/completions",
        headers=AUTH,
        json={
            "model": "m",
            "prompt": "x",
            "cache_salt": "client",
            "conversation_id": "c1",
            "steering": steering,
            "vllm_xargs": {"other": 1, "steergate": "forged"},
        },
    )
    assert r.json()["steering"] == {"applied": True, "latch": "none"}
    body = seen[0]
    assert "steering" not in body and "conversation_id" not in body
    assert body["vllm_xargs"]["other"] == 1
    p = payload_of(body)
    assert p.phase == "decode"
    assert set(p.sites) == {("post_block", 1), ("pre_attn", 2)}
    np.testing.assert_array_equal(p.sites[("post_block", 1)], np.full(HIDDEN, 1.25, np.float32))
    # phase decode: the salt also covers the prompt (tests/engine/test_prefix_salt.py)
    assert body["cache_salt"] == salted("client", p.digest, "decode", body)
    assert p.digest == steering_digest("decode", p.sites)


async def test_forged_payload_is_stripped_from_unsteered_requests(env) -> None:
    client, seen, _ = env
    await client.post(
        "/v1/chat/completions",
        headers=AUTH,
        json=chat(vllm_xargs={"steergate": "forged", "keep": "y"}),
    )
    await client.post(
        "/v1/responses", headers=AUTH, json={"input": "x", "vllm_xargs": {"steergate": "f"}}
    )
    assert seen[0]["vllm_xargs"] == {"keep": "y"} and "cache_salt" not in seen[0]
    assert seen[1]["vllm_xargs"] == {}


async def test_forged_payload_is_stripped_from_sampling_params_extra_args(env) -> None:
    """vLLM's token-in, token-out route (``/inference/v1/generate``, served with
    ``--enable-scale-out`` or ``--tokens-only``) takes SamplingParams as sent, and
    their ``extra_args`` reach the workers: a payload there used to pass the strip."""
    client, seen, _ = env
    forged = {"steergate": "forged", "steergate_capture": "{}", "keep": 1}
    r = await client.post(
        "/inference/v1/generate",
        headers=AUTH,
        json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 2, "extra_args": forged}},
    )
    assert r.status_code == 200, r.text
    assert seen[0]["sampling_params"]["extra_args"] == {"keep": 1}


async def test_cache_salt_without_client_salt_and_when_too_long(env) -> None:
    client, seen, _ = env
    await client.post(
        "/v1/chat/completions", headers=AUTH, json=chat(steering={"vectors": [inline()]})
    )
    await client.post(
        "/v1/chat/completions",
        headers=AUTH,
        json=chat(cache_salt="k" * 100, steering={"vectors": [inline()]}),
    )
    digest = payload_of(seen[0]).digest
    assert seen[0]["cache_salt"] == f"|sg:{digest}"
    assert len(seen[1]["cache_salt"]) <= MAX_CACHE_SALT and seen[1]["cache_salt"].startswith("sg:")


async def test_differently_steered_requests_get_different_salts(env) -> None:
    client, seen, _ = env
    for value in (0.5, 0.6):
        await client.post(
            "/v1/chat/completions",
            headers=AUTH,
            json=chat(steering={"vectors": [inline(value=value)]}),
        )
    assert seen[0]["cache_salt"] != seen[1]["cache_salt"]


async def test_error_from_vllm_keeps_its_body_and_gets_the_header(env) -> None:
    client, _, _ = env
    r = await client.post("/v1/chat/completions", headers=AUTH, json=chat(fail=True))
    assert r.status_code == 400 and "steering" not in r.json()
    assert r.headers["x-steering-latch"] == "none"


# -- latch semantics over HTTP ------------------------------------------------------------


async def post(client: httpx.AsyncClient, **extra: Any) -> httpx.Response:
    r = await client.post("/v1/chat/completions", headers=AUTH, json=chat(**extra))
    assert r.status_code == 200, r.text
    return r


async def test_latch_bridge_own_steering_replace_delete(env) -> None:
    client, seen, plugin = env
    r = await post(
        client, conversation_id="c", steering={"vectors": [inline(value=0.5)], "latch": True}
    )
    assert r.headers["x-steering-latch"] == "latched" and r.json()["steering"]["applied"] is True
    latched = seen[-1]

    r = await post(client, conversation_id="c")
    assert r.json()["steering"] == {"applied": True, "latch": "bridged"}
    assert seen[-1]["vllm_xargs"] == latched["vllm_xargs"]  # bit-identical payload
    assert seen[-1]["cache_salt"] == latched["cache_salt"]

    r = await post(client, conversation_id="c", steering={"vectors": [inline(value=0.9)]})
    assert r.json()["steering"] == {"applied": True, "latch": "none"}
    assert payload_of(seen[-1]).digest != payload_of(latched).digest

    r = await post(client, conversation_id="c", steering={"vectors": []})  # opt out for one turn
    assert (
        r.json()["steering"] == {"applied": False, "latch": "none"} and "cache_salt" not in seen[-1]
    )

    r = await post(client, conversation_id="c")  # the latch stayed
    assert r.headers["x-steering-latch"] == "bridged"

    r = await post(
        client, conversation_id="c", steering={"vectors": [inline(value=0.1)], "latch": True}
    )
    assert r.headers["x-steering-latch"] == "replaced"

    assert (await client.delete("/v1/steering/latches/c", headers=AUTH)).status_code == 204
    r404 = await client.delete("/v1/steering/latches/c", headers=AUTH)
    assert r404.status_code == 404 and r404.json()["error"]["code"] == "latch_not_found"
    r = await post(client, conversation_id="c")
    assert r.json()["steering"] == {"applied": False, "latch": "none"}
    assert plugin.runtime.get().controller.status()["bridges"] == 2


async def test_bridged_equals_explicit_with_mixed_named_and_inline_terms(env) -> None:
    client, seen, _ = env
    await client.put(
        "/v1/steering/vectors/calm",
        headers=AUTH,
        json={"hook": "post_block", "layers": {"1": vec(0.1)}},
    )
    steering = {
        "vectors": [inline(1, 0.3, 0.7), {"name": "calm", "scale": 3.0}, inline(1, 0.2, 1.1)]
    }
    await post(client, steering=steering)
    explicit = seen[-1]
    await post(client, conversation_id="c", steering={**steering, "latch": True})
    await post(client, conversation_id="c")
    assert seen[-1]["vllm_xargs"] == explicit["vllm_xargs"]
    latches = (await client.get("/v1/steering/latches", headers=AUTH)).json()
    assert [(x["conversation_id"], x["bytes"], x["kind"]) for x in latches] == [
        ("c", 4 * HIDDEN, "value")
    ]


async def test_stale_reference_is_dropped_and_unsteered(env) -> None:
    client, seen, _ = env
    put = {"hook": "post_block", "layers": {"0": vec(0.1)}}
    await client.put("/v1/steering/vectors/calm", headers=AUTH, json=put)
    await post(client, conversation_id="c", steering={"vectors": [{"name": "calm"}], "latch": True})
    latches = (await client.get("/v1/steering/latches", headers=AUTH)).json()
    assert [(x["bytes"], x["kind"]) for x in latches] == [(0, "ref")]

    await client.put(
        "/v1/steering/vectors/calm", headers=AUTH, json=put
    )  # same content: still valid
    assert (await post(client, conversation_id="c")).headers["x-steering-latch"] == "bridged"

    await client.put(
        "/v1/steering/vectors/calm", headers=AUTH, json={**put, "layers": {"0": vec(0.2)}}
    )
    r = await post(client, conversation_id="c")
    assert r.json()["steering"] == {"applied": False, "latch": "dropped_stale"}
    assert "steergate" not in (seen[-1].get("vllm_xargs") or {})
    assert (await post(client, conversation_id="c")).headers["x-steering-latch"] == "none"


async def test_deleted_vector_drops_reference_latch(env) -> None:
    client, _, _ = env
    await client.put(
        "/v1/steering/vectors/calm",
        headers=AUTH,
        json={"hook": "post_block", "layers": {"0": vec(1)}},
    )
    await post(client, conversation_id="c", steering={"vectors": [{"name": "calm"}], "latch": True})
    assert (await client.delete("/v1/steering/vectors/calm", headers=AUTH)).status_code == 204
    assert (await post(client, conversation_id="c")).headers["x-steering-latch"] == "dropped_stale"


async def test_oversize_latch_steers_but_is_not_stored() -> None:
    app, seen, plugin = await make_app(max_latched_bytes=4 * HIDDEN)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://e"
    ) as client:
        r = await post(
            client, conversation_id="c", steering={"vectors": [inline(0), inline(1)], "latch": True}
        )
        assert r.json()["steering"] == {"applied": True, "latch": "refused_oversize"}
        assert set(payload_of(seen[-1]).sites) == {("post_block", 0), ("post_block", 1)}
        assert (await client.get("/v1/steering/latches", headers=AUTH)).json() == []
        assert plugin.runtime.get().controller.status()["refusals"] == 1


async def test_latch_list_prefix_and_status(env) -> None:
    client, _, _ = env
    for cid in ("t1~a", "t1~b", "t2~a"):
        await post(client, conversation_id=cid, steering={"vectors": [inline()], "latch": True})
    listed = (
        await client.get("/v1/steering/latches", params={"prefix": "t1~"}, headers=AUTH)
    ).json()
    assert [x["conversation_id"] for x in listed] == ["t1~a", "t1~b"]
    assert all(
        set(x) == {"conversation_id", "bytes", "kind", "digest", "last_used"} for x in listed
    )
    status = (await client.get("/v1/steering/status", headers=AUTH)).json()
    assert status["latched_conversations"] == 3 and status["latched_bytes"] == 3 * 4 * HIDDEN
    assert status["latches_stored"] == 3


# -- vectors ---------------------------------------------------------------------------


async def test_vector_put_get_list_delete(env) -> None:
    client, _, _ = env
    body = {"hook": "pre_attn", "layers": {"0": vec(0.5), "3": vec(-1)}, "description": "d"}
    r = await client.put("/v1/steering/vectors/t1~calm", headers=AUTH, json=body)
    assert r.status_code == 201
    meta = r.json()
    assert (meta["name"], meta["hook"], meta["layers"], meta["bytes"]) == (
        "t1~calm",
        "pre_attn",
        [0, 3],
        2 * 4 * HIDDEN,
    )
    assert (
        await client.put("/v1/steering/vectors/t1~calm", headers=AUTH, json=body)
    ).status_code == 200
    got = (await client.get("/v1/steering/vectors/t1~calm", headers=AUTH)).json()
    assert got["digest"] == meta["digest"] and "packed" not in got
    data = (await client.get("/v1/steering/vectors/t1~calm?include=data", headers=AUTH)).json()
    # The data form goes back into a PUT unchanged and keeps the digest.
    r = await client.put(
        "/v1/steering/vectors/t1~copy",
        headers=AUTH,
        json={"hook": data["hook"], "packed": data["packed"]},
    )
    assert r.json()["digest"] == meta["digest"]
    names = [
        v["name"]
        for v in (await client.get("/v1/steering/vectors?prefix=t1~", headers=AUTH)).json()
    ]
    assert names == ["t1~calm", "t1~copy"]
    assert (await client.delete("/v1/steering/vectors/t1~calm", headers=AUTH)).status_code == 204
    r = await client.get("/v1/steering/vectors/t1~calm", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "vector_not_found"
    assert (await client.delete("/v1/steering/vectors/t1~calm", headers=AUTH)).status_code == 404


async def test_vector_gguf_upload_applies_at_post_block(env) -> None:
    client, _, _ = env
    raw = encode_gguf_control_vector(
        {1: np.full(HIDDEN, 0.25, np.float32), 2: np.ones(HIDDEN, np.float32)}
    )
    r = await client.put(
        "/v1/steering/vectors/cv",
        headers={**AUTH, "content-type": "application/octet-stream"},
        content=raw,
    )
    assert r.status_code == 201, r.text
    assert (r.json()["hook"], r.json()["layers"]) == ("post_block", [1, 2])


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"json": {"hook": "post_block", "layers": {"0": [1.0]}}}, "layers.0"),
        ({"json": {"hook": "nope", "layers": {"0": vec(1)}}}, "hook"),
        ({"content": b"{not json", "headers": {"content-type": "application/json"}}, "body"),
        (
            {"content": b"GGUF?garbage", "headers": {"content-type": "application/octet-stream"}},
            "body",
        ),
    ],
)
async def test_invalid_vector_upload_is_400(env, kwargs: dict[str, Any], param: str) -> None:
    client, _, _ = env
    headers = {**AUTH, **kwargs.pop("headers", {})}
    r = await client.put("/v1/steering/vectors/v", headers=headers, **kwargs)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


async def test_invalid_vector_name_is_400(env) -> None:
    client, _, _ = env
    r = await client.put(
        "/v1/steering/vectors/bad$name",
        headers=AUTH,
        json={"hook": "post_block", "layers": {"0": vec(1)}},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_vector_name"
    # the engine's names carry the tenant's scope ("acme~calm"): the message says so
    # (found from outside: it described only the part after the '~')
    assert "tenant scope" in r.json()["error"]["message"] and "~" in r.json()["error"]["message"]
    scoped = await client.put(
        "/v1/steering/vectors/acme~calm",
        headers=AUTH,
        json={"hook": "post_block", "layers": {"0": vec(1)}},
    )
    assert scoped.status_code == 201, scoped.text


# -- streaming --------------------------------------------------------------------------


async def test_sse_is_relayed_with_header_and_untouched_body(env) -> None:
    client, _, _ = env
    r = await client.post(
        "/v1/chat/completions",
        headers=AUTH,
        json=chat(
            stream=True, conversation_id="c", steering={"vectors": [inline()], "latch": True}
        ),
    )
    assert r.headers["x-steering-latch"] == "latched"
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text == 'data: {"i": 0}\n\ndata: {"i": 1}\n\ndata: {"i": 2}\n\ndata: [DONE]\n\n'


async def test_sse_chunks_pass_one_by_one_without_buffering() -> None:
    """The fake app sends its second chunk only after the client has received the
    first; a buffering middleware would deadlock here."""
    got_first = asyncio.Event()
    messages: list[MutableMapping[str, Any]] = []

    async def streaming_app(scope, receive, send) -> None:
        await receive()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await asyncio.wait_for(got_first.wait(), 2)
        await send({"type": "http.response.body", "body": b"data: 2\n\n", "more_body": False})

    ref = RuntimeRef()
    ref.set(SteeringRuntime.create("m", ModelShape(HIDDEN, LAYERS), EngineSettings()))
    middleware = SteeringRewriteMiddleware(streaming_app, ref)
    body = json.dumps(chat(stream=True, steering={"vectors": [inline()]})).encode()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        messages.append(message)
        if message.get("body") == b"data: 1\n\n":
            got_first.set()

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
    }
    await asyncio.wait_for(middleware(scope, receive, send), 5)
    assert [m.get("body") for m in messages[1:]] == [b"data: 1\n\n", b"data: 2\n\n"]
    assert (b"x-steering-latch", b"none") in messages[0]["headers"]


async def test_requests_before_init_state_get_503_not_500() -> None:
    app, seen = fake_vllm()
    plugin = SteeringEndpointPlugin(EngineSettings(engine_token=SecretStr(TOKEN)))
    plugin.attach_router(app)  # init_state not called yet
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://e") as client:
        r = await client.post("/v1/chat/completions", headers=AUTH, json=chat())
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_starting"
        assert (await client.get("/v1/steering/status", headers=AUTH)).status_code == 503
    assert seen == []


async def test_non_json_body_is_left_for_vllm_to_answer() -> None:
    seen: list[bytes] = []

    async def raw_app(scope, receive, send) -> None:
        seen.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b"bad json"})

    ref = RuntimeRef()
    ref.set(SteeringRuntime.create("m", ModelShape(HIDDEN, LAYERS), EngineSettings()))
    transport = httpx.ASGITransport(app=SteeringRewriteMiddleware(raw_app, ref))
    async with httpx.AsyncClient(transport=transport, base_url="http://e") as client:
        r = await client.post("/v1/completions", content=b"{not json")
    assert seen == [b"{not json"]
    assert r.status_code == 400 and r.headers["x-steering-latch"] == "none"


def test_the_engine_bounds_a_huge_n_the_same_way() -> None:
    """As the gateway's check (tests/shared/test_capture_spec.py): no list of n rows."""
    from steergate.engine.http.capture import CaptureSupport, take
    from steergate.shared.errors import APIError

    doc = {"n": 10**12, "max_tokens": 4, "prompt": [1, 2, 3],
           "capture": {"sites": [{"hook": "pre_attn", "layers": [0]}]}}
    with pytest.raises(APIError) as exc:
        take(doc, "/v1/completions", ModelShape(HIDDEN, LAYERS), CaptureSupport(max_model_len=2048))
    assert (exc.value.code, exc.value.param) == ("capture_too_large", "capture")
