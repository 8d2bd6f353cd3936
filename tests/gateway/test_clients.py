"""The official ``openai`` client against the gateway (+ fake engine), and a
schemathesis run over the gateway's OpenAPI: no input may produce a 5xx."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.gateway.conftest import make_tenant
from tests.gateway.servers import ServerThread


def test_openai_client_non_stream_and_stream(gateway: ServerThread, redis_url: str) -> None:
    key = make_tenant(redis_url, "acme")
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key)
    steering = {"vectors": [{"hook": "post_block", "layers": {"0": [0.5] * 8}}], "latch": True}
    r = client.chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"conversation_id": "conv-1", "steering": steering},
    )
    assert r.choices[0].message.content == "echo conv-1"  # the engine saw acme~conv-1
    assert r.model_extra["steering"] == {"applied": True, "latch": "latched"}
    chunks = list(
        client.chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_body={"conversation_id": "conv-1"},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "echoconv-1"
    assert all(c.usage is None for c in chunks), "usage chunk leaked although not asked for"
    chunks = list(
        client.completions.create(
            model="fake", prompt="hi", stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 8
    c = client.completions.create(model="fake", prompt="hi")
    assert c.choices[0].text == "echo"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-sg-bad").models.list()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="fake", messages=[], extra_body={"conversation_id": "a b"}
        )
    assert e.value.code == "invalid_conversation_id"


def test_schemathesis_finds_no_5xx(gateway: ServerThread, redis_url: str) -> None:
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    key = make_tenant(redis_url, "acme")
    schema = schemathesis.openapi.from_url(gateway.url + "/openapi.json")
    failures: list[Any] = []
    ops = [r.ok() for r in schema.get_all_operations()]
    ops = [o for o in ops if o.path.startswith("/v1/") or o.path in ("/healthz", "/readyz")]

    assert len(ops) >= 9, [o.path for o in ops]
    for op in ops:

        @settings(
            max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        @given(case=op.as_strategy())  # type: ignore[misc]
        def check(case: Any) -> None:
            resp = case.call(headers={"Authorization": f"Bearer {key}"}, timeout=10)
            if resp.status_code >= 500 and resp.status_code not in (502, 503, 504):
                failures.append(
                    (case.operation.method, case.operation.path, resp.status_code, resp.text[:200])
                )

        check()
    assert not failures, failures
