"""Latches on the real vLLM CPU engine with small caps: the controller, the rewrite
and the workers together, over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.harness import EngineProcess

pytestmark = pytest.mark.engine

SITE_SITES_CAP = 4  # byte cap, in sites
PROMPT = "Once upon a time there was"


@pytest.fixture(scope="module")
def small_engine(tiny_model: Path) -> Iterator[EngineProcess]:
    hidden = _hidden_size(tiny_model)
    proc = EngineProcess(
        tiny_model,
        env={
            "STEERGATE_MAX_LATCHED_CONVERSATIONS": "3",
            "STEERGATE_MAX_LATCHED_BYTES": str(SITE_SITES_CAP * 4 * hidden),
        },
    ).start()
    yield proc
    proc.stop()


@pytest.fixture()
def api(small_engine: EngineProcess) -> Iterator[Api]:
    with httpx.Client(
        base_url=small_engine.url, headers=small_engine.headers, timeout=120
    ) as client:
        api = Api(client)
        for latch in api.get("/v1/steering/latches"):  # each test starts with no latches
            client.delete(f"/v1/steering/latches/{latch['conversation_id']}")
        yield api


def _hidden_size(model: Path) -> int:
    import json

    return int(json.loads((model / "config.json").read_text())["hidden_size"])


class Api:
    def __init__(self, client: httpx.Client) -> None:
        self.client = client
        info = self.get("/v1/steering/info")
        self.model, self.hidden, self.layers = (
            info["model"],
            info["hidden_size"],
            info["num_layers"],
        )
        self.site_bytes = 4 * self.hidden

    def get(self, path: str, **kw: Any) -> Any:
        r = self.client.get(path, **kw)
        assert r.status_code == 200, r.text
        return r.json()

    def complete(self, **extra: Any) -> tuple[str, str, dict[str, Any]]:
        """(text, latch header, steering object) of a greedy completion."""
        r = self.client.post(
            "/v1/completions",
            json={
                "model": self.model,
                "prompt": PROMPT,
                "max_tokens": 8,
                "temperature": 0,
                **extra,
            },
        )
        assert r.status_code == 200, r.text
        body = r.json()
        return body["choices"][0]["text"], r.headers["x-steering-latch"], body["steering"]

    def vector(self, seed: int, scale: float = 8.0) -> list[float]:
        rng = np.random.default_rng(seed)
        v = rng.standard_normal(self.hidden).astype(np.float32)
        return [float(x) for x in v / np.linalg.norm(v) * scale]

    def steering(self, seed: int, n_sites: int = 1, latch: bool = False) -> dict[str, Any]:
        layers = {
            str(i % self.layers): self.vector(seed + i) for i in range(min(n_sites, self.layers))
        }
        vectors = [{"hook": "post_block", "layers": layers}]
        if n_sites > self.layers:
            rest = {str(i): self.vector(seed + 100 + i) for i in range(n_sites - self.layers)}
            vectors.append({"hook": "post_attn", "layers": rest})
        return {"vectors": vectors, "latch": latch}


def test_latch_bridge_equals_explicit_then_replace_and_delete(api: Api) -> None:
    plain, state, obj = api.complete()
    assert (state, obj) == ("none", {"applied": False, "latch": "none"})
    explicit, state, obj = api.complete(steering=api.steering(1))
    assert explicit != plain, "steering must change the greedy tokens of the tiny model"
    assert obj == {"applied": True, "latch": "none"}

    text, state, _ = api.complete(conversation_id="conv-a", steering=api.steering(1, latch=True))
    assert (text, state) == (explicit, "latched")
    text, state, obj = api.complete(conversation_id="conv-a")
    assert (text, state, obj) == (explicit, "bridged", {"applied": True, "latch": "bridged"})

    own, state, _ = api.complete(conversation_id="conv-a", steering=api.steering(7))
    assert state == "none" and own == api.complete(steering=api.steering(7))[0]
    assert api.complete(conversation_id="conv-a")[:2] == (explicit, "bridged")  # latch stayed

    _, state, _ = api.complete(conversation_id="conv-a", steering=api.steering(2, latch=True))
    assert state == "replaced"
    assert api.complete(conversation_id="conv-a")[0] == api.complete(steering=api.steering(2))[0]

    assert api.client.delete("/v1/steering/latches/conv-a").status_code == 204
    assert api.client.delete("/v1/steering/latches/conv-a").status_code == 404
    assert api.complete(conversation_id="conv-a") == (
        plain,
        "none",
        {"applied": False, "latch": "none"},
    )


def test_lru_eviction_and_byte_accounting(api: Api) -> None:
    before = api.get("/v1/steering/status")
    for cid in ("e1", "e2", "e3"):
        assert (
            api.complete(conversation_id=cid, steering=api.steering(3, latch=True))[1] == "latched"
        )
    assert api.complete(conversation_id="e1")[1] == "bridged"  # e1 is now the most recent
    api.complete(conversation_id="e4", steering=api.steering(3, latch=True))  # count cap 3: e2 goes
    listed = api.get("/v1/steering/latches")
    assert [x["conversation_id"] for x in listed] == ["e3", "e1", "e4"]
    assert all(x["bytes"] == api.site_bytes and x["kind"] == "value" for x in listed)
    assert api.complete(conversation_id="e2")[1] == "none"

    # 3 sites on top of 3 x 1 site passes the 4-site byte cap: the two oldest go.
    api.complete(conversation_id="e5", steering=api.steering(4, n_sites=3, latch=True))
    listed = api.get("/v1/steering/latches")
    assert [(x["conversation_id"], x["bytes"]) for x in listed] == [
        ("e4", api.site_bytes),
        ("e5", 3 * api.site_bytes),
    ]
    status = api.get("/v1/steering/status")
    assert status["latched_bytes"] == 4 * api.site_bytes <= status["max_latched_bytes"]
    assert status["latched_conversations"] == 2
    assert status["evictions"] - before["evictions"] == 3
    assert status["latches_stored"] - before["latches_stored"] == 5
    assert status["bridges"] - before["bridges"] == 1


def test_oversize_latch_is_steered_but_not_stored(api: Api, small_engine: EngineProcess) -> None:
    before = api.get("/v1/steering/status")
    api.complete(conversation_id="keep", steering=api.steering(5, latch=True))
    steering = api.steering(6, n_sites=SITE_SITES_CAP + 1)
    explicit = api.complete(steering=steering)[0]
    text, state, obj = api.complete(conversation_id="big", steering={**steering, "latch": True})
    assert (text, state, obj) == (
        explicit,
        "refused_oversize",
        {"applied": True, "latch": "refused_oversize"},
    )
    assert [x["conversation_id"] for x in api.get("/v1/steering/latches")] == ["keep"]
    assert api.get("/v1/steering/status")["refusals"] - before["refusals"] == 1
    assert api.complete(conversation_id="big")[1] == "none"
    assert small_engine.log_path is not None
    assert "latch refused" in small_engine.log_path.read_text(
        errors="replace"
    )  # warned in the engine log


def test_stale_reference_is_dropped_after_reregistering(api: Api) -> None:
    plain = api.complete()[0]
    put = {"hook": "post_block", "layers": {"1": api.vector(9)}}
    assert api.client.put("/v1/steering/vectors/calm", json=put).status_code in (200, 201)
    named = api.complete(steering={"vectors": [{"name": "calm", "scale": 1.5}]})[0]
    _, state, _ = api.complete(
        conversation_id="ref", steering={"vectors": [{"name": "calm", "scale": 1.5}], "latch": True}
    )
    assert state == "latched"
    assert [(x["bytes"], x["kind"]) for x in api.get("/v1/steering/latches")] == [(0, "ref")]
    assert api.complete(conversation_id="ref")[:2] == (named, "bridged")

    put["layers"] = {"1": api.vector(10)}
    assert api.client.put("/v1/steering/vectors/calm", json=put).status_code == 200
    assert api.complete(conversation_id="ref") == (
        plain,
        "dropped_stale",
        {"applied": False, "latch": "dropped_stale"},
    )
    assert api.get("/v1/steering/latches") == []


def test_stream_carries_the_latch_header(api: Api) -> None:
    with api.client.stream(
        "POST",
        "/v1/completions",
        json={
            "model": api.model,
            "prompt": PROMPT,
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
            "conversation_id": "s",
            "steering": api.steering(11, latch=True),
        },
    ) as r:
        assert r.status_code == 200
        assert r.headers["x-steering-latch"] == "latched"
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 2


def test_engine_routes_need_the_token(small_engine: EngineProcess) -> None:
    for path in ("/v1/steering/status", "/health", "/v1/models"):
        r = httpx.get(small_engine.url + path, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(small_engine.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 401


def test_openai_client_with_extra_body(small_engine: EngineProcess, api: Api) -> None:
    import openai

    client = openai.OpenAI(base_url=small_engine.url + "/v1", api_key=small_engine.token)
    raw = client.completions.with_raw_response.create(
        model=api.model,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        extra_body={"conversation_id": "oa", "steering": api.steering(12, latch=True)},
    )
    assert raw.headers["x-steering-latch"] == "latched"
    chat = client.chat.completions.with_raw_response.create(
        model=api.model,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=4,
        temperature=0,
        extra_body={"conversation_id": "oa"},
    )
    assert chat.headers["x-steering-latch"] == "bridged"
    extra = chat.parse().model_extra or {}
    assert extra.get("steering") == {"applied": True, "latch": "bridged"}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=api.model,
            prompt=PROMPT,
            max_tokens=1,
            extra_body={"steering": {"vectors": [{"name": "nope"}]}},
        )
    assert info.value.param == "steering.vectors[0].name"
    assert info.value.code == "unknown_vector"
