"""Issue 9, items 1 and 8, as the attacks: a tenant sends ids with a trailing newline,
bad numbers and 1,000-deep JSON through the gateway. Each is a 400 in the contract's
error shape naming the field, and nothing of it reaches the engine."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.gateway.conftest import ADMIN_KEY, FakeEngine, make_tenant
from tests.gateway.servers import ServerThread

CHAT = "/v1/chat/completions"
HIDDEN = 8


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": "fake",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **extra,
    }


def inline(layers: dict[str, Any] | None = None, **term: Any) -> dict[str, Any]:
    layers = layers if layers is not None else {"1": [0.5] * HIDDEN}
    return {"vectors": [{"hook": "post_block", "layers": layers, **term}]}


def error(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code", "request_id"}
    assert body["error"]["type"] == "invalid_request_error"
    return dict(body["error"])


def nothing_reached(engine: FakeEngine) -> None:
    assert engine.state.requests == [] and engine.state.latches == {}
    assert engine.state.vectors == {}


def test_trailing_newline_ids_are_refused_and_never_reach_the_engine(
    gateway: ServerThread, redis_url: str, fake_engine: FakeEngine
) -> None:
    """The audit's isolation break: "chat-1\\n" and "calm\\n" used to pass the id checks
    and were written into the engine's request line."""
    h = auth(make_tenant(redis_url, "acme"))
    for conv in ("chat-1\n", "chat-1\r\n", "chat-1\x00", " chat-1", "chat-1 ", "chat-١"):
        r = httpx.post(
            gateway.url + CHAT,
            headers=h,
            json=chat(conversation_id=conv, steering={**inline(), "latch": True}),
        )
        assert error(r)["code"] == "invalid_conversation_id", conv
    steering = {"vectors": [{"name": "calm\n", "scale": 2}]}
    r = httpx.post(gateway.url + CHAT, headers=h, json=chat(steering=steering))
    err = error(r)
    assert (err["code"], err["param"]) == ("invalid_vector_name", "steering.vectors[0].name")
    body = {"hook": "post_block", "layers": {"1": [0.5] * HIDDEN}}
    r = httpx.put(gateway.url + "/v1/steering/vectors/calm%0A", headers=h, json=body)
    assert error(r)["code"] == "invalid_vector_name"
    for path in ("/v1/steering/vectors/calm%0A", "/v1/steering/vectors/calm%09"):
        assert error(httpx.get(gateway.url + path, headers=h))["code"] == "invalid_vector_name"
    r = httpx.delete(gateway.url + "/v1/steering/latches/chat-1%0A", headers=h)
    assert error(r)["code"] == "invalid_conversation_id"
    nothing_reached(fake_engine)


def test_dot_segment_names_are_refused_where_a_url_could_never_name_them(
    gateway: ServerThread, redis_url: str, fake_engine: FakeEngine
) -> None:
    """A vector or conversation named "." or ".." could be made (by its name in a body or
    an encoded path) but never read or deleted: HTTP clients resolve the dot segment of
    /v1/steering/vectors/.. before sending it. Both are 400 naming the field."""
    h = auth(make_tenant(redis_url, "acme"))
    for conv in (".", ".."):
        body = chat(conversation_id=conv, steering={**inline(), "latch": True})
        r = httpx.post(gateway.url + CHAT, headers=h, json=body)
        assert error(r)["code"] == "invalid_conversation_id", conv
        r = httpx.delete(
            gateway.url + "/v1/steering/latches/" + conv.replace(".", "%2E"), headers=h
        )
        assert error(r)["code"] == "invalid_conversation_id", conv
    vector = {"hook": "post_block", "layers": {"1": [0.5] * HIDDEN}}
    for name in ("%2E", "%2E%2E"):
        r = httpx.put(gateway.url + "/v1/steering/vectors/" + name, headers=h, json=vector)
        err = error(r)
        assert (err["code"], err["param"]) == ("invalid_vector_name", "name"), name
    steering = {"vectors": [{"name": "..", "scale": 2}]}
    err = error(httpx.post(gateway.url + CHAT, headers=h, json=chat(steering=steering)))
    assert (err["code"], err["param"]) == ("invalid_vector_name", "steering.vectors[0].name")
    # Names that only contain dots among other characters stay valid.
    assert httpx.put(gateway.url + "/v1/steering/vectors/...", headers=h, json=vector).is_success
    assert httpx.put(gateway.url + "/v1/steering/vectors/v1.2", headers=h, json=vector).is_success
    assert fake_engine.state.requests == [] and fake_engine.state.latches == {}


def test_a_trailing_slash_is_404_not_a_redirect_to_the_host_header(
    gateway: ServerThread, redis_url: str
) -> None:
    """Starlette answered /v1/usage/ with a 307 to http://<Host header>/v1/models: a
    redirect to wherever the request said it was sent. Paths are exact, as OpenAI's are."""
    h = {**auth(make_tenant(redis_url, "acme")), "Host": "evil.example"}
    for method, path in (("POST", CHAT + "/"), ("GET", "/v1/usage/"), ("GET", "/healthz/")):
        r = httpx.request(method, gateway.url + path, headers=h, json=chat())
        assert "location" not in r.headers, (path, r.headers)
        assert r.status_code == 404, (path, r.status_code)
        assert r.json()["error"]["code"] == "not_found", r.text
    assert httpx.get(gateway.url + "/v1/models", headers=h).status_code == 200
    # The dashboard, the one path people type with a slash, goes to its page by path.
    r = httpx.get(gateway.url + "/dashboard/", headers={"Host": "evil.example"})
    assert (r.status_code, r.headers["location"]) == (308, "/dashboard")


def test_admin_cannot_create_a_tenant_whose_id_ends_in_a_newline(
    gateway: ServerThread, fake_engine: FakeEngine
) -> None:
    """ "acme\\n" would scope as "acme\\n~…", outside every check of "acme"'s prefix."""
    h = auth(ADMIN_KEY)
    for tenant_id in ("acme\n", "acme\r", "acme ", "\tacme", "acme\x00", "acme²", "ａcme"):
        r = httpx.post(gateway.url + "/admin/tenants", headers=h, json={"id": tenant_id})
        err = error(r)
        assert (err["code"], err["param"]) == ("invalid_tenant_id", "id"), tenant_id
    listed = httpx.get(gateway.url + "/admin/tenants", headers=h)
    assert listed.status_code == 200 and "acme" not in listed.text


@pytest.mark.parametrize(
    ("steering", "param"),
    [
        (inline(scale=1e300), "steering.vectors[0].scale"),
        (inline(scale=-1e300), "steering.vectors[0].scale"),
        (inline({"1": [3e38] * HIDDEN}, scale=4), "steering.vectors[0].scale"),
        (inline({"²": [0.5] * HIDDEN}), "steering.vectors[0].layers.²"),
        (inline({"١": [0.5] * HIDDEN}), "steering.vectors[0].layers.١"),
        (inline({"01": [0.5] * HIDDEN}), "steering.vectors[0].layers.01"),
        # an unhashable hook was a 500 (TypeError) in the pre-admission scan
        (inline(hook=["post_block"]), "steering.vectors[0].hook"),
        (inline(hook={"a": 1}), "steering.vectors[0].hook"),
    ],
)
def test_bad_numbers_are_a_400_naming_the_field(
    gateway: ServerThread,
    redis_url: str,
    fake_engine: FakeEngine,
    steering: dict[str, Any],
    param: str,
) -> None:
    """scale 1e300 was latched as Inf (empty output); "²" was a 500; "١" meant layer 1."""
    h = auth(make_tenant(redis_url, "acme"))
    r = httpx.post(
        gateway.url + CHAT,
        headers=h,
        json=chat(conversation_id="c1", steering={**steering, "latch": True}),
    )
    err = error(r)
    assert err["param"] == param and err["code"] == "invalid_request"
    nothing_reached(fake_engine)


def deep(depth: int = 1000) -> bytes:
    return b"[" * depth + b"]" * depth


def test_json_nested_1000_deep_is_a_400_on_every_json_route(
    gateway: ServerThread, redis_url: str, fake_engine: FakeEngine
) -> None:
    """It parsed, passed admission, then 500ed in the re-serializer."""
    h = {**auth(make_tenant(redis_url, "acme")), "content-type": "application/json"}
    nested_field = b'{"model":"fake","messages":[],"extra":' + deep() + b"}"
    for path, method, hdrs, raw in [
        (CHAT, "POST", h, deep()),
        (CHAT, "POST", h, nested_field),
        ("/v1/completions", "POST", h, nested_field),
        ("/v1/steering/vectors/calm", "PUT", h, b'{"hook":"post_block","layers":' + deep() + b"}"),
        (
            "/admin/tenants",
            "POST",
            {**auth(ADMIN_KEY), "content-type": "application/json"},
            b'{"id":"bob","limits":' + deep() + b"}",
        ),
    ]:
        r = httpx.request(method, gateway.url + path, headers=hdrs, content=raw)
        err = error(r)
        assert (err["code"], err["param"]) == ("invalid_json", "body"), path
    nothing_reached(fake_engine)


def test_json_at_the_depth_bound_still_works(
    gateway: ServerThread, redis_url: str, fake_engine: FakeEngine
) -> None:
    h = auth(make_tenant(redis_url, "acme"))
    value: Any = "x"
    for _ in range(60):
        value = {"k": value}
    r = httpx.post(gateway.url + CHAT, headers=h, json=chat(metadata_like=value))
    assert r.status_code == 200, r.text


def test_a_client_cannot_send_the_gateways_word_to_the_engine(
    gateway: ServerThread, redis_url: str, fake_engine: FakeEngine
) -> None:
    """``steergate_expect`` is what the gateway tells the engine Redis holds; the engine
    trusts it. The audit's attack: forwarded as sent on an unsteered turn without named
    vectors, its ``restore`` made the engine install a latch of the client's choosing
    (outside the Redis ledger and quota; by reference, even another tenant's vector)."""
    from steergate.shared.engine_api import EXPECT_FIELD
    from steergate.shared.latch_spec import LatchSpec

    victim = auth(make_tenant(redis_url, "beta"))
    put = httpx.put(
        gateway.url + "/v1/steering/vectors/secret",
        headers=victim,
        json={"hook": "post_block", "layers": {"1": [0.5] * HIDDEN}},
    )
    assert put.status_code == 201, put.text
    digest = put.json()["digest"]
    fake_engine.state.requests.clear()
    planted = LatchSpec("all", refs=(("beta~secret", digest, 4.0),))
    h = auth(make_tenant(redis_url, "acme"))
    for expect in (
        {"restore": planted.encode(), "latch": planted.digest},
        {"latch": ""},
        {"bogus": 1},
        None,
    ):
        for extra in ({"conversation_id": "c1"}, {}, {"steering": inline()}):
            body = chat(**extra, **{EXPECT_FIELD: expect})
            r = httpx.post(gateway.url + CHAT, headers=h, json=body)
            err = error(r)
            assert err["param"] == EXPECT_FIELD and "gateway" in err["message"]
    assert fake_engine.state.requests == []
    assert "acme~c1" not in fake_engine.state.latches
    # Without the field the same turns go through, and carry only the gateway's word.
    r = httpx.post(gateway.url + CHAT, headers=h, json=chat(conversation_id="c1"))
    assert r.status_code == 200, r.text
    assert fake_engine.state.requests[-1].get(EXPECT_FIELD) == {"latch": ""}


@pytest.mark.parametrize("asked", ["no", 0, 1, [], {}])
def test_include_usage_must_be_a_boolean(
    gateway: ServerThread, redis_url: str, fake_engine: FakeEngine, asked: Any
) -> None:
    """The gateway overwrites ``include_usage`` (it meters the usage chunk), so vLLM never
    saw the client's value: ``"no"`` was read as yes, by Python truthiness."""
    h = auth(make_tenant(redis_url, "acme"))
    body = chat(stream=True, stream_options={"include_usage": asked})
    err = error(httpx.post(gateway.url + CHAT, headers=h, json=body))
    assert err["param"] == "stream_options.include_usage"
    assert fake_engine.state.requests == []


@pytest.mark.parametrize("n", [129, 5000, 10**12, 0, -1, True, 1.5, "2"])
def test_n_is_bounded_before_admission(
    gateway: ServerThread, redis_url: str, fake_engine: FakeEngine, n: Any
) -> None:
    """vLLM fans ``n`` out into n requests: one request with n = 5000 queued 5000 ahead
    of every tenant's for minutes on the CPU engine (found by probing ``steergate up``).
    128 is OpenAI's bound; nothing is admitted or sent."""
    h = auth(make_tenant(redis_url, "acme", rpm=1))
    err = error(httpx.post(gateway.url + CHAT, headers=h, json=chat(n=n)))
    assert err["param"] == "n" and "1..128" in err["message"]
    assert fake_engine.state.requests == []
    r = httpx.post(gateway.url + CHAT, headers=h, json=chat(n=128))
    assert r.status_code == 200, r.text  # the refusal spent no request of rpm 1


def test_a_number_no_double_holds_is_a_400_naming_its_field_on_every_json_route(
    gateway: ServerThread, redis_url: str, fake_engine: FakeEngine
) -> None:
    """Found from outside: ``"max_tokens": 1000...0`` (400 digits) or ``1e400`` is valid
    JSON, yet the gateway called it "not valid JSON" (``invalid_json``), because orjson
    refuses numbers past a double's range; the field was not named."""
    h = {**auth(make_tenant(redis_url, "acme")), "content-type": "application/json"}
    huge = b"1" + b"0" * 400
    admin = {**auth(ADMIN_KEY), "content-type": "application/json"}
    for path, method, hdrs, raw, param in [
        (CHAT, "POST", h, b'{"model":"fake","messages":[],"max_tokens":' + huge + b"}",
         "max_tokens"),
        (CHAT, "POST", h, b'{"model":"fake","messages":[],"temperature":-1e400}', "temperature"),
        ("/v1/completions", "POST", h,
         b'{"model":"fake","prompt":"x","steering":{"vectors":[{"hook":"post_block",'
         b'"layers":{"1":[0.5,' + huge + b"]}}]}}",
         "steering.vectors[0].layers.1[1]"),
        ("/v1/steering/vectors/calm", "PUT", h,
         b'{"hook":"post_block","layers":{"0":[1e999]}}', "layers.0[0]"),
        ("/admin/tenants", "POST", admin,
         b'{"id":"bob","limits":{"requests_per_minute":' + huge + b"}}",
         "limits.requests_per_minute"),
    ]:
        r = httpx.request(method, gateway.url + path, headers=hdrs, content=raw)
        err = error(r)
        assert (err["code"], err["param"]) == ("invalid_request", param), (path, err)
        assert "too large" in err["message"]
    # Not an object: still the object fault.
    r = httpx.post(gateway.url + CHAT, headers=h, content=b"[1e400]")
    assert (error(r)["code"], error(r)["param"]) == ("invalid_json", "body")
    nothing_reached(fake_engine)


@pytest.mark.parametrize("op", ["add", "clamp", "ablate"])
def test_a_named_term_with_an_unknown_key_is_the_same_400_whatever_the_bodys_size(
    gateway: ServerThread, redis_url: str, fake_engine: FakeEngine, op: str
) -> None:
    """Found from outside: a named term with an unknown key and a name the tenant lacks
    was ``unknown_vector`` under 256 KiB (names checked at admission) and
    ``invalid_request`` for the key above it (a large body is parsed first)."""
    h = auth(make_tenant(redis_url, "acme"))
    term = {"name": "nope", "op": op, "scal": 2}
    if op == "clamp":
        term["max"] = 1.0
    for padding in ("", "x" * (300 * 1024)):
        body = chat(steering={"vectors": [term]})
        body["messages"][0]["content"] += padding
        r = httpx.post(gateway.url + CHAT, headers=h, json=body, timeout=30)
        err = error(r)
        assert (err["code"], err["param"]) == ("invalid_request", "steering.vectors[0].scal"), (
            len(padding), err,
        )
    nothing_reached(fake_engine)
