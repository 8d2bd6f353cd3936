"""The cache salt keeps prefix-cache reuse exact across prompt/generated splits, and
request shapes vLLM cannot steer exactly are refused (engine HTTP plugin in front of
a fake vLLM; no engine)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from steergate.engine.http.exact import prompt_key
from steergate.engine.http.rewrite import salted
from tests.engine.test_engine_http_unit import AUTH, chat, inline, make_app, payload_of


@pytest.fixture()
async def env() -> AsyncIterator[tuple[httpx.AsyncClient, list[dict[str, Any]], Any]]:
    app, seen, plugin = await make_app()
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://e"
    ) as client:
        yield client, seen, plugin


def steering(phase: str, value: float = 0.5, **extra: Any) -> dict[str, Any]:
    return {"vectors": [inline(value=value)], "phase": phase, **extra}


async def _salt(client: httpx.AsyncClient, seen: list, path: str = "/v1/chat/completions",
                **body: Any) -> str:
    doc = {"model": "m", **body} if path == "/v1/completions" else chat(**body)
    r = await client.post(path, headers=AUTH, json=doc)
    assert r.status_code == 200, r.text
    return seen[-1]["cache_salt"]


# ---- salt -------------------------------------------------------------------------


def test_phase_all_salt_is_the_steering_digest_only() -> None:
    assert salted("c", "d") == salted("c", "d", "all", {"prompt": "x"}) == "c|sg:d"


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_prefill_and_decode_salts_depend_on_the_prompt(phase: str) -> None:
    turn1 = {"model": "m", "prompt": [1, 2, 3]}
    continuation = {"model": "m", "prompt": [1, 2, 3, 9, 9, 4]}
    assert salted("c", "d", phase, turn1) != salted("c", "d", phase, continuation)
    assert salted("c", "d", phase, turn1) != salted("c", "d", "all", turn1)
    assert salted("c", "d", phase, turn1).startswith("c|sg:")
    with pytest.raises(ValueError):
        salted("c", "d", phase)


def test_prompt_key_ignores_sampling_fields_and_keeps_everything_else() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    sampled = {**base, "max_tokens": 9, "temperature": 0.7, "stream": True, "seed": 3,
               "cache_salt": "x", "vllm_xargs": {"steergate": "p"}, "request_id": "r1"}
    assert prompt_key(base) == prompt_key(sampled)
    assert prompt_key(base) == prompt_key(dict(reversed(list(base.items()))))
    for shaping in ({"add_generation_prompt": False}, {"chat_template": "{{x}}"},
                    {"tools": []}, {"some_future_field": 1}):
        assert prompt_key(base) != prompt_key({**base, **shaping}), shaping


async def test_bridged_turns_share_the_salt_only_for_phase_all(env) -> None:
    client, seen, _ = env
    salts = {}
    for phase in ("all", "prefill", "decode"):
        cid = f"c-{phase}"
        first = await _salt(client, seen, conversation_id=cid,
                            steering=steering(phase, latch=True))
        bridged = await _salt(client, seen, conversation_id=cid,
                              messages=[{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "hello"},
                                        {"role": "user", "content": "and?"}])
        salts[phase] = (first, bridged, payload_of(seen[-1]).digest)
    first, bridged, digest = salts["all"]
    assert first == bridged == f"|sg:{digest}"
    for phase in ("prefill", "decode"):
        first, bridged, _ = salts[phase]
        assert first != bridged


async def test_a_lone_surrogate_in_the_prompt_still_gets_a_salt(env) -> None:
    """The engine parses with json.loads, which accepts "\\ud800"; UTF-8 cannot encode
    it, and the prompt key's encode was a 500 (the audit's finding)."""
    client, seen, _ = env
    for surrogate in (b"\\ud800", b"\\udc00"):
        raw = b'{"model": "m", "messages": [{"role": "user", "content": "a' + surrogate + \
              b'"}], "steering": {"phase": "prefill", "vectors": [{"hook": "post_block", ' \
              b'"layers": {"1": [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]}}]}}'
        r = await client.post("/v1/chat/completions", content=raw,
                              headers={**AUTH, "content-type": "application/json"})
        assert r.status_code == 200, r.text
    assert seen[0]["cache_salt"] != seen[1]["cache_salt"]  # still a key of the prompt


async def test_identical_prompts_keep_sharing_under_decode(env) -> None:
    client, seen, _ = env
    a = await _salt(client, seen, steering=steering("decode"), max_tokens=4)
    b = await _salt(client, seen, steering=steering("decode"), max_tokens=8, temperature=0.5)
    c = await _salt(client, seen, steering=steering("decode", value=0.6))
    assert a == b and a != c


# ---- refusals ---------------------------------------------------------------------


@pytest.mark.parametrize("flag", [True, "true", 1, "yes"])
async def test_steered_beam_search_is_400_naming_the_field(env, flag: Any) -> None:
    client, seen, plugin = env
    r = await client.post("/v1/chat/completions", headers=AUTH, json=chat(
        use_beam_search=flag, conversation_id="c", steering=steering("all", latch=True)))
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"
    assert "use_beam_search" in r.json()["error"]["message"]
    assert r.headers["x-steering-latch"] == "none"
    assert seen == [] and plugin.runtime.get().controller.count == 0  # nothing stored


async def test_bridged_beam_search_is_400_and_the_latch_stays(env) -> None:
    client, seen, plugin = env
    await _salt(client, seen, conversation_id="c", steering=steering("decode", latch=True))
    r = await client.post("/v1/completions", headers=AUTH, json={
        "model": "m", "prompt": "x", "conversation_id": "c", "use_beam_search": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"
    assert len(seen) == 1 and plugin.runtime.get().controller.count == 1


@pytest.mark.parametrize("body", [
    {"use_beam_search": True},  # unsteered: vLLM's beam search is exact
    {"use_beam_search": True, "steering": {"vectors": []}},  # opted out for this turn
    {"use_beam_search": False, "steering": steering("all")},
    {"use_beam_search": "false", "steering": steering("decode")},
])
async def test_beam_search_passes_when_not_steered(env, body: dict[str, Any]) -> None:
    client, seen, _ = env
    r = await client.post("/v1/chat/completions", headers=AUTH, json=chat(**body))
    assert r.status_code == 200, r.text
    assert seen[-1]["use_beam_search"] == body["use_beam_search"]


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize(("field", "value"), [
    ("prompt", ["a", "b"]), ("prompt", [[1, 2], [3]]), ("prompt_embeds", ["AAAA", "BBBB"])])
async def test_several_prompts_with_a_split_phase_are_400(env, phase, field, value) -> None:
    client, seen, _ = env
    r = await client.post("/v1/completions", headers=AUTH, json={
        "model": "m", field: value, "steering": steering(phase)})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert seen == []


@pytest.mark.parametrize("prompt", [["a", "b"], [1, 2, 3], ["a"], "a"])
async def test_phase_all_and_single_prompts_pass(env, prompt: Any) -> None:
    client, seen, _ = env
    await _salt(client, seen, "/v1/completions", prompt=prompt, steering=steering("all"))
    if not (isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str)):
        await _salt(client, seen, "/v1/completions", prompt=prompt, steering=steering("decode"))
