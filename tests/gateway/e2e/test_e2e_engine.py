"""The gateway in front of the real vLLM CPU engine (tiny model): the official
``openai`` client, stream and not, latch + bridge, tenant isolation, and a client that
leaves before its answer."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from steergate.gateway.app import create_app
from tests.gateway.conftest import gateway_settings, make_tenant
from tests.gateway.servers import ServerThread
from tests.harness import EngineProcess

pytestmark = pytest.mark.engine


@pytest.fixture()
def real_gateway(engine: EngineProcess, redis_url: str) -> Iterator[ServerThread]:
    server = ServerThread(
        create_app(gateway_settings(redis_url, engine.url, engine_token=engine.token))
    ).start()
    yield server
    server.stop()


def _hidden(engine: EngineProcess) -> int:
    return int(
        httpx.get(engine.url + "/v1/steering/info", headers=engine.headers).json()["hidden_size"]
    )


def test_openai_client_through_gateway_stream_and_not(
    real_gateway: ServerThread, redis_url: str
) -> None:
    key = make_tenant(redis_url, "a")
    client = openai.OpenAI(base_url=real_gateway.url + "/v1", api_key=key)
    model = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert r.choices[0].message is not None and r.usage is not None
    c = client.completions.create(model=model, prompt="hello", max_tokens=4)
    assert c.choices[0].text is not None
    chunks = list(
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
    )
    assert chunks and all(ch.usage is None for ch in chunks)
    chunks = list(
        client.completions.create(
            model=model,
            prompt="hello",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_latch_bridge_and_isolation_through_gateway(
    real_gateway: ServerThread, engine: EngineProcess, redis_url: str
) -> None:
    ka, kb = make_tenant(redis_url, "a"), make_tenant(redis_url, "b")
    hidden = _hidden(engine)
    ha, hb = {"Authorization": f"Bearer {ka}"}, {"Authorization": f"Bearer {kb}"}
    put = httpx.put(
        real_gateway.url + "/v1/steering/vectors/calm",
        headers=ha,
        json={"hook": "post_block", "layers": {"1": [0.05] * hidden}},
    )
    assert put.status_code == 201, put.text
    model = httpx.get(real_gateway.url + "/v1/models", headers=ha).json()["data"][0]["id"]

    def chat(h: dict[str, str], **extra: Any) -> httpx.Response:
        return httpx.post(
            real_gateway.url + "/v1/chat/completions",
            headers=h,
            timeout=120,
            json={
                "model": model,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
                **extra,
            },
        )

    r = chat(
        ha,
        conversation_id="conv",
        steering={"vectors": [{"name": "calm", "scale": 2.0}], "latch": True},
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-steering-latch"] == "latched" and r.json()["steering"]["latch"] == "latched"
    assert "a~" not in r.text
    r = chat(ha, conversation_id="conv")
    assert r.headers["x-steering-latch"] == "bridged"
    # b: same conversation id and vector name, nothing of a's
    assert chat(hb, conversation_id="conv").headers["x-steering-latch"] == "none"
    r = chat(hb, steering={"vectors": [{"name": "calm"}]})
    assert r.status_code == 400 and "a~" not in r.text and "b~" not in r.text
    assert httpx.get(real_gateway.url + "/v1/steering/latches", headers=hb).json() == []
    la = httpx.get(real_gateway.url + "/v1/steering/latches", headers=ha).json()
    assert [x["conversation_id"] for x in la] == ["conv"] and la[0]["kind"] == "ref"
    on_engine = httpx.get(
        engine.url + "/v1/steering/latches", params={"prefix": "a~"}, headers=engine.headers
    ).json()
    assert [x["conversation_id"] for x in on_engine] == ["a~conv"]
    assert (
        httpx.delete(real_gateway.url + "/v1/steering/latches/conv", headers=hb).status_code == 404
    )
    assert (
        httpx.delete(real_gateway.url + "/v1/steering/latches/conv", headers=ha).status_code == 204
    )
    assert chat(ha, conversation_id="conv").headers["x-steering-latch"] == "none"


def _engine_load(engine: EngineProcess) -> tuple[float, float]:
    """(requests running + waiting, generation tokens so far) from vLLM's /metrics."""
    text = httpx.get(engine.url + "/metrics", headers=engine.headers).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in _LOAD_METRICS:
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return (
        values["vllm:num_requests_running"] + values["vllm:num_requests_waiting"],
        values["vllm:generation_tokens_total"],
    )


_LOAD_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:generation_tokens_total",
)


def test_client_leaving_a_unary_request_stops_the_engine_generating(
    real_gateway: ServerThread, engine: EngineProcess, redis_url: str
) -> None:
    """A client that gives up on a non-stream request (an SDK timeout, which the openai
    SDK then retries) must not leave the engine generating the answer: 64 choices of
    1,900 tokens hold even the tiny model for many seconds (before the fix, 16 x 1,800
    ran to the last token after the client left). vLLM aborts a request whose connection
    closes; the gateway closes it when its client leaves."""
    key = make_tenant(redis_url, "a")
    assert _engine_load(engine)[0] == 0
    tokens_before = _engine_load(engine)[1]
    n, max_tokens = 64, 1900
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            real_gateway.url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={
                "messages": [{"role": "user", "content": "Tell me a long story."}],
                "n": n,
                "max_tokens": max_tokens,
                "ignore_eos": True,
            },
            timeout=1.5,
        )
    left = time.monotonic()
    # 10 s, not the abort's own few: `make test` runs this engine beside the architecture
    # matrix's. Without the abort the engine would still run, and the token count
    # below would show it.
    while (load := _engine_load(engine))[0]:
        assert time.monotonic() < left + 10, f"the engine still runs {load[0]} requests"
        time.sleep(0.1)
    generated = load[1] - tokens_before
    assert 0 < generated < n * max_tokens / 4, generated


def test_a_conversation_vllm_would_validate_without_bound_is_refused_before_the_engine(
    real_gateway: ServerThread, engine: EngineProcess, redis_url: str
) -> None:
    """Found from outside: 20,000 items of ``{"role": "user", "content": 5}`` (640 KB) on
    ``/v1/responses`` made vLLM build 4.6 million validation errors; the engine's API
    server was killed at 19 GB and every tenant got 502. Here 300 such items (70,000
    errors in vLLM, no danger to this machine) and the like for chat, completions and
    the tokenizer routes, and a field past the body's entry bound: the gateway refuses
    each as a 400 naming the first bad field, before admission and before the engine, and
    the engine serves the next request as usual."""
    key = make_tenant(redis_url, "shape")
    auth = {"Authorization": f"Bearer {key}"}
    model = httpx.get(real_gateway.url + "/v1/models", headers=auth).json()["data"][0]["id"]
    cases = [
        ("/v1/responses", {"model": model, "input": [{"role": "user", "content": 5}] * 300},
         "input[0].content"),
        ("/v1/responses", {"model": model, "input": [{"role": "user", "content": 5}] * 20_000},
         "input"),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": 5}] * 300},
         "messages[0].role"),
        ("/v1/tokenize", {"model": model, "messages": [{"role": "user", "content": 5}] * 300},
         "messages[0].content"),
        ("/v1/completions", {"model": model, "prompt": [[None] * 300]}, "prompt[0][0]"),
        ("/v1/completions", {"model": model, "prompt": "x", "stop_token_ids": [1] * 70_000},
         "stop_token_ids"),
        ("/v1/detokenize", {"model": model, "tokens": [None] * 300}, "tokens[0]"),
    ]  # fmt: skip
    for path, body, param in cases:
        r = httpx.post(real_gateway.url + path, json=body, headers=auth, timeout=60)
        assert r.status_code == 400, (path, r.text[:300])
        err = r.json()["error"]
        assert err["param"] == param and len(err["message"]) < 200, (path, err)
    ok = httpx.post(real_gateway.url + "/v1/responses", headers=auth, timeout=120,
                    json={"model": model, "input": "hi", "max_output_tokens": 2})  # fmt: skip
    assert ok.status_code == 200, ok.text
