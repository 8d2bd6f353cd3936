"""The OpenAI surface a client relies on, through two clients nobody here wrote: the
official ``openai`` SDK (with its default retries) and plain ``httpx``. Gateway +
stub engine (the real endpoint plugin; vLLM's own error shapes from stub_vllm.py) +
real Redis.

Every error class has the one shape with a registered string code; every response
has a request id that reaches the engine, its log and error bodies; the SDK retries
exactly what can succeed later; ``/v1/responses`` is steered and latched like chat;
``models.retrieve`` and the tokenizer routes work and are metered.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from steergate.gateway.admission.limits import template_tokens
from steergate.shared import errors
from tests.gateway.conftest import ADMIN_KEY, ENGINE_TOKEN, FakeEngine, make_tenant
from tests.gateway.servers import ServerThread
from tests.gateway.stub_engine import HIDDEN
from tests.harness import wait_for

MSG = [{"role": "user", "content": "hi"}]
INLINE = {"vectors": [{"hook": "post_block", "layers": {"1": [0.5] * HIDDEN}}]}


class Attempts:
    """Counts the HTTP requests an SDK client makes (its retries included)."""

    def __init__(self) -> None:
        self.n = 0
        self.at: list[float] = []

    def __call__(self, request: Any) -> None:
        self.n += 1
        self.at.append(time.monotonic())


def sdk(gateway: ServerThread, key: str, **kw: Any) -> tuple[openai.OpenAI, Attempts]:
    attempts = Attempts()
    http = openai.DefaultHttpxClient(event_hooks={"request": [attempts]})
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, http_client=http, **kw)
    return client, attempts


def h(key: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


def assert_openai_error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """The one shape, a registered code that fits the status, the request id."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code", "request_id"}
    assert err["code"] == code and isinstance(err["message"], str) and err["message"]
    entry = errors.REGISTRY[code]
    assert entry.status == status and err["type"] == entry.type
    assert err["request_id"] == r.headers["x-request-id"]
    if entry.retry is errors.Retry.NEVER:
        assert r.headers["x-should-retry"] == "false" and "retry-after" not in r.headers
    return dict(err)


@pytest.fixture()
def key(redis_url: str) -> str:
    return make_tenant(redis_url, "acme")


def put_vector(gateway: ServerThread, key: str, name: str) -> None:
    r = httpx.put(
        f"{gateway.url}/v1/steering/vectors/{name}",
        headers=h(key),
        json={"hook": "post_block", "layers": {"1": [0.25] * HIDDEN}},
    )
    assert r.status_code in (200, 201), r.text


# -- every error class, both clients ----------------------------------------------------


def test_every_gateway_error_class_has_the_openai_shape_with_httpx(
    gateway: ServerThread, key: str, redis_url: str
) -> None:
    url = gateway.url
    chat = f"{url}/v1/chat/completions"
    cases: list[tuple[httpx.Response, int, str]] = [
        (httpx.post(chat, headers=h(key), content=b"{nope"), 400, "invalid_json"),
        (httpx.post(chat, headers=h(key), json=[1]), 400, "invalid_json"),
        (
            httpx.post(chat, headers=h(key), json={"messages": MSG, "conversation_id": "a b"}),
            400,
            "invalid_conversation_id",
        ),
        (
            httpx.post(chat, headers=h(key), json={"messages": MSG, "steering": {"vectors": "x"}}),
            400,
            "invalid_request",
        ),
        (
            httpx.post(
                chat,
                headers=h(key),
                json={"messages": MSG, "steering": {**INLINE, "latch": True}},
            ),
            400,
            "latch_without_conversation_id",
        ),
        (
            httpx.post(
                chat,
                headers=h(key),
                json={"messages": MSG, "steering": {"vectors": [{"name": "nope"}]}},
            ),
            400,
            "unknown_vector",
        ),
        (
            httpx.post(
                f"{url}/v1/responses",
                headers=h(key),
                json={"input": "hi", "previous_response_id": "resp_1"},
            ),
            400,
            "unsupported_parameter",
        ),
        (
            httpx.put(
                f"{url}/v1/steering/vectors/v",
                headers=h(key, **{"content-type": "application/octet-stream"}),
                content=b"GGUF-not-really",
            ),
            400,
            "invalid_gguf",
        ),
        (httpx.get(f"{url}/v1/models", headers=h("sk-sg-nope")), 401, "invalid_api_key"),
        (httpx.get(f"{url}/admin/tenants", headers=h(key)), 403, "permission_denied"),
        (httpx.get(f"{url}/v1/nope", headers=h(key)), 404, "not_found"),
        (httpx.get(f"{url}/v1/responses/resp_1", headers=h(key)), 404, "not_found"),
        (httpx.get(f"{url}/v1/models/gpt-9", headers=h(key)), 404, "model_not_found"),
        (httpx.get(f"{url}/v1/steering/vectors/v", headers=h(key)), 404, "vector_not_found"),
        (httpx.delete(f"{url}/v1/steering/latches/c", headers=h(key)), 404, "latch_not_found"),
        (httpx.delete(f"{url}/v1/models", headers=h(key)), 405, "method_not_allowed"),
        (
            httpx.post(f"{url}/admin/tenants", headers=h(ADMIN_KEY), json={"id": "acme"}),
            409,
            "tenant_exists",
        ),
        (
            httpx.post(f"{url}/admin/tenants", headers=h(ADMIN_KEY), content=b"{"),
            400,
            "invalid_json",
        ),
    ]
    for r, status, code in cases:
        err = assert_openai_error(r, status, code)
        assert "acme~" not in err["message"]
    assert "Invalid URL (GET /v1/nope)" in cases[10][0].json()["error"]["message"]
    # A 405 names the methods the route takes (RFC 9110 requires Allow).
    not_allowed = next(r for r, status, _ in cases if status == 405)
    assert not_allowed.headers["allow"] == "GET"


def test_an_unknown_vector_is_named_by_its_term_as_the_engine_names_it_and_not_echoed(
    gateway: ServerThread, key: str
) -> None:
    """Found from outside: the gateway said ``param: steering.vectors`` and echoed the
    name; the engine (and docs/latches.md) say ``steering.vectors[i].name`` and do not."""
    put_vector(gateway, key, "known")
    steering = {"vectors": [{"name": "known"}, {"name": "secret-plan"}, {"name": "secret-plan"}]}
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        headers=h(key),
        json={"messages": MSG, "steering": steering},
    )
    err = assert_openai_error(r, 400, "unknown_vector")
    assert err["param"] == "steering.vectors[1].name"
    assert "secret-plan" not in err["message"]


def test_vllm_errors_reach_the_client_in_the_openai_shape(gateway: ServerThread, key: str) -> None:
    """vLLM's own refusals (``"type": "BadRequestError", "code": 400``) are rewritten
    by the engine's plugin: string code, param kept."""
    chat = f"{gateway.url}/v1/chat/completions"
    r = httpx.post(chat, headers=h(key), json={"messages": MSG, "max_tokens": -1})
    err = assert_openai_error(r, 400, "invalid_request")
    assert err["param"] == "max_tokens" and "at least 1" in err["message"]
    r = httpx.post(chat, headers=h(key), json={"model": "no-such-model", "messages": MSG})
    assert assert_openai_error(r, 404, "model_not_found")["param"] == "model"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    r = httpx.post(chat, headers=h(key), json={"messages": MSG, "tools": tools})
    assert "tool" in assert_openai_error(r, 400, "invalid_request")["message"]
    r = httpx.post(chat, headers=h(key), json={"messages": MSG, "fake_raise": True})
    assert_openai_error(r, 500, "internal_error")
    r = httpx.post(f"{gateway.url}/v1/detokenize", headers=h(key), json={"tokens": "not a list"})
    assert assert_openai_error(r, 400, "invalid_request")["param"] == "tokens"
    capture = {"sites": [{"hook": "post_block", "layers": [0]}], "tokens": "prompt"}
    for extra in ({}, {"capture": capture}):  # with a capture too (the stub fakes its files)
        for prompt in ({"x": 1}, 5, [1, "a"], [{"x": 1}]):
            r = httpx.post(
                f"{gateway.url}/v1/completions",
                headers=h(key),
                json={"prompt": prompt, "max_tokens": 1, **extra},
            )
            assert r.status_code == 400, (prompt, extra, r.text)
            err = assert_openai_error(r, 400, "invalid_request")
            # the gateway names the element (admission/request_shape.py), vLLM the field
            assert err["param"].startswith("prompt"), (prompt, extra, err)


def test_a_streamed_vllm_error_has_a_string_code(gateway: ServerThread, key: str) -> None:
    body = {"messages": MSG, "stream": True, "fake_chunks": 3, "fake_stream_error": True}
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", headers=h(key), json=body) as r:
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        events = [line for line in r.iter_lines() if line.startswith("data: {")]
    last = json.loads(events[-1][6:])
    assert last["error"]["code"] == "internal_error"
    assert last["error"]["type"] == "server_error" and last["error"]["request_id"] == rid


def test_a_streamed_vllm_error_ends_the_stream_is_settled_5xx_and_names_no_scoped_id(
    gateway: ServerThread, key: str
) -> None:
    """vLLM's mid-stream failure is an error event, then ``[DONE]``. The gateway relayed
    both and settled the request as a 2xx (usage and exports missed the failure), and
    stripped only the caller's own scope prefix from the event."""
    said = "latch for othertenant~conv-9 missing"
    body = {"messages": MSG, "stream": True, "fake_chunks": 3, "fake_stream_error": said}
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", headers=h(key), json=body) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    error = json.loads(lines[-1][6:])["error"]  # the last event: no [DONE] after it
    assert error["message"] == "latch for conv-9 missing" and "~" not in lines[-1]

    def counts() -> dict[str, int]:
        return httpx.get(f"{gateway.url}/v1/usage", headers=h(key)).json()["responses"]

    wait_for(lambda: counts().get("5xx", 0) == 1, 5)
    assert counts().get("2xx", 0) == 0


def test_every_error_class_with_the_openai_sdk(
    gateway: ServerThread, key: str, redis_url: str, fake_engine: FakeEngine
) -> None:
    client, _ = sdk(gateway, key, max_retries=0)
    cases: list[tuple[type[openai.APIStatusError], str, Any]] = [
        (
            openai.BadRequestError,
            "invalid_conversation_id",
            lambda: client.chat.completions.create(
                model="stub", messages=MSG, extra_body={"conversation_id": "a b"}
            ),
        ),
        (
            openai.BadRequestError,
            "invalid_request",
            lambda: client.chat.completions.create(model="stub", messages=MSG, max_tokens=-1),
        ),
        (
            openai.BadRequestError,
            "unsupported_parameter",
            lambda: client.responses.create(
                model="stub", input="hi", previous_response_id="resp_1"
            ),
        ),
        (
            openai.AuthenticationError,
            "invalid_api_key",
            lambda: openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-sg-x").models.list(),
        ),
        (
            openai.PermissionDeniedError,
            "permission_denied",
            lambda: client.get(gateway.url + "/admin/tenants", cast_to=object),
        ),
        (openai.NotFoundError, "model_not_found", lambda: client.models.retrieve("gpt-9")),
        (
            openai.NotFoundError,
            "model_not_found",
            lambda: client.completions.create(model="no-such-model", prompt="hi"),
        ),
        (openai.NotFoundError, "not_found", lambda: client.responses.retrieve("resp_1")),
        (
            openai.ConflictError,
            "tenant_exists",
            lambda: openai.OpenAI(base_url=gateway.url, api_key=ADMIN_KEY, max_retries=0).post(
                "/admin/tenants", body={"id": "acme"}, cast_to=object
            ),
        ),
        (
            openai.InternalServerError,
            "internal_error",
            lambda: client.chat.completions.create(
                model="stub", messages=MSG, extra_body={"fake_raise": True}
            ),
        ),
    ]
    for cls, code, call in cases:
        with pytest.raises(cls) as info:
            call()
        e = info.value
        assert e.code == code, (code, e.body)
        assert e.type == errors.REGISTRY[code].type
        assert e.request_id and e.request_id.startswith("req_")
        assert isinstance(e.body, dict) and e.body["request_id"] == e.request_id


# -- request ids ------------------------------------------------------------------------


def test_request_ids_are_echoed_generated_and_passed_to_the_engine(
    gateway: ServerThread, key: str, fake_engine: FakeEngine
) -> None:
    chat = f"{gateway.url}/v1/chat/completions"
    mine = "support-ticket:42.a_b-C"
    r = httpx.post(chat, headers=h(key, **{"x-request-id": mine}), json={"messages": MSG})
    assert r.status_code == 200 and r.headers["x-request-id"] == mine
    assert fake_engine.state.request_ids[-1] == mine
    for bad in ("x" * 129, "two words", "semi;colon", "", "ünï"):
        sent = h(key, **{"x-request-id": bad}) if bad.isascii() else h(key)
        r = httpx.post(chat, headers=sent, json={"messages": MSG})
        rid = r.headers["x-request-id"]
        assert rid != bad and rid.startswith("req_") and len(rid) == 36
        assert fake_engine.state.request_ids[-1] == rid
    ids = {httpx.get(gateway.url + "/healthz").headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3
    r = httpx.get(
        f"{gateway.url}/v1/steering/vectors/none", headers=h(key, **{"X-Request-Id": mine})
    )
    assert r.json()["error"]["request_id"] == mine == r.headers["x-request-id"]
    # The SDK shows it on success too.
    client, _ = sdk(gateway, key)
    raw = client.chat.completions.with_raw_response.create(
        model="stub", messages=MSG, extra_headers={"X-Request-Id": mine}
    )
    assert raw.headers["x-request-id"] == mine


def test_the_request_id_is_in_gateway_and_engine_log_lines(
    gateway: ServerThread, key: str, fake_engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    rid = "trace-me-1"
    body = {"messages": MSG}
    httpx.post(
        f"{gateway.url}/v1/chat/completions", headers=h(key, **{"x-request-id": rid}), json=body
    )
    engine_lines = [r for r in caplog.records if r.name == "steergate.stub"]
    assert engine_lines and engine_lines[-1].getMessage().endswith(f"[request_id={rid}]")
    assert engine_lines[-1].request_id == rid  # type: ignore[attr-defined]
    # A gateway line: an engine that cannot be reached is logged with the request's id.
    caplog.clear()
    fake_engine.server.stop()
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions", headers=h(key, **{"x-request-id": rid}), json=body
    )
    assert r.status_code == 502
    gateway_lines = [r for r in caplog.records if r.name.startswith("steergate.gateway")]
    assert any(line.getMessage().endswith(f"[request_id={rid}]") for line in gateway_lines)


# -- retries: what the SDK's default retries do -----------------------------------------


def test_sdk_never_retries_what_waiting_cannot_fix(
    gateway: ServerThread, redis_url: str, fake_engine: FakeEngine
) -> None:
    key = make_tenant(redis_url, "acme", latch_count=1, latch_policy="reject", vector_count=0)
    client, attempts = sdk(gateway, key)  # default retries: 2
    latch = {**INLINE, "latch": True}
    client.chat.completions.create(
        model="stub", messages=MSG, extra_body={"conversation_id": "a", "steering": latch}
    )
    attempts.n = 0
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(
            model="stub", messages=MSG, extra_body={"conversation_id": "b", "steering": latch}
        )
    assert info.value.code == "latch_quota_exceeded" and attempts.n == 1
    assert info.value.response.headers["x-should-retry"] == "false"
    assert "retry-after" not in info.value.response.headers
    attempts.n = 0
    with pytest.raises(openai.RateLimitError) as info:
        client.put(
            "/steering/vectors/calm",
            body={"hook": "post_block", "layers": {"1": [0.1] * HIDDEN}},
            cast_to=object,
        )
    assert info.value.code == "vector_quota_exceeded" and attempts.n == 1
    assert "retry-after" not in info.value.response.headers
    before = len(fake_engine.state.requests)
    attempts.n = 0
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="stub", messages=MSG, extra_body={"fake_raise": True})
    assert attempts.n == 1 and len(fake_engine.state.requests) == before + 1
    attempts.n = 0
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="stub", messages=MSG, max_tokens=-1)
    assert attempts.n == 1


def test_sdk_waits_exactly_the_retry_time_of_a_rate_limit_and_then_succeeds(
    gateway: ServerThread, redis_url: str, fake_engine: FakeEngine
) -> None:
    """tpm 5000: a slow request holds a 5000-token reservation (the whole minute), so
    the SDK's request (prompt 1 + the chat template's 30 + max_tokens 9 = 40 tokens)
    gets a 429 whose retry time is exactly when 40 tokens will have drained (480 ms,
    less what drained since). The SDK waits that long, once, and the retry is admitted."""
    key = make_tenant(redis_url, "acme", tpm=5000)
    client, attempts = sdk(gateway, key)
    answers: list[tuple[int, dict[str, str]]] = []
    client._client.event_hooks["response"] = [
        lambda r: answers.append((r.status_code, dict(r.headers)))
    ]
    seen = len(fake_engine.state.requests)
    slow = threading.Thread(
        target=lambda: httpx.post(
            f"{gateway.url}/v1/chat/completions",
            headers=h(key),
            json={"messages": MSG, "max_tokens": 5000, "fake_delay": 2.0},
            timeout=10,
        )
    )
    slow.start()
    deadline = time.monotonic() + 5
    while len(fake_engine.state.requests) == seen and time.monotonic() < deadline:
        time.sleep(0.005)  # admitted and at the engine: the bucket is empty now
    reply = client.chat.completions.create(model="stub", messages=MSG, max_tokens=9)
    assert reply.choices[0].message.content == "echo"
    assert attempts.n == 2, "one 429, then one retry after exactly retry-after-ms"
    (status, refused), (ok, _) = answers
    assert (status, ok) == (429, 200)
    assert refused["x-should-retry"] == "true"
    ms = int(refused["retry-after-ms"])
    drain_ms = (1 + template_tokens(1) + 9) * 60_000 // 5000
    assert drain_ms == 480 and drain_ms - 200 < ms <= drain_ms and refused["retry-after"] == "1"
    waited = attempts.at[1] - attempts.at[0]
    assert ms / 1000 <= waited < ms / 1000 + 0.5
    slow.join(10)


def test_sdk_retries_an_unreachable_engine_with_its_backoff(
    gateway: ServerThread, key: str, fake_engine: FakeEngine
) -> None:
    fake_engine.server.stop()
    client, attempts = sdk(gateway, key)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="stub", messages=MSG)
    assert info.value.status_code == 502 and info.value.code == "engine_unavailable"
    assert info.value.response.headers["x-should-retry"] == "true"
    assert "retry-after" not in info.value.response.headers  # nobody knows when
    assert attempts.n == 3


def test_concurrency_429_is_retried_without_an_invented_time(
    gateway: ServerThread, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme", max_concurrency=1)
    slow = threading.Thread(
        target=lambda: httpx.post(
            f"{gateway.url}/v1/chat/completions",
            headers=h(key),
            json={"messages": MSG, "fake_delay": 1.0},
            timeout=10,
        )
    )
    slow.start()
    time.sleep(0.3)
    r = httpx.post(f"{gateway.url}/v1/chat/completions", headers=h(key), json={"messages": MSG})
    assert_openai_error(r, 429, "concurrency_limit_exceeded")
    assert r.headers["x-should-retry"] == "true" and "retry-after" not in r.headers
    # The SDK's own backoff (0.5 s, 1 s) outlasts the slow request: it gets through.
    client, attempts = sdk(gateway, key)
    assert client.chat.completions.create(model="stub", messages=MSG).choices
    slow.join(10)


# -- /v1/responses, models, tokenizer ---------------------------------------------------


def test_responses_api_steered_latched_and_bridged_with_the_sdk(
    gateway: ServerThread, key: str, fake_engine: FakeEngine
) -> None:
    put_vector(gateway, key, "calm")
    client, _ = sdk(gateway, key)
    steering = {"vectors": [{"name": "calm", "scale": 4}], "latch": True}
    r = client.responses.create(
        model="stub",
        input="Tell me about your day.",
        max_output_tokens=16,
        extra_body={"conversation_id": "r-1", "steering": steering},
    )
    steered = r.output_text
    assert steered.startswith("echo ") and steered != "echo"
    assert r.model_extra["steering"] == {"applied": True, "latch": "latched"}
    assert r.usage is not None and r.usage.total_tokens == 7
    sent = fake_engine.state.seen[-1]
    assert sent["store"] is False and "stream_options" not in sent
    # A later turn without steering, streamed: the latch steers it exactly the same.
    with client.responses.with_streaming_response.create(
        model="stub",
        input=[{"role": "user", "content": "And tomorrow?"}],
        stream=True,
        extra_body={"conversation_id": "r-1"},
    ) as raw:
        assert raw.headers["x-steering-latch"] == "bridged"
        events = list(raw.parse())
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == steered.replace(" ", "")
    assert events[-1].type == "response.completed"
    # The same conversation through chat: one latch, whichever API stored it.
    chat = client.chat.completions.with_raw_response.create(
        model="stub", messages=MSG, extra_body={"conversation_id": "r-1"}
    )
    assert chat.headers["x-steering-latch"] == "bridged"
    assert chat.parse().choices[0].message.content == steered


def test_responses_stream_is_metered_from_its_final_usage(gateway: ServerThread, key: str) -> None:
    client, _ = sdk(gateway, key)
    before = httpx.get(f"{gateway.url}/v1/usage", headers=h(key)).json()["tokens_total"]
    events = list(client.responses.create(model="stub", input="hi", stream=True))
    assert events[-1].type == "response.completed"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        total = httpx.get(f"{gateway.url}/v1/usage", headers=h(key)).json()["tokens_total"]
        if total > before:
            break
        time.sleep(0.05)
    assert total - before == events[-1].response.usage.total_tokens == 6


def test_models_retrieve_and_list_carry_the_steering_shape(gateway: ServerThread, key: str) -> None:
    client, _ = sdk(gateway, key)
    listed = client.models.list().data
    assert [m.id for m in listed] == ["stub"]
    model = client.models.retrieve("stub")
    assert model.id == "stub" and model.object == "model" and model.owned_by == "vllm"
    assert model.model_extra["steering"] == {
        "hidden_size": HIDDEN,
        "num_layers": 4,
        "hooks": ["pre_attn", "post_attn", "post_block"],
        # as the engine's /v1/steering/info reports them (the stub serves a Llama)
        "architecture": "LlamaForCausalLM",
        "layer_convention": "fused-residual",
    }
    assert model.model_extra["max_model_len"] == 2048


def test_head_answers_as_get_without_a_body(gateway: ServerThread, key: str) -> None:
    """Found from outside: ``HEAD /v1/models`` was 405 while ``GET`` was 200 (load
    balancers and uptime probes send HEAD)."""
    for path, auth in [("/v1/models", h(key)), ("/v1/models/stub", h(key)), ("/healthz", {})]:
        got = httpx.get(gateway.url + path, headers=auth)
        head = httpx.head(gateway.url + path, headers=auth)
        assert (head.status_code, got.status_code) == (200, 200), path
        assert head.content == b"" and got.content
        assert head.headers["content-type"] == got.headers["content-type"]
        assert int(head.headers["content-length"]) == len(got.content), path
    # metered like the GET it stands for
    head = httpx.head(gateway.url + "/v1/models", headers=h(key))
    assert "x-ratelimit-remaining-requests" in head.headers
    # the same refusals, without their bodies
    head = httpx.head(gateway.url + "/v1/models")
    assert head.status_code == 401 and head.content == b"" and head.headers["x-request-id"]
    assert httpx.head(gateway.url + "/v1/chat/completions", headers=h(key)).status_code == 405


def test_tokenize_and_detokenize_are_served_and_metered(gateway: ServerThread, key: str) -> None:
    def requests_made() -> int:
        usage = httpx.get(f"{gateway.url}/v1/usage", headers=h(key)).json()
        return int(usage["responses_total"]["2xx"])

    before = requests_made()
    r = httpx.post(
        f"{gateway.url}/v1/tokenize",
        headers=h(key),
        json={"model": "stub", "prompt": "ab cde f", "return_token_strs": True},
    )
    assert r.status_code == 200, r.text
    assert r.json() == {
        "count": 3,
        "max_model_len": 2048,
        "tokens": [2, 3, 1],
        "token_strs": ["ab", "cde", "f"],
    }
    assert "x-ratelimit-remaining-requests" in r.headers
    client, _ = sdk(gateway, key)
    out = client.post("/detokenize", body={"model": "stub", "tokens": [2, 1]}, cast_to=object)
    assert out == {"prompt": "<2> <1>"}
    chat = client.post("/tokenize", body={"messages": MSG}, cast_to=object)
    assert isinstance(chat, dict) and chat["count"] == 1
    deadline = time.monotonic() + 5
    while requests_made() < before + 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert requests_made() == before + 3


def test_the_engine_itself_answers_in_the_openai_shape(fake_engine: FakeEngine) -> None:
    """Direct to the engine (its plugin, not the gateway, does the rewriting)."""
    url = fake_engine.url
    auth = {"Authorization": f"Bearer {ENGINE_TOKEN}", "x-request-id": "engine-call-1"}
    chat = f"{url}/v1/chat/completions"
    r = httpx.post(chat, headers=auth, json={"messages": MSG, "max_tokens": -1})
    assert assert_openai_error(r, 400, "invalid_request")["request_id"] == "engine-call-1"
    r = httpx.post(chat, headers=auth, json={"model": "no-such-model", "messages": MSG})
    assert_openai_error(r, 404, "model_not_found")
    assert_openai_error(httpx.get(f"{url}/v1/nope", headers=auth), 404, "not_found")
    r = httpx.post(chat, headers=auth, json={"messages": MSG, "fake_raise": True})
    assert_openai_error(r, 500, "internal_error")
    r = httpx.post(chat, json={"messages": MSG})
    assert_openai_error(r, 401, "invalid_api_key")
    r = httpx.post(f"{url}/v1/responses", headers=auth, json={"input": "hi"})
    assert r.status_code == 200 and r.json()["steering"] == {"applied": False, "latch": "none"}
    assert r.headers["x-request-id"] == "engine-call-1"
    body = {"messages": MSG, "stream": True, "fake_chunks": 2, "fake_stream_error": True}
    with httpx.stream("POST", chat, headers=auth, json=body) as s:
        last = [line for line in s.iter_lines() if line.startswith("data: {")][-1]
    assert json.loads(last[6:])["error"]["code"] == "internal_error"
