"""``POST /v1/steering/vectors/{name}/from-examples`` through a real gateway and
Redis, with the real endpoint plugin in front of the stub engine, whose capture gives
each prompt a deterministic fake activation (``stub_capture.py``): the stored vector,
its provenance and report, its use by name (also after an engine restart), tenant
isolation, admission, and hostile bodies."""

from __future__ import annotations

import time
from typing import Any

import httpx
import numpy as np
import pytest

from steergate.gateway.vectors.examples_spec import parse_examples_body
from steergate.shared.steering import ModelShape, parse_layers_or_packed
from tests.gateway.conftest import FakeEngine, make_tenant
from tests.gateway.servers import ServerThread
from tests.gateway.stub_capture import fake_activation
from tests.gateway.stub_engine import HIDDEN, LAYERS

OCEAN = ["the ocean waves", "ocean tides roll", "deep ocean blue", "ocean spray"]
CITY = ["the city streets", "traffic downtown", "tall buildings", "subway trains"]


def make(gw: ServerThread, key: str, name: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{gw.url}/v1/steering/vectors/{name}/from-examples",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


def get(gw: ServerThread, key: str, path: str) -> httpx.Response:
    return httpx.get(gw.url + path, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def chat(gw: ServerThread, key: str, name: str) -> httpx.Response:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "steering": {"vectors": [{"name": name, "scale": 2}]},
    }
    return httpx.post(
        gw.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )


def stored(gw: ServerThread, key: str, name: str) -> dict[int, np.ndarray]:
    doc = get(gw, key, f"/v1/steering/vectors/{name}?include=data").json()
    return parse_layers_or_packed({"packed": doc["packed"]}, None, None)


def test_mean_difference_is_stored_with_provenance_and_report(
    gateway: ServerThread, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme")
    r = make(gateway, key, "ocean", {"positive": OCEAN, "negative": CITY, "layers": [1, 3]})
    assert r.status_code == 201, r.text
    doc = r.json()
    assert doc["name"] == "ocean" and doc["layers"] == [1, 3] and doc["hook"] == "post_block"
    prov = doc["provenance"]
    assert prov["method"] == "mean_difference" and prov["position"] == "mean"
    assert prov["counts"] == {"positive": 4, "negative": 4} and prov["model"] == "stub"
    assert set(doc["report"]["layers"]) == {"1", "3"}
    assert doc["report"]["usage"] == {
        "prompt_tokens": 40,  # the stub reports 5 per prompt and 1 generated token each
        "completion_tokens": 8,
        "total_tokens": 48,
    }
    # The stored vector is the mean difference of the activations, computed apart.
    vectors = stored(gateway, key, "ocean")
    for layer in (1, 3):
        pos = np.mean([fake_activation(t, "post_block", layer, "mean", HIDDEN) for t in OCEAN], 0)
        neg = np.mean([fake_activation(t, "post_block", layer, "mean", HIDDEN) for t in CITY], 0)
        np.testing.assert_allclose(vectors[layer], pos - neg, rtol=1e-5, atol=1e-6)
        rep = doc["report"]["layers"][str(layer)]
        assert rep["norm"] == pytest.approx(float(np.linalg.norm(pos - neg)), rel=1e-5)
        assert 0.0 <= rep["accuracy"] <= 1.0
    # The planted concept grows with depth: the deeper layer separates better.
    assert doc["report"]["layers"]["3"]["separation"] > doc["report"]["layers"]["1"]["separation"]
    # Listed with its provenance, like any vector.
    listed = get(gateway, key, "/v1/steering/vectors").json()["data"]
    assert listed[0]["name"] == "ocean" and listed[0]["provenance"]["source"] == "from-examples"
    assert listed[0]["report"]["examples"]["positive"] == 4


def test_layers_all_position_last_normalize_and_messages(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme")
    chats = [[{"role": "user", "content": t}] for t in OCEAN[:2]]
    body = {
        "positive": [*OCEAN[2:], *chats],
        "negative": CITY,
        "layers": "all",
        "position": "last",
        "normalize": True,
        "method": "pca",
        "description": "sea",
    }
    r = make(gateway, key, "sea", body)
    assert r.status_code == 201, r.text
    assert r.json()["layers"] == list(range(LAYERS))
    for vec in stored(gateway, key, "sea").values():
        assert np.linalg.norm(vec) == pytest.approx(1.0, abs=1e-5)
    sent = [b for b in fake_engine.state.requests if b.get("capture")]
    assert {b["capture"]["reduce"] for b in sent} == {"last"}
    # The messages examples went to the engine as token ids (templated by /tokenize).
    assert any(isinstance(b["prompt"][0], list) for b in sent)
    assert any(isinstance(b["prompt"][0], str) for b in sent)
    assert all(b["max_tokens"] == 1 and b["cache_salt"] for b in sent)


def test_made_vector_steers_by_name_and_survives_an_engine_restart(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme")
    assert make(gateway, key, "ocean", {"positive": OCEAN, "negative": CITY}).status_code == 201
    first = chat(gateway, key, "ocean")
    assert first.status_code == 200 and first.json()["steering"]["applied"] is True
    fake_engine.state.restart()  # the engine's copy is gone; Redis still has it
    assert not fake_engine.state.vectors
    again = chat(gateway, key, "ocean")
    assert again.status_code == 200, again.text
    # The same steering as before the restart (the stub answers with its digest).
    assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]


def test_another_tenant_sees_and_uses_nothing(gateway: ServerThread, redis_url: str) -> None:
    owner = make_tenant(redis_url, "acme")
    other = make_tenant(redis_url, "globex")
    assert make(gateway, owner, "ocean", {"positive": OCEAN, "negative": CITY}).status_code == 201
    assert get(gateway, other, "/v1/steering/vectors/ocean").status_code == 404
    assert get(gateway, other, "/v1/steering/vectors").json()["data"] == []
    r = chat(gateway, other, "ocean")
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_vector"
    # Its own vector of the same name leaves the owner's alone.
    assert make(gateway, other, "ocean", {"positive": CITY, "negative": OCEAN}).status_code == 201
    mine, theirs = stored(gateway, owner, "ocean"), stored(gateway, other, "ocean")
    np.testing.assert_allclose(mine[0], -theirs[0], rtol=1e-5, atol=1e-6)


def test_tokens_are_admitted_and_settled(gateway: ServerThread, redis_url: str) -> None:
    key = make_tenant(redis_url, "acme", tpm=100)
    r = make(gateway, key, "v", {"positive": OCEAN, "negative": CITY})
    assert r.status_code == 201
    assert int(r.headers["x-ratelimit-remaining-tokens"]) < 100
    time.sleep(0.3)  # settlement is batched off the hot path: 48 used of 100
    big = ["ocean " * 100] * 4  # ~150 estimated tokens per side: over tpm
    r = make(gateway, key, "w", {"positive": big, "negative": CITY})
    assert r.status_code == 429


def test_vector_quota_applies_before_any_tokens_are_spent(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    key = make_tenant(redis_url, "acme", vector_count=1)
    assert make(gateway, key, "a", {"positive": OCEAN, "negative": CITY}).status_code == 201
    sent = len(fake_engine.state.requests)
    r = make(gateway, key, "b", {"positive": OCEAN, "negative": CITY})
    assert r.status_code == 429 and r.json()["error"]["code"] == "vector_quota_exceeded"
    assert len(fake_engine.state.requests) == sent  # refused before the engine was asked
    # Replacing the one it has is within quota.
    assert make(gateway, key, "a", {"positive": CITY, "negative": OCEAN}).status_code == 200


def test_a_job_queued_behind_the_tenants_own_job_that_took_the_room_is_charged_nothing(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    """Found from outside: a tenant's jobs run one at a time, and all of them passed
    the up-front quota check before the first stored its vector; the later ones were
    refused (429) only at the store, after their engine work was charged. The quota is
    checked again once a job's turn comes."""
    from concurrent.futures import ThreadPoolExecutor

    key = make_tenant(redis_url, "acme", vector_count=1)
    body = {"positive": OCEAN, "negative": CITY}
    fake_engine.state.delay_s = 0.5
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(make, gateway, key, "a", body)
        time.sleep(0.2)  # the first job holds the tenant's turn (its batch is in flight)
        second = make(gateway, key, "b", body)
        assert first.result().status_code == 201
    fake_engine.state.delay_s = 0.0
    assert second.status_code == 429, second.text
    assert second.json()["error"]["code"] == "vector_quota_exceeded"
    charged = first.result().json()["report"]["usage"]["total_tokens"]
    time.sleep(0.3)  # settlement is batched off the hot path
    usage = get(gateway, key, "/v1/usage").json()
    assert usage["tokens_total"] == charged  # the 429 cost nothing


HOSTILE: list[tuple[dict[str, Any], str, str]] = [
    ({"positive": [], "negative": CITY}, "positive", "invalid_request"),
    ({"positive": OCEAN, "negative": []}, "negative", "invalid_request"),
    ({"positive": ["x"] * 10_000, "negative": CITY}, "positive", "examples_too_large"),
    ({"positive": OCEAN, "negative": CITY, "layers": [0, LAYERS]}, "layers[1]", "invalid_request"),
    ({"positive": OCEAN, "negative": CITY, "layers": [-1]}, "layers[0]", "invalid_request"),
    ({"positive": OCEAN, "negative": CITY, "layers": [1, 1]}, "layers[1]", "invalid_request"),
    ({"positive": OCEAN, "negative": CITY, "layers": []}, "layers", "invalid_request"),
    ({"positive": OCEAN, "negative": CITY, "method": "median"}, "method", "invalid_request"),
    ({"positive": OCEAN, "negative": CITY, "position": "first"}, "position", "invalid_request"),
    ({"positive": OCEAN, "negative": CITY, "hook": "pre_mlp"}, "hook", "invalid_request"),
    ({"positive": OCEAN, "negative": CITY, "normalize": "yes"}, "normalize", "invalid_request"),
    ({"positive": OCEAN, "negative": CITY, "scale": 2}, "scale", "invalid_request"),
    ({"positive": ["a", ""], "negative": CITY}, "positive[1]", "invalid_request"),
    ({"positive": ["a", 7], "negative": CITY}, "positive[1]", "invalid_request"),
    (
        {"positive": OCEAN, "negative": ["b", [{"role": "bot", "content": "x"}]]},
        "negative[1][0].role",
        "invalid_request",
    ),
    (
        {"positive": OCEAN, "negative": ["b", [{"role": "user", "content": "x", "name": "n"}]]},
        "negative[1][0].name",
        "invalid_request",
    ),
    ({"positive": OCEAN, "negative": ["z" * 8001, "b"]}, "negative[0]", "examples_too_large"),
    ({"positive": ["z" * 8000] * 51, "negative": CITY}, "positive", "examples_too_large"),
    ({"positive": OCEAN, "negative": ["z" * 8000] * 51}, "negative", "examples_too_large"),
    ({"positive": OCEAN, "negative": CITY[:3], "method": "pca"}, "negative", "invalid_request"),
    ({"positive": OCEAN[:1], "negative": CITY}, "positive", "invalid_request"),
    ({"positive": "ocean", "negative": CITY}, "positive", "invalid_request"),
    # the same examples on both sides (any order): a zero vector, never stored
    ({"positive": OCEAN, "negative": OCEAN[::-1]}, "negative", "examples_indistinguishable"),
    (
        {"positive": OCEAN[:2], "negative": OCEAN[:2], "method": "pca"},
        "negative",
        "examples_indistinguishable",
    ),
]


@pytest.mark.parametrize(("body", "param", "code"), HOSTILE)
def test_hostile_bodies_get_400_naming_the_field_before_any_work(
    gateway: ServerThread,
    fake_engine: FakeEngine,
    redis_url: str,
    body: dict[str, Any],
    param: str,
    code: str,
) -> None:
    key = make_tenant(redis_url, "acme")
    r = make(gateway, key, "v", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code)
    assert not [b for b in fake_engine.state.requests if b.get("capture")]  # no engine work
    assert get(gateway, key, "/v1/steering/vectors").json()["data"] == []


def test_bad_name_and_bad_json_get_400(gateway: ServerThread, redis_url: str) -> None:
    key = make_tenant(redis_url, "acme")
    r = make(gateway, key, "bad name!", {"positive": OCEAN, "negative": CITY})
    assert r.status_code in (400, 404)
    r = httpx.post(
        f"{gateway.url}/v1/steering/vectors/v/from-examples",
        content=b"[1, 2",
        headers={"Authorization": f"Bearer {key}"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_an_engine_that_cannot_capture_is_a_501_with_its_reason_not_a_retryable_502(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    """An engine that replays CUDA graphs refuses capture (501 ``not_implemented``):
    from-examples answered a retryable 502 ``engine_unavailable`` that hid why."""
    from steergate.engine.http.capture import CaptureSupport

    reason = "CUDA graphs are captured; start the engine with --enforce-eager"
    fake_engine.state.runtime.capture = CaptureSupport(2048, reason)
    key = make_tenant(redis_url, "acme")
    r = make(gateway, key, "v", {"positive": OCEAN, "negative": CITY})
    assert r.status_code == 501, r.text
    err = r.json()["error"]
    assert err["code"] == "not_implemented" and "--enforce-eager" in err["message"]
    assert r.headers["x-should-retry"] == "false"
    assert get(gateway, key, "/v1/steering/vectors").json()["data"] == []


def test_a_client_that_leaves_stops_the_job(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    """Each side's examples go to the engine in batches. A client that left used to
    leave its job running: every later batch, the math and the store ran for nobody,
    and were charged. Now the batch in flight is abandoned (its connection closed) and
    nothing after it runs."""
    fake_engine.state.delay_s = 1.0
    key = make_tenant(redis_url, "acme")
    body = {"positive": [f"ocean {i}" for i in range(64)],
            "negative": [f"city {i}" for i in range(64)]}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{gateway.url}/v1/steering/vectors/v/from-examples",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=0.5,
        )
    time.sleep(2.5)  # two more batches' time, had the job gone on
    captures = [b for b in fake_engine.state.requests if b.get("capture")]
    assert len(captures) == 1 and len(fake_engine.state.abandoned) == 1
    fake_engine.state.delay_s = 0.0
    assert get(gateway, key, "/v1/steering/vectors").json()["data"] == []


def test_a_batch_fits_the_engines_capture_bound_on_a_wide_deep_model() -> None:
    """32 examples of every layer of an 80-layer, 8192-wide model were 80 MiB in one
    capture request, over the engine's 64 MiB: every such request was refused."""
    from steergate.gateway.routes.from_examples import BATCH, batch_size
    from steergate.shared.capture import check_capture_bytes, parse_capture

    for hidden, layers in ((576, 30), (4096, 32), (8192, 80), (16384, 126), (65536, 256)):
        batch = batch_size(hidden, layers)
        spec = parse_capture(
            {"sites": [{"hook": "post_block", "layers": list(range(layers))}],
             "tokens": "prompt", "reduce": "mean"}, None,
        )  # fmt: skip
        check_capture_bytes(spec, hidden, batch)  # what the engine checks: it fits
        assert batch == BATCH or batch == 1 or spec.nbytes(hidden, batch + 1) > (64 << 20)
    assert batch_size(576, 30) == BATCH and batch_size(8192, 80) == 25


def test_long_examples_go_to_the_engine_in_short_requests(
    gateway: ServerThread, fake_engine: FakeEngine, redis_url: str
) -> None:
    """Found from outside: one request of 4 examples of 8,000 characters held another
    tenant's 8-token chat for 70 s on a CPU engine, which serves other requests only
    between a job's requests. Each request now carries about BATCH_TOKENS prompt tokens
    at most (4 characters a token; an example longer than that goes alone)."""
    from steergate.gateway.routes.from_examples import BATCH_TOKENS, batches

    key = make_tenant(redis_url, "acme")
    long_pos = [f"{w} " * 1330 for w in ("ocean", "waves", "tides", "spray")]  # 7,980 chars
    long_neg = [f"{w} " * 1330 for w in ("citys", "roads", "trams", "walls")]
    r = make(gateway, key, "long", {"positive": long_pos, "negative": long_neg, "layers": [1]})
    assert r.status_code == 201, r.text
    captures = [b["prompt"] for b in fake_engine.state.requests if b.get("capture")]
    assert [len(p) for p in captures] == [2, 2, 2, 2]  # was [4, 4]
    assert all(sum(len(t) for t in p) // 4 <= BATCH_TOKENS for p in captures)
    fake_engine.state.requests.clear()
    short = [f"the {w}" for w in ("sea", "bay", "tide", "reef")] * 8  # 32 short ones
    r = make(gateway, key, "short", {"positive": short, "negative": CITY * 8, "layers": [1]})
    assert r.status_code == 201, r.text
    captures = [b["prompt"] for b in fake_engine.state.requests if b.get("capture")]
    assert [len(p) for p in captures] == [32, 32]  # short examples: batched as before
    texts = ["x" * 6000] * 5 + ["y" * 100] * 3 + ["z" * 20_000]
    assert batches(list(range(9)), texts, 32) == [[0, 1], [2, 3], [4, 5, 6, 7], [8]]
    assert batches([0, 1, 2], [[1] * 5000, [2] * 10, [3] * 10], 32) == [[0], [1, 2]]
    assert batches(list(range(5)), ["a"] * 5, 2) == [[0, 1], [2, 3], [4]]


def test_activations_that_are_not_finite_are_never_stored(
    gateway: ServerThread, redis_url: str
) -> None:
    """A vector made from an engine's inf activations would turn every token steered by
    it into NaN, in every later request that names it."""
    key = make_tenant(redis_url, "acme")
    r = make(gateway, key, "v", {"positive": ["overflow", "overflow x"], "negative": CITY})
    assert r.status_code == 502 and "not finite" in r.json()["error"]["message"], r.text
    assert get(gateway, key, "/v1/steering/vectors").json()["data"] == []


def test_different_examples_with_identical_activations_store_no_zero_vector(
    gateway: ServerThread, redis_url: str
) -> None:
    """Found from outside: examples whose activations agree gave an all-zero vector,
    stored with 201, that steered nothing. Texts that differ only after "|" have the same
    activations in the stub (as two texts the engine saw as one prompt would)."""
    key = make_tenant(redis_url, "acme")
    pos = ["city one|a", "city two|a"]
    neg = ["city one|b", "city two|b"]
    r = make(gateway, key, "v", {"positive": pos, "negative": neg, "layers": [2]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("layers", "examples_indistinguishable")
    assert "layer 2" in err["message"]
    assert get(gateway, key, "/v1/steering/vectors").json()["data"] == []
    # the engine did the work: it is charged (4 prompts, 5 tokens each, 1 generated each)
    time.sleep(0.3)  # settlement is batched off the hot path
    usage = get(gateway, key, "/v1/usage").json()
    assert usage["tokens_total"] == 24, usage


def test_a_job_larger_than_the_gateways_activation_memory_is_refused_before_any_work(
    start_gateway: Any, fake_engine: FakeEngine, redis_url: str
) -> None:
    """Each job holds examples x layers x hidden x 4 bytes of activations in the gateway;
    with no gateway-wide bound, tenants' concurrent jobs on a wide model held gigabytes."""
    per_example = 4 * HIDDEN * LAYERS  # every layer of the stub model
    gw = start_gateway(examples_memory_bytes=16 * per_example)
    key = make_tenant(redis_url, "acme")
    body = {"layers": "all", "positive": [f"o{i}" for i in range(9)],
            "negative": [f"c{i}" for i in range(8)]}  # fmt: skip
    r = make(gw, key, "v", body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "examples_too_large", r.text
    assert err["param"] == "layers" and "fewer layers or examples" in err["message"]
    assert not [b for b in fake_engine.state.requests if b.get("capture")]
    body["positive"].pop()  # 16 examples: exactly the bound
    assert make(gw, key, "v", body).status_code == 201


def test_other_tenants_jobs_holding_the_memory_give_a_retryable_503_and_free_it(
    start_gateway: Any, fake_engine: FakeEngine, redis_url: str
) -> None:
    """Tenant a's slow job holds 8 examples' activations of a 12-example bound: tenant
    b's 8-example job is refused at once (503 gateway_busy, retryable, no tokens) rather
    than queued behind a's; a's own second job waits its turn and succeeds; once a's
    jobs are done, b's job runs."""
    from concurrent.futures import ThreadPoolExecutor

    per_example = 4 * HIDDEN * LAYERS
    gw = start_gateway(examples_memory_bytes=12 * per_example)
    a, b = make_tenant(redis_url, "acme"), make_tenant(redis_url, "beta")
    body = {"layers": "all", "positive": OCEAN, "negative": CITY}
    fake_engine.state.delay_s = 1.0
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(make, gw, a, "v1", body)
        time.sleep(0.4)  # a's first job holds its memory (its first batch is in flight)
        second = pool.submit(make, gw, a, "v2", body)
        r = make(gw, b, "v", body)
        err = r.json()["error"]
        assert r.status_code == 503 and err["code"] == "gateway_busy", r.text
        assert r.headers["x-should-retry"] == "true"
        assert first.result().status_code == 201 and second.result().status_code == 201
    fake_engine.state.delay_s = 0.0
    usage = get(gw, b, "/v1/usage").json()
    assert usage["quotas"]["tokens_per_minute"]["used"] == 0  # nothing charged
    assert make(gw, b, "v", body).status_code == 201


def test_the_reservation_counts_what_a_chat_template_adds_to_messages_examples() -> None:
    """Found from outside: messages examples were reserved their contents alone
    (characters / 4), while SmolLM2's template adds ~30 tokens to a one-message example,
    so a tenant's job could pass its tokens/min by far more than its own text."""
    shape = ModelShape(hidden_size=HIDDEN, num_layers=LAYERS)
    one = [{"role": "user", "content": "12345678"}]
    two = [{"role": "system", "content": "1234"}, {"role": "user", "content": "5678"}]
    body = {"positive": ["abcdefgh", one], "negative": ["abcdefgh", two]}
    spec = parse_examples_body(body, shape)
    # 32 characters -> 8, two templated examples x 24, three messages x 6, 4 generated
    assert spec.token_estimate == 8 + 2 * 24 + 3 * 6 + 4
    texts = parse_examples_body({"positive": ["abcdefgh"] * 2, "negative": ["12345678"] * 2}, shape)
    assert texts.token_estimate == 8 + 4  # raw prompts: no template
