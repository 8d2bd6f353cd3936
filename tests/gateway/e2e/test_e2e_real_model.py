"""The gateway in front of the shared real-model engine (SmolLM2-135M-Instruct,
float32): the official ``openai`` client gets a correct answer, so the default
model is wired end to end (fetched, converted, served, chat-templated)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from steergate.gateway.app import create_app
from tests.gateway.conftest import gateway_settings, make_tenant
from tests.gateway.servers import ServerThread
from tests.harness import EngineProcess

pytestmark = pytest.mark.engine


@pytest.fixture()
def real_model_gateway(real_engine: EngineProcess, redis_url: str) -> Iterator[ServerThread]:
    server = ServerThread(
        create_app(gateway_settings(redis_url, real_engine.url, engine_token=real_engine.token))
    ).start()
    yield server
    server.stop()


def test_greedy_chat_knows_the_capital_of_france(
    real_model_gateway: ServerThread, redis_url: str
) -> None:
    key = make_tenant(redis_url, "a")
    client = openai.OpenAI(base_url=real_model_gateway.url + "/v1", api_key=key, timeout=300)
    model = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0,
    )
    text = r.choices[0].message.content or ""
    assert "Paris" in text, text
    assert r.choices[0].finish_reason == "stop"  # the chat template's end token ends it
