"""vLLM's own refusals, on the real engine, leave in the OpenAI shape with string
codes; the request id goes through vLLM (its ids, its log); ``/v1/responses`` is
steered and latched like chat. One engine start (the session's shared engine)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.harness import EngineProcess

pytestmark = pytest.mark.engine


def _error(r: httpx.Response, status: int, code: str, rid: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code", "request_id"}, err
    assert err["code"] == code and err["request_id"] == rid == r.headers["x-request-id"]
    return dict(err)


def test_vllm_errors_request_ids_and_responses_on_the_real_engine(engine: EngineProcess) -> None:
    with httpx.Client(base_url=engine.url, headers=engine.headers, timeout=120) as c:
        info = c.get("/v1/steering/info").json()
        model, hidden = info["model"], info["hidden_size"]
        msg = [{"role": "user", "content": "Hello"}]

        def post(path: str, rid: str, body: dict) -> httpx.Response:
            return c.post(path, json=body, headers={"x-request-id": rid})

        r = post(
            "/v1/chat/completions", "neg-1", {"model": model, "messages": msg, "max_tokens": -1}
        )
        err = _error(r, 400, "invalid_request", "neg-1")
        assert err["type"] == "invalid_request_error" and r.headers["x-should-retry"] == "false"
        r = post("/v1/chat/completions", "model-1", {"model": "no-such-model", "messages": msg})
        assert _error(r, 404, "model_not_found", "model-1")["param"] == "model"
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        r = post(
            "/v1/chat/completions",
            "tools-1",
            {"model": model, "messages": msg, "tools": tools, "tool_choice": "auto"},
        )
        _error(r, 400, "invalid_request", "tools-1")
        r = c.get("/v1/no-such-route", headers={"x-request-id": "route-1"})
        _error(r, 404, "not_found", "route-1")
        r = post("/tokenize", "tok-1", {"model": model})  # neither prompt nor messages
        _error(r, 400, "invalid_request", "tok-1")

        # The id reaches vLLM: its completion id is built from it, its log line ends with it.
        r = post(
            "/v1/chat/completions", "trace-abc", {"model": model, "messages": msg, "max_tokens": 2}
        )
        assert r.status_code == 200 and "trace-abc" in r.json()["id"]
        assert r.headers["x-request-id"] == "trace-abc"

        steering = {
            "vectors": [{"hook": "post_block", "layers": {"1": [0.5] * hidden}}],
            "latch": True,
        }
        r = post(
            "/v1/responses",
            "resp-1",
            {
                "model": model,
                "input": "Tell me a story.",
                "max_output_tokens": 4,
                "conversation_id": "r-1",
                "steering": steering,
            },
        )
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["object"] == "response" and doc["usage"]["total_tokens"] > 0
        assert doc["steering"] == {"applied": True, "latch": "latched"}
        assert r.headers["x-steering-latch"] == "latched"
        body = {
            "model": model,
            "input": "And then?",
            "max_output_tokens": 4,
            "conversation_id": "r-1",
            "stream": True,
        }
        with c.stream("POST", "/v1/responses", json=body) as s:
            assert s.headers["x-steering-latch"] == "bridged"
            events = [line for line in s.iter_lines() if line.startswith("data: {")]
        assert json.loads(events[-1][6:])["type"] == "response.completed"

    assert engine.log_path is not None
    assert "[request_id=trace-abc]" in engine.log_path.read_text(errors="replace")
