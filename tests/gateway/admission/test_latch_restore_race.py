"""A latching turn that fails puts the conversation's earlier latch state back
(``settle_request.lua`` action ``restore``). It used to do so even when the entry its
admission left had been removed meanwhile, by another turn's quota eviction or by the
client's DELETE: the latch came back over the quota, without its spec (so it never
steered again), and a 204 DELETE did not stick. Real Redis, a real gateway, the stub
engine's ``fake_raise`` as the failure."""

# ruff: noqa: F811 - pytest fixtures are imported, then named as parameters
from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tests.gateway.ops_env import Ops, bearer, chat_body, ops  # noqa: F401 - fixture

HIDDEN = 8


def _turn(conversation: str, value: float, **extra: Any) -> dict[str, Any]:
    steering = {"vectors": [{"hook": "post_block", "layers": {"1": [value] * HIDDEN}}]}
    return chat_body(conversation_id=conversation, steering={**steering, "latch": True}, **extra)


def _latched(ops: Ops, key: str) -> list[str]:
    listed = ops.get(key, "/v1/steering/latches").json()
    return sorted(row["conversation_id"] for row in listed)


def _race(ops: Ops, key: str, meanwhile: Any) -> tuple[httpx.Response, Any]:
    """A latching turn on c1 that the engine fails after 0.5 s, and ``meanwhile``
    (a coroutine factory taking the client) started 0.1 s into it."""

    async def go() -> tuple[httpx.Response, Any]:
        async with httpx.AsyncClient(timeout=30, headers=bearer(key)) as client:

            async def failing() -> httpx.Response:
                body = _turn("c1", 0.3, fake_delay=0.5, fake_raise=True)
                return await client.post(ops.url + "/v1/chat/completions", json=body)

            async def other() -> Any:
                await asyncio.sleep(0.1)
                return await meanwhile(client)

            return await asyncio.gather(failing(), other())

    return asyncio.run(go())


def _c2_takes_the_one_place_during_a_failing_c1_turn(ops: Ops, first: str) -> str:
    """A tenant with one latch place latches ``first``; then a latching turn on c1
    fails (after 0.5 s) while one on c2 latches, evicting. Afterwards c2 alone is
    latched, within the quota. The tenant's key."""
    key = ops.tenant("acme", latch_count=1)
    assert ops.chat(key, **_turn(first, 0.1)).status_code == 200
    assert _latched(ops, key) == [first]

    async def latching(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post(ops.url + "/v1/chat/completions", json=_turn("c2", 0.2))

    failed, other = _race(ops, key, latching)
    assert failed.status_code >= 500, failed.text
    assert other.status_code == 200 and other.headers["x-steering-latch"] == "evicted_quota"
    ops.wait_for(lambda: ops.get(key, "/v1/usage").json()["quotas"]["latch_count"]["used"] <= 1)
    assert _latched(ops, key) == ["c2"]
    quota = ops.get(key, "/v1/usage").json()["quotas"]["latch_count"]
    assert (quota["used"], quota["limit"]) == (1, 1)
    return key


def test_a_failed_turn_does_not_bring_back_a_latch_evicted_meanwhile(ops: Ops) -> None:
    key = _c2_takes_the_one_place_during_a_failing_c1_turn(ops, "c1")
    # c1's next plain turn is unsteered and latches nothing; c2's is still steered.
    assert ops.chat(key, conversation_id="c1").headers["x-steering-latch"] == "none"
    steered = ops.chat(key, conversation_id="c2").headers["x-steering-latch"]
    assert steered in ("bridged", "restored")
    assert _latched(ops, key) == ["c2"]


def test_a_delete_during_a_failing_turn_sticks(ops: Ops) -> None:
    key = ops.tenant("acme", latch_count=4)
    assert ops.chat(key, **_turn("c1", 0.1)).status_code == 200

    async def deleting(client: httpx.AsyncClient) -> httpx.Response:
        return await client.delete(ops.url + "/v1/steering/latches/c1")

    failed, deleted = _race(ops, key, deleting)
    assert failed.status_code >= 500, failed.text
    assert deleted.status_code == 204, deleted.text
    ops.wait_for(lambda: ops.get(key, "/v1/usage").json()["requests_made"]["total"] >= 2)
    assert _latched(ops, key) == []
    assert ops.get(key, "/v1/usage").json()["quotas"]["latch_count"]["used"] == 0


def _text(r: httpx.Response) -> str:
    return str(r.json()["choices"][0]["message"]["content"])


def _steered(ops: Ops, key: str, value: float) -> str:
    """What a turn steered by ``value`` (as ``_turn`` latches it) answers, latching nothing."""
    steering = {"vectors": [{"hook": "post_block", "layers": {"1": [value] * HIDDEN}}]}
    return _text(ops.chat(key, steering=steering))


def _put(ops: Ops, key: str, name: str, value: float) -> int:
    body = {"hook": "post_block", "layers": {"1": [value] * HIDDEN}}
    r = httpx.put(ops.url + f"/v1/steering/vectors/{name}", json=body, headers=bearer(key))
    return r.status_code


def test_a_failed_turn_does_not_undo_a_latch_another_turn_recorded_meanwhile(ops: Ops) -> None:
    """Turn A latches X on c1; turn B, admitted while A's entry was still pending,
    latches Y and fails after A recorded X. B's settlement put back the entry it had
    found (A's pending one, without a digest) over A's recorded X: the next turns sent
    no expectation, so the engine bridged B's abandoned Y, and after a restart
    nothing."""
    key = ops.tenant("acme")
    x = _steered(ops, key, 0.1)  # what X steers to

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=30, headers=bearer(key)) as client:
            url = ops.url + "/v1/chat/completions"

            async def a() -> httpx.Response:
                return await client.post(url, json=_turn("c1", 0.1, fake_delay=0.5))

            async def b() -> httpx.Response:
                await asyncio.sleep(0.1)
                body = _turn("c1", 0.9, fake_delay=1.0, fake_raise=True)
                return await client.post(url, json=body)

            return await asyncio.gather(a(), b())

    ra, rb = asyncio.run(go())
    assert ra.status_code == 200 and ra.headers["x-steering-latch"] == "latched", ra.text
    assert rb.status_code >= 500, rb.text
    ops.wait_for(lambda: ops.get(key, "/v1/usage").json()["requests_made"]["total"] >= 3)
    r = ops.chat(key, conversation_id="c1")
    assert r.headers["x-steering-latch"] in ("bridged", "restored") and _text(r) == x


def test_a_stale_turn_settling_late_does_not_drop_a_latch_made_since(ops: Ops) -> None:
    """A plain turn on c1 whose by-reference latch went stale (its vector changed) is
    answered dropped_stale; while it ran, the client latched c1 anew. The slow turn's
    settlement then dropped whatever c1 held: the new latch and its spec."""
    key = ops.tenant("acme")
    assert _put(ops, key, "v", 0.2) == 201
    by_ref = {"vectors": [{"name": "v"}], "latch": True}
    assert ops.chat(key, conversation_id="c1", steering=by_ref).status_code == 200
    assert _put(ops, key, "v", 0.4) == 200  # c1's latch is stale now
    new = _steered(ops, key, 0.7)

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=30, headers=bearer(key)) as client:
            url = ops.url + "/v1/chat/completions"

            async def stale() -> httpx.Response:
                return await client.post(url, json=chat_body(conversation_id="c1", fake_delay=1.0))

            async def relatch() -> httpx.Response:
                await asyncio.sleep(0.2)
                return await client.post(url, json=_turn("c1", 0.7))

            return await asyncio.gather(stale(), relatch())

    rs, rl = asyncio.run(go())
    assert rs.headers["x-steering-latch"] == "dropped_stale", rs.text
    assert rl.headers["x-steering-latch"] == "latched", rl.text
    ops.wait_for(lambda: ops.get(key, "/v1/usage").json()["requests_made"]["total"] >= 6)
    assert _latched(ops, key) == ["c1"]
    r = ops.chat(key, conversation_id="c1")
    assert r.headers["x-steering-latch"] in ("bridged", "restored") and _text(r) == new


def test_a_failed_shrinking_turn_never_puts_the_tenant_over_its_latch_bytes(ops: Ops) -> None:
    """c1 holds 64 bytes of a 64-byte quota. A turn replacing it with 32 bytes freed
    the other 32 at admission; c2 latched 32 bytes into them meanwhile; the turn then
    failed and its settlement put c1's 64 bytes back: 96 of 64. Now the replaced
    latch's bytes stay held until the turn settles, so c2 had to make room by the
    quota's own rule (evicting c1, the least recently used) and the quota holds."""
    key = ops.tenant("acme", latch_bytes=4 * HIDDEN * 2, latch_count=10)
    two_sites = {"hook": "post_block", "layers": {"1": [0.1] * HIDDEN, "2": [0.1] * HIDDEN}}
    body = chat_body(conversation_id="c1", steering={"vectors": [two_sites], "latch": True})
    assert ops.chat(key, **body).status_code == 200

    async def latching_c2(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post(ops.url + "/v1/chat/completions", json=_turn("c2", 0.2))

    failed, other = _race(ops, key, latching_c2)  # c1 -> 32 bytes, failing after 0.5 s
    assert failed.status_code >= 500, failed.text
    assert other.status_code == 200 and other.headers["x-steering-latch"] == "evicted_quota"
    ops.wait_for(lambda: ops.get(key, "/v1/usage").json()["requests_made"]["total"] >= 3)
    quota = ops.get(key, "/v1/usage").json()["quotas"]["latch_bytes"]
    assert quota["used"] <= quota["limit"] == 64, quota
    assert _latched(ops, key) == ["c2"] and quota["used"] == 32


def test_a_failed_turn_puts_back_what_it_evicted_only_where_it_still_fits(ops: Ops) -> None:
    """The failing turn on c1 evicts c0 at admission; c2 latches meanwhile, evicting
    c1's pending entry and taking the one place. c1's failure would put c0 back, but
    the quota has no room for it now: c2 alone stays, within the quota."""
    _c2_takes_the_one_place_during_a_failing_c1_turn(ops, "c0")


def test_a_failed_turn_alone_puts_back_the_latch_it_evicted(ops: Ops) -> None:
    key = ops.tenant("acme", latch_count=1)
    assert ops.chat(key, **_turn("c0", 0.1)).status_code == 200
    body = _turn("c1", 0.3, fake_raise=True)
    r = httpx.post(ops.url + "/v1/chat/completions", json=body, headers=bearer(key), timeout=30)
    assert r.status_code >= 500, r.text
    ops.wait_for(lambda: _latched(ops, key) == ["c0"])
    state = ops.chat(key, conversation_id="c0").headers["x-steering-latch"]
    assert state in ("bridged", "restored")
