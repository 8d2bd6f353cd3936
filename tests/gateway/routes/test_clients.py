"""The official ``openai`` client against the gateway (+ stub engine). The schemathesis
run over the gateway's OpenAPI is in tests/gateway/edge/test_schemathesis.py."""

from __future__ import annotations

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
    steered = r.choices[0].message.content  # "echo <digest of the steering it got>"
    assert steered.startswith("echo ") and steered != "echo"
    assert r.model_extra["steering"] == {"applied": True, "latch": "latched"}
    chunks = list(
        client.chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_body={"conversation_id": "conv-1"},
        )
    )
    # The latch steered the next turn exactly as the turn that stored it.
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == steered.replace(" ", "")
    assert all(c.usage is None for c in chunks), "usage chunk leaked although not asked for"
    chunks = list(
        client.completions.create(
            model="fake", prompt="hi", stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 6  # 5 + "echo"
    c = client.completions.create(model="fake", prompt="hi")
    assert c.choices[0].text == "echo"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-sg-bad").models.list()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="fake", messages=[], extra_body={"conversation_id": "a b"}
        )
    assert e.value.code == "invalid_conversation_id"
