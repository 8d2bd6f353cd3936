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


def test_a_failed_turn_does_not_bring_back_a_latch_evicted_meanwhile(ops: Ops) -> None:
    key = ops.tenant("acme", latch_count=1)
    assert ops.chat(key, **_turn("c1", 0.1)).status_code == 200
    assert _latched(ops, key) == ["c1"]

    async def evicting(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post(ops.url + "/v1/chat/completions", json=_turn("c2", 0.2))

    failed, evictor = _race(ops, key, evicting)
    assert failed.status_code >= 500, failed.text
    assert evictor.status_code == 200 and evictor.headers["x-steering-latch"] == "evicted_quota"
    ops.wait_for(lambda: ops.get(key, "/v1/usage").json()["quotas"]["latch_count"]["used"] <= 1)
    assert _latched(ops, key) == ["c2"]
    quota = ops.get(key, "/v1/usage").json()["quotas"]["latch_count"]
    assert (quota["used"], quota["limit"]) == (1, 1)
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
