"""The engine as a cache of the gateway's Redis (``steergate_expect``): an engine that
lacks what the system of record holds says so (409, before anything changes or is
generated) instead of serving an unsteered or stale turn; a restore installs the
gateway's copy of a latch and steers exactly like the turn that stored it."""

from __future__ import annotations

from typing import Any

import numpy as np

from steergate.engine.latch import Latch
from steergate.shared.clamp import Bounds, ClampItem
from steergate.shared.engine_api import EXPECT_FIELD
from steergate.shared.latch_spec import LatchSpec, decode_spec
from tests.engine.test_engine_http_unit import (
    AUTH,
    HIDDEN,
    chat,
    env,  # noqa: F401 - the fixture
    inline,
    payload_of,
    vec,
)


async def post(client: Any, **extra: Any) -> Any:
    return await client.post("/v1/chat/completions", json=chat(**extra), headers=AUTH)


async def put_vector(client: Any, name: str, value: float) -> str:
    r = await client.put(
        f"/v1/steering/vectors/{name}",
        json={"hook": "post_block", "layers": {"1": vec(value)}},
        headers=AUTH,
    )
    assert r.status_code in (200, 201), r.text
    return str(r.json()["digest"])


def spec_of(controller: Any, conv: str) -> str:
    latch = controller.get(conv)
    assert latch is not None
    return latch.spec().encode()


async def test_a_missing_latch_is_a_409_not_an_unsteered_turn(env) -> None:  # noqa: F811
    client, seen, plugin = env
    r = await post(client, conversation_id="t~c", **{EXPECT_FIELD: {"latch": "0" * 64}})
    assert r.status_code == 409 and r.json()["error"]["code"] == "latch_missing"
    assert seen == []  # nothing generated


async def test_a_latch_with_other_content_is_a_miss_too(env) -> None:  # noqa: F811
    client, seen, plugin = env
    r = await post(
        client, conversation_id="t~c", steering={"vectors": [inline(value=0.5)], "latch": True}
    )
    assert r.status_code == 200
    held = plugin.runtime.get().controller.get("t~c")
    r = await post(client, conversation_id="t~c", **{EXPECT_FIELD: {"latch": "f" * 64}})
    assert r.status_code == 409 and r.json()["error"]["code"] == "latch_missing"
    r = await post(client, conversation_id="t~c", **{EXPECT_FIELD: {"latch": held.digest}})
    assert r.headers["x-steering-latch"] == "bridged"


async def test_restore_steers_bit_identically_to_the_turn_that_stored_it(env) -> None:  # noqa: F811
    client, seen, plugin = env
    digest = await put_vector(client, "t~calm", 0.25)
    steering = {"vectors": [inline(value=0.5, scale=2.0), {"name": "t~calm", "scale": 3.0}]}
    r = await post(client, conversation_id="t~c", steering={**steering, "latch": True})
    assert r.headers["x-steering-latch"] == "latched"
    stored = payload_of(seen[-1])
    controller = plugin.runtime.get().controller
    spec = spec_of(controller, "t~c")
    assert decode_spec(spec).digest == controller.get("t~c").digest
    controller.delete("t~c")  # the engine lost it (cap eviction, restart)
    expect = {"latch": decode_spec(spec).digest, "vectors": {}}
    r = await post(client, conversation_id="t~c", **{EXPECT_FIELD: expect})
    assert r.status_code == 409
    r = await post(client, conversation_id="t~c", **{EXPECT_FIELD: {**expect, "restore": spec}})
    assert r.status_code == 200 and r.headers["x-steering-latch"] == "restored"
    assert r.json()["steering"] == {"applied": True, "latch": "restored"}
    restored = payload_of(seen[-1])
    assert restored.digest == stored.digest
    assert all(np.array_equal(restored.sites[k], stored.sites[k]) for k in stored.sites)
    # and the next turn is an ordinary bridge of the restored latch
    r = await post(client, conversation_id="t~c", **{EXPECT_FIELD: expect})
    assert r.headers["x-steering-latch"] == "bridged"
    assert payload_of(seen[-1]).digest == stored.digest
    assert digest


async def test_restore_of_a_by_reference_latch_needs_its_vectors(env) -> None:  # noqa: F811
    client, seen, plugin = env
    digest = await put_vector(client, "t~calm", 0.25)
    spec = LatchSpec("all", {}, (("t~gone", digest, 1.0),)).encode()
    r = await post(client, conversation_id="t~c", **{EXPECT_FIELD: {"restore": spec}})
    assert r.status_code == 409 and r.json()["error"]["code"] == "vector_missing"
    assert plugin.runtime.get().controller.get("t~c") is None and seen == []


async def test_restore_against_changed_content_is_dropped_stale(env) -> None:  # noqa: F811
    client, seen, plugin = env
    old = await put_vector(client, "t~calm", 0.25)
    await put_vector(client, "t~calm", 0.75)  # re-registered with other content
    spec = LatchSpec("all", {}, (("t~calm", old, 1.0),)).encode()
    r = await post(client, conversation_id="t~c", **{EXPECT_FIELD: {"restore": spec}})
    assert r.status_code == 200 and r.headers["x-steering-latch"] == "dropped_stale"
    assert "vllm_xargs" not in seen[-1] or "steergate" not in seen[-1]["vllm_xargs"]


async def test_a_restore_that_is_not_the_expected_latch_is_refused(env) -> None:  # noqa: F811
    """The spec sent to restore must be the latch ``latch`` names (its digest): an engine
    that cached another would steer a conversation with a latch its record contradicts."""
    client, seen, plugin = env
    spec = LatchSpec("all", {("post_block", 1): np.full(HIDDEN, 0.5, np.float32)}).encode()
    other = LatchSpec("all", {("post_block", 1): np.full(HIDDEN, 0.25, np.float32)})
    for latch in (other.digest, ""):
        r = await post(
            client, conversation_id="t~c", **{EXPECT_FIELD: {"latch": latch, "restore": spec}}
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == f"{EXPECT_FIELD}.restore"
    assert plugin.runtime.get().controller.get("t~c") is None and seen == []
    expect = {"latch": decode_spec(spec).digest, "restore": spec}
    r = await post(client, conversation_id="t~c", **{EXPECT_FIELD: expect})
    assert r.status_code == 200 and r.headers["x-steering-latch"] == "restored"


async def test_expected_vector_digest_mismatch_is_a_miss(env) -> None:  # noqa: F811
    client, seen, plugin = env
    await put_vector(client, "t~calm", 0.25)
    expect = {"vectors": {"t~calm": "a" * 64}}
    r = await post(client, steering={"vectors": [{"name": "t~calm"}]}, **{EXPECT_FIELD: expect})
    assert r.status_code == 409 and r.json()["error"]["code"] == "vector_missing" and seen == []
    r = await post(
        client,
        steering={"vectors": [{"name": "t~new"}]},
        **{EXPECT_FIELD: {"vectors": {"t~new": "b" * 64}}},
    )
    assert r.status_code == 409 and r.json()["error"]["code"] == "vector_missing"


async def test_expecting_no_latch_drops_a_cached_copy(env) -> None:  # noqa: F811
    client, seen, plugin = env
    r = await post(client, conversation_id="t~c", steering={"vectors": [inline()], "latch": True})
    assert r.headers["x-steering-latch"] == "latched"
    r = await post(client, conversation_id="t~c", **{EXPECT_FIELD: {"latch": ""}})
    assert r.headers["x-steering-latch"] == "none"
    assert "steergate" not in (seen[-1].get("vllm_xargs") or {})
    assert plugin.runtime.get().controller.get("t~c") is None


_UNIT = np.eye(HIDDEN, dtype=np.float32)[0]


def _clamp_spec(bounds: Bounds, direction: np.ndarray) -> str:
    item = ClampItem(bounds, sites={("post_block", 0): direction})
    return LatchSpec("all", {}, (), (item,)).encode()


async def test_a_restored_well_formed_clamp_is_accepted(env) -> None:  # noqa: F811
    """The counterpart of the refused clamps below: the same spec with sound bounds."""
    client, seen, plugin = env
    r = await post(
        client,
        conversation_id="t~c",
        **{EXPECT_FIELD: {"restore": _clamp_spec(Bounds(0.0, 1.0), _UNIT)}},
    )
    assert r.status_code == 200 and r.headers["x-steering-latch"] == "restored", r.text


async def test_bad_expectations_are_400s_naming_the_field(env) -> None:  # noqa: F811
    client, seen, plugin = env
    for bad, param in [
        ("x", EXPECT_FIELD),
        ({"other": 1}, EXPECT_FIELD),
        ({"vectors": {"bad name\n": "d"}}, f"{EXPECT_FIELD}.vectors"),
        ({"latch": 5}, f"{EXPECT_FIELD}.latch"),
        ({"restore": "not json"}, f"{EXPECT_FIELD}.restore"),
        (
            {
                "restore": LatchSpec(
                    "all", {("post_block", 99): np.ones(HIDDEN, np.float32)}
                ).encode()
            },
            f"{EXPECT_FIELD}.restore",
        ),
        (
            {"restore": LatchSpec("all", {("post_block", 0): np.ones(3, np.float32)}).encode()},
            f"{EXPECT_FIELD}.restore",
        ),
        # a clamp the request parser could never have made: min above max, no bound, a
        # direction that is not of unit length (it would scale the projection)
        *(
            ({"restore": _clamp_spec(bounds, direction)}, f"{EXPECT_FIELD}.restore")
            for bounds, direction in [
                (Bounds(2.0, 1.0), _UNIT),
                (Bounds(None, None), _UNIT),
                (Bounds(0.0, 0.0), 3.0 * _UNIT),
            ]
        ),
    ]:
        r = await post(client, conversation_id="t~c", **{EXPECT_FIELD: bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == param
    assert seen == []


def test_latch_digest_is_the_spec_digest() -> None:
    sites = {("post_block", 1): np.arange(HIDDEN, dtype=np.float32)}
    spec = LatchSpec("decode", sites, (("t~v", "d" * 64, 0.5),))
    latch = Latch.from_spec(decode_spec(spec.encode()))
    assert latch.digest == spec.digest
    assert decode_spec(spec.encode()).digest == spec.digest
    assert LatchSpec("all", sites, spec.refs).digest != spec.digest  # phase is identity


async def test_a_bad_restore_or_expectation_is_refused_naming_the_field_it_came_in(
    env,  # noqa: F811
) -> None:
    """Found from outside (the gateway's own fields, sent with the engine token): a
    restore whose reference scale was inf, or whose sites passed the steering bound, was
    a 400 naming ``steering.vectors``, a field the request did not have; ``vectors`` of
    ``[]`` or ``0`` passed as "none". Each is a 400 naming what carried it, and nothing
    is stored or served."""
    client, seen, plugin = env
    digest = await put_vector(client, "t~calm", 0.25)
    inf_scale = LatchSpec("all", {}, (("t~calm", digest, float("inf")),)).encode()
    huge = np.full(HIDDEN, 2e6, dtype=np.float32)
    past_bound = LatchSpec("all", {("post_block", 1): huge}, ()).encode()
    clamp_past_bound = _clamp_spec(Bounds(0.0, 2e6), _UNIT)
    for spec, says in (
        (inf_scale, "is not a latch spec: non-finite scale"),
        (past_bound, "at most 1e+06"),
        (clamp_past_bound, "a clamp bound of 2000000 is beyond 1e+06"),
    ):
        r = await post(client, conversation_id="t~c", **{EXPECT_FIELD: {"restore": spec}})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == f"{EXPECT_FIELD}.restore" and says in err["message"], err
        assert err["message"].startswith(f"'{EXPECT_FIELD}.restore'"), err
        assert "steering.vectors" not in err["message"], err
    for vectors in ([], 0):
        r = await post(client, conversation_id="t~c", **{EXPECT_FIELD: {"vectors": vectors}})
        assert r.status_code == 400 and r.json()["error"]["param"] == f"{EXPECT_FIELD}.vectors"
    assert plugin.runtime.get().controller.get("t~c") is None and seen == []


async def test_bridging_a_latch_checks_its_vectors_against_what_the_gateway_expects(
    env,  # noqa: F811
) -> None:
    """The gateway sends the digests Redis holds for the vectors a latch steers with: an
    engine whose copy of one is other content (it missed a write) answers 409
    ``vector_missing`` instead of bridging with it; once it holds Redis's content, a
    latch made with other content is ``dropped_stale``."""
    client, seen, plugin = env
    old = await put_vector(client, "t~calm", 0.25)
    r = await post(
        client, conversation_id="t~c", steering={"vectors": [{"name": "t~calm"}], "latch": True}
    )
    assert r.headers["x-steering-latch"] == "latched"
    latch = plugin.runtime.get().controller.get("t~c").digest
    n = len(seen)
    expect = {"latch": latch, "vectors": {"t~calm": "0" * 64}}  # Redis holds other content
    r = await post(client, conversation_id="t~c", **{EXPECT_FIELD: expect})
    assert r.status_code == 409 and r.json()["error"]["code"] == "vector_missing"
    assert len(seen) == n and plugin.runtime.get().controller.get("t~c") is not None
    # as it was: bridged
    expect = {"latch": latch, "vectors": {"t~calm": old}}
    r = await post(client, conversation_id="t~c", **{EXPECT_FIELD: expect})
    assert r.headers["x-steering-latch"] == "bridged"
    # the gateway installs Redis's content: the latch is stale
    current = await put_vector(client, "t~calm", 0.75)
    expect = {"latch": latch, "vectors": {"t~calm": current}}
    r = await post(client, conversation_id="t~c", **{EXPECT_FIELD: expect})
    assert r.headers["x-steering-latch"] == "dropped_stale"


async def test_a_restore_checks_its_vectors_before_finding_the_latch_stale(
    env,  # noqa: F811
) -> None:
    """A restore whose vector this engine holds with other content than Redis's is a
    miss (install, then restore), not ``dropped_stale``: the latch is valid."""
    client, seen, plugin = env
    current = await put_vector(client, "t~calm", 0.75)
    await put_vector(client, "t~calm", 0.25)  # this engine's copy is behind Redis
    spec = LatchSpec("all", {}, (("t~calm", current, 1.0),))
    expect = {"latch": spec.digest, "vectors": {"t~calm": current}, "restore": spec.encode()}
    r = await post(client, conversation_id="t~c", **{EXPECT_FIELD: expect})
    assert r.status_code == 409 and r.json()["error"]["code"] == "vector_missing"
    assert plugin.runtime.get().controller.get("t~c") is None and seen == []
    await put_vector(client, "t~calm", 0.75)  # what the gateway installs from Redis
    r = await post(client, conversation_id="t~c", **{EXPECT_FIELD: expect})
    assert r.status_code == 200 and r.headers["x-steering-latch"] == "restored"
