"""``steering.compare`` (issue 20) through the gateway, on stub engines behind the real
endpoint plugin: the engine sends the request twice, steered and unsteered with the
same seed, and merges the answers (choice 0 steered, choice 1 not; usage summed; in a
stream, indices keep them apart). The stub answers ``echo <digest of the steering it
got>``, or ``echo`` unsteered."""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from tests.gateway.conftest import FakeEngine, make_tenant
from tests.gateway.engines.test_durable_state import FAST_POLL

ADD = {"hook": "post_attn", "layers": {"2": [0.5] * 8}}
ABLATE = {"hook": "post_block", "layers": {"1": [1.0, 0.0] * 4}, "op": "ablate"}


def _post(gw: Any, key: str, **body: Any) -> httpx.Response:
    body = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], **body}
    return httpx.post(gw.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {key}"}, timeout=30)


def test_compare_answers_steered_and_default_choices_with_one_seed(
    start_gateway: Any, fake_engine: FakeEngine, redis_url: str
) -> None:
    gw = start_gateway(**FAST_POLL)
    key = make_tenant(redis_url, "acme")
    steered_alone = _post(gw, key, steering={"vectors": [ADD, ABLATE]}).json()
    plain_alone = _post(gw, key).json()
    fake_engine.state.seen.clear()
    r = _post(gw, key, conversation_id="c1",
              steering={"vectors": [ADD, ABLATE], "compare": True, "latch": True})
    assert r.status_code == 200, r.text
    doc = r.json()
    texts = {c["index"]: c["message"]["content"] for c in doc["choices"]}
    assert texts == {0: steered_alone["choices"][0]["message"]["content"],
                     1: plain_alone["choices"][0]["message"]["content"]}
    assert texts[0] != texts[1] and texts[1] == "echo"
    assert doc["usage"]["completion_tokens"] == 2 * plain_alone["usage"]["completion_tokens"]
    assert doc["usage"]["prompt_tokens"] == 2 * plain_alone["usage"]["prompt_tokens"]
    assert r.headers["x-steering-latch"] == "latched"  # the steered half stores the latch
    bodies = fake_engine.state.seen[-2:]
    seeds = {b.get("seed") for b in bodies}
    assert len(seeds) == 1 and None not in seeds  # one drawn seed for both
    assert sum("steergate" in (b.get("vllm_xargs") or {}) for b in bodies) == 1
    # The latch bridges the next turn; a compare turn's default half ignores it.
    bridged = _post(gw, key, conversation_id="c1").json()
    assert bridged["choices"][0]["message"]["content"] == texts[0]
    again = _post(gw, key, conversation_id="c1", seed=7,
                  steering={"vectors": [], "compare": True}).json()
    assert [c["message"]["content"] for c in again["choices"]] == ["echo", "echo"]
    assert {b.get("seed") for b in fake_engine.state.seen[-2:]} == {7}


def test_compare_streams_both_choices_and_one_summed_usage_chunk(
    start_gateway: Any, fake_engine: FakeEngine, redis_url: str
) -> None:
    gw = start_gateway(**FAST_POLL)
    key = make_tenant(redis_url, "acme")
    body = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True},
            "steering": {"vectors": [ADD], "compare": True}}
    text: dict[int, list[str]] = {0: [], 1: []}
    usage = []
    done = 0
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done += 1
            elif line.startswith("data: {"):
                chunk = orjson.loads(line[6:])
                for c in chunk["choices"]:
                    text[c["index"]].append(c["delta"].get("content", ""))
                if chunk.get("usage") and not chunk["choices"]:
                    usage.append(chunk["usage"])
    assert done == 1 and len(usage) == 1
    assert " ".join(text[1]) == "echo" and " ".join(text[0]).startswith("echo ")
    assert usage[0]["completion_tokens"] == len(text[0]) + len(text[1])


def test_compare_must_be_a_boolean(
    gateway: Any, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme")
    r = _post(gateway, key, steering={"vectors": [ADD], "compare": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "steering.compare"


def test_the_admission_estimate_counts_both_halves() -> None:
    from steergate.gateway.admission.limits import estimate_tokens

    body = {"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 10, "n": 2}
    plain = estimate_tokens(body)
    assert estimate_tokens({**body, "steering": {"compare": True}}) == 2 * plain
    assert estimate_tokens({**body, "steering": {"compare": False}}) == plain
