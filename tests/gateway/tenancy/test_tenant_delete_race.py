"""A tenant deleted while its requests run leaves nothing behind for a tenant re-created
with the same id. A request authenticated before the delete used to be admitted, charged
and latched afterwards: the new tenant listed the old tenant's latch, counted its
requests, and its plain turn on the old conversation was steered by the old tenant's
vectors. Every script that writes a tenant's state now runs behind the tenant generation
prelude (``store/lua/prelude/tenant_generation.lua``): such a request is 401
``invalid_api_key`` and writes nothing.

The race is made deterministic with the request body: the gateway authenticates a request
from its head and admits it once the body is in, so the body's second half is sent after
the delete and the re-creation. The installed gateway, real Redis, the stub engine."""

# ruff: noqa: F811 - pytest fixtures are imported, then named as parameters
from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest

from steergate.gateway.store import key_names as keys
from steergate.gateway.store.scripts import AdmitRequest, Scripts, TenantGone
from steergate.gateway.tenancy.records import Limits, Tenant
from tests.gateway.ops_env import Ops, chat_body, installed_ops  # noqa: F401 - fixture
from tests.harness import aredis_client

HIDDEN = 8


def _send_across(
    ops: Ops, method: str, path: str, key: str, body: bytes, meanwhile: Callable[[], Any]
) -> tuple[int, dict[str, Any]]:
    """``method path`` with ``body``, its first half sent before ``meanwhile()`` runs
    and the rest after: the status and JSON of the answer."""
    url = urlsplit(ops.url)
    half = len(body) // 2
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(head + body[:half])
        meanwhile()
        sock.sendall(body[half:])
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    payload = rest.split(b"\r\n\r\n", 1)[1]
    return int(status_line.split()[1]), orjson.loads(payload)


def _delete_and_recreate(ops: Ops, holder: dict[str, str]) -> Callable[[], None]:
    def go() -> None:
        assert ops.admin("DELETE", "/admin/tenants/victim").status_code == 204
        holder["key"] = ops.tenant("victim", latch_count=8)

    return go


def _latching_turn(conversation: str) -> bytes:
    steering = {"vectors": [{"hook": "post_block", "layers": {"1": [0.5] * HIDDEN}}]}
    body = chat_body(conversation_id=conversation, steering={**steering, "latch": True})
    return orjson.dumps(body)


def _assert_new_tenant_is_clean(ops: Ops, key: str) -> None:
    usage = ops.get(key, "/v1/usage").json()
    assert usage["requests_made"]["total"] == 0, usage["requests_made"]
    assert usage["tokens_total"] == 0
    assert usage["quotas"]["latch_count"]["used"] == 0
    assert usage["quotas"]["vector_count"]["used"] == 0
    assert usage["quotas"]["concurrency"]["used"] == 0
    assert ops.get(key, "/v1/steering/latches").json() == []
    assert ops.get(key, "/v1/steering/vectors").json()["data"] == []


def test_a_turn_admitted_after_its_tenant_was_deleted_leaves_nothing_to_a_new_tenant(
    installed_ops: Ops,
) -> None:
    ops = installed_ops
    old_key = ops.tenant("victim", latch_count=8)
    assert ops.chat(old_key, conversation_id="warm").status_code == 200
    new: dict[str, str] = {}
    status, answer = _send_across(
        ops, "POST", "/v1/chat/completions", old_key, _latching_turn("c1"),
        _delete_and_recreate(ops, new),
    )  # fmt: skip
    assert (status, answer["error"]["code"]) == (401, "invalid_api_key"), answer
    _assert_new_tenant_is_clean(ops, new["key"])
    # The new tenant's own turn on the old conversation is not steered by anything.
    plain = ops.chat(new["key"], conversation_id="c1")
    assert plain.status_code == 200
    assert plain.headers["x-steering-latch"] == "none"
    assert ops.get(new["key"], "/v1/steering/latches").json() == []


def test_a_vector_stored_after_its_tenant_was_deleted_is_refused(installed_ops: Ops) -> None:
    ops = installed_ops
    old_key = ops.tenant("victim")
    body = orjson.dumps({"hook": "post_block", "layers": {"1": [0.25] * HIDDEN}})
    new: dict[str, str] = {}
    status, answer = _send_across(
        ops, "PUT", "/v1/steering/vectors/calm", old_key, body, _delete_and_recreate(ops, new)
    )
    assert (status, answer["error"]["code"]) == (401, "invalid_api_key"), answer
    _assert_new_tenant_is_clean(ops, new["key"])
    assert ops.get(new["key"], "/v1/steering/vectors/calm").status_code == 404


@pytest.mark.parametrize("record", ["missing", "later tenant"])
def test_the_prelude_refuses_a_stale_generation_and_writes_nothing(
    redis_url: str, record: str
) -> None:
    async def go() -> None:
        client = aredis_client(redis_url)
        try:
            scripts = Scripts.load(client)
            old = Tenant(id="gen", created_at=1_764_000_000.123456)
            # A name that spells the old generation does not pass for it.
            forged = f',"created_at":{old.created_at},"x":"'
            now = Tenant(id="gen", name=forged, created_at=1_764_000_000.123457)
            state = keys.admit_keys("gen", 1, "k")  # every key admission may write
            await client.delete(*state, keys.tenant_record("gen"))
            if record == "later tenant":
                await client.set(keys.tenant_record("gen"), now.record())

            def admit(tenant: Tenant) -> AdmitRequest:
                return AdmitRequest(
                    tenant_id="gen", generation=tenant.created_at, now_ms=60_000,
                    limits=Limits(), cost=1, lease_id="l1", lease_expiry_ms=90_000,
                    conversation_id="c1", store_latch=True, latch_bytes=4,
                    latch_kind="value", deadline_ms=0, pending_horizon_ms=1000, key_id="k",
                    key_rpm=0, key_concurrency=0, budget_left_ms=0,
                )  # fmt: skip

            with pytest.raises(TenantGone):
                await scripts.run(admit(old))
            assert await client.exists(*state) == 0
            if record == "later tenant":  # the current generation is admitted
                assert int((await scripts.run(admit(now)))[0]) == 0
                assert await client.zscore(keys.leases("gen"), "l1") == 90_000
        finally:
            await client.aclose()

    asyncio.run(go())
