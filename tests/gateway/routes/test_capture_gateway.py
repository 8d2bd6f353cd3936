"""``capture`` through the gateway, against the real endpoint plugin (stub vLLM
behind it): malformed and oversized specs are 400s naming the field before
admission; a valid one reaches the engine as the worker payload and its answer comes
back in the requesting tenant's answer only (JSON and the stream's final chunk)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from steergate.engine import capture_io
from steergate.shared.capture import decode_capture
from tests.gateway.conftest import FakeEngine, make_tenant
from tests.gateway.servers import ServerThread
from tests.gateway.stub_engine import HIDDEN

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SITES = [{"hook": "post_block", "layers": [1, 3]}]


def _post(gw: ServerThread, key: str, body: dict[str, Any], path: str = CHAT) -> httpx.Response:
    return httpx.post(
        gw.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            **extra}


@pytest.mark.parametrize(
    ("capture", "code", "param"),
    [
        ("all", "invalid_request", "capture"),
        ({"sites": SITES, "extra": True}, "invalid_request", "capture.extra"),
        ({"sites": [{"hook": "mlp", "layers": [0]}]}, "invalid_request", "capture.sites[0].hook"),
        ({"sites": SITES, "reduce": "max"}, "invalid_request", "capture.reduce"),
        ({"sites": [{"hook": "pre_attn", "layers": [0]}] * 257}, "capture_too_large", "capture"),
        ({"sites": [{"hook": "pre_attn", "layers": list(range(300))}]}, "capture_too_large",
         "capture"),
    ],
)
def test_bad_capture_is_refused_before_admission(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str, capture: Any, code: str,
    param: str,
) -> None:
    key = make_tenant(redis_url, "acme", rpm=1)
    for _ in range(3):  # more 400s than the rpm limit: none of them took a slot
        r = _post(gateway, key, _chat(capture=capture))
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (code, param)
    assert fake_engine.state.seen == []
    assert _post(gateway, key, _chat()).status_code == 200


def test_layers_out_of_range_and_bytes_over_the_bound_are_400s(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme", tpm=10**12)
    r = _post(gateway, key, _chat(capture={"sites": [{"hook": "pre_attn", "layers": [0, 4]}]}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "capture.sites[0].layers[1]"
    # reduce none: rows bounded by the token estimate (4M completion tokens) x 8 x 4 bytes
    huge = _chat(capture={"sites": SITES, "reduce": "none"}, max_tokens=4_000_000)
    r = _post(gateway, key, huge)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "capture_too_large"
    assert fake_engine.state.seen == []


def test_capture_reaches_the_engine_and_its_answer_comes_back(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    """The stub runs no model, so every site has zero rows; what is proved here is
    the pass-through: the worker payload the plugin built, and the answer's shape."""
    key = make_tenant(redis_url, "acme")
    other = make_tenant(redis_url, "other")
    body = {"model": "fake", "prompt": ["a", "b"], "max_tokens": 2,
            "capture": {"sites": SITES, "tokens": "all", "reduce": "last"}}
    r = _post(gateway, key, body, COMPLETIONS)
    assert r.status_code == 200, r.text
    seen = fake_engine.state.seen[-1]
    assert "capture" not in seen
    payload = capture_io.decode_payload(seen["vllm_xargs"][capture_io.XARGS_KEY])
    assert payload.sites == (("post_block", 1), ("post_block", 3))
    assert (payload.tokens, payload.reduce) == ("all", "last")
    answer = r.json()["capture"]
    assert (answer["dtype"], answer["tokens"], answer["reduce"]) == ("float32", "all", "last")
    got = decode_capture(answer)
    assert sorted(got) == [(i, "post_block", layer) for i in (0, 1) for layer in (1, 3)]
    assert all(v.shape == (0, HIDDEN) for v in got.values())
    # Another tenant's plain request carries no capture.
    r = _post(gateway, other, {"model": "fake", "prompt": "a", "max_tokens": 2}, COMPLETIONS)
    assert r.status_code == 200 and "capture" not in r.json()


def test_a_stream_carries_capture_in_its_last_chunk_before_done(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme")
    body = _chat(stream=True, capture={"sites": SITES})
    with httpx.stream("POST", gateway.url + CHAT, json=body,
                      headers={"Authorization": f"Bearer {key}"}, timeout=30) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == [] and last["object"] == "chat.completion.chunk"
    assert sorted(decode_capture(last["capture"])) == [(0, "post_block", 1), (0, "post_block", 3)]
    assert all("capture" not in json.loads(e) for e in events[:-2])
