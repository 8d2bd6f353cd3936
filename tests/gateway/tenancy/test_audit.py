"""Issue 13 item 4: the audit log. Every admin write is recorded with its actor, action,
target, time and changed fields, never a secret or a key hash; ``GET /admin/audit``
filters by ``since`` and ``limit`` (newest first); the stream is bounded; ``steergate
audit`` prints it. Live gateway, stub engine, real Redis."""

# ruff: noqa: F811 - pytest fixtures are imported, then named as parameters
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import orjson
import pytest

from steergate.gateway.store import key_names as keys
from steergate.gateway.tenancy import api_keys as apikeys
from steergate.gateway.tenancy import audit
from tests.gateway.conftest import PEPPER
from tests.gateway.ops_env import Ops, bearer, cli, ops  # noqa: F401 - fixture
from tests.harness import aredis_client, redis_client


def entries(ops: Ops, **params: Any) -> list[dict[str, Any]]:
    r = ops.admin("GET", "/admin/audit", params=params)
    assert r.status_code == 200, r.text
    return r.json()["entries"]  # type: ignore[no-any-return]


def ok(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    return r.json() if r.content else {}


def test_every_admin_write_is_recorded_with_actor_action_target_and_fields(ops: Ops) -> None:
    t0 = time.time()
    ok(ops.admin("POST", "/admin/tenants", json={"id": "acme", "limits": {"rpm": 30}}), 201)
    ok(ops.admin("PATCH", "/admin/tenants/acme", json={"limits": {"rpm": 60}, "name": "A"}), 200)
    admin = ok(ops.admin("POST", "/admin/keys", json={"role": "admin", "name": "ops"}), 201)
    as_admin = {"headers": bearer(admin["key"]), "timeout": 10}
    key = ok(
        httpx.post(
            ops.url + "/admin/tenants/acme/keys",
            json={"name": "bot", "scopes": ["usage"], "limits": {"rpm": 5}},
            **as_admin,
        ),
        201,
    )
    ok(httpx.post(ops.url + f"/admin/keys/{key['key_id']}/rotate", json={"grace_s": 60},
                  **as_admin), 200)  # fmt: skip
    ok(httpx.delete(ops.url + f"/admin/keys/{key['key_id']}", **as_admin), 204)
    viewer = ok(ops.admin("POST", "/admin/keys", json={"role": "viewer"}), 201)
    ok(httpx.delete(ops.url + f"/admin/keys/{viewer['key_id']}", **as_admin), 204)
    ok(ops.admin("DELETE", "/admin/tenants/acme"), 204)
    # Refused or failed writes change nothing and are not entries.
    assert ops.admin("POST", "/admin/tenants", json={"id": "Bad"}).status_code == 400
    assert ops.admin("DELETE", "/admin/keys/key_ghost").status_code == 404

    log = entries(ops)
    assert all(t0 - 1 <= e["time"] <= time.time() + 1 for e in log)
    assert [e["time"] for e in log] == sorted((e["time"] for e in log), reverse=True)
    got = [(e["actor"], e["role"], e["action"], e["target"]) for e in reversed(log)]
    assert got == [
        ("bootstrap", "admin", "tenant.create", "acme"),
        ("bootstrap", "admin", "tenant.update", "acme"),
        ("bootstrap", "admin", "admin_key.create", admin["key_id"]),
        (admin["key_id"], "admin", "key.create", key["key_id"]),
        (admin["key_id"], "admin", "key.rotate", key["key_id"]),
        (admin["key_id"], "admin", "key.revoke", key["key_id"]),
        ("bootstrap", "admin", "admin_key.create", viewer["key_id"]),
        (admin["key_id"], "admin", "admin_key.revoke", viewer["key_id"]),
        ("bootstrap", "admin", "tenant.delete", "acme"),
    ]
    fields = [e["fields"] for e in reversed(log)]
    assert fields[0]["limits"]["rpm"] == 30 and fields[0]["name"] == ""
    assert fields[1] == {"limits.rpm": [30, 60], "name": ["", "A"]}
    assert fields[2] == {"role": "admin", "name": "ops"}
    assert fields[3] == {
        "tenant_id": "acme",
        "name": "bot",
        "scopes": ["usage"],
        "limits": {"rpm": 5, "max_concurrency": None},
        "expires_at": None,
    }
    assert fields[4]["tenant_id"] == "acme" and fields[4]["grace_s"] == 60
    assert fields[4]["previous_expires_at"] == pytest.approx(time.time() + 60, abs=10)
    assert fields[5] == {"tenant_id": "acme"}
    assert fields[7] == {"role": "viewer", "name": ""}
    assert all(e["request_id"] and e["request_id"].startswith("req_") for e in log)


def test_the_audit_log_holds_no_secret_and_no_key_hash(ops: Ops, redis_url: str) -> None:
    secrets: list[str] = []
    ops.admin("POST", "/admin/tenants", json={"id": "acme"})
    for body in ({}, {"name": "a", "scopes": ["inference"]}, {"limits": {"rpm": 3}}):
        secrets.append(ok(ops.admin("POST", "/admin/tenants/acme/keys", json=body), 201)["key"])
    key_ids = [k["key_id"] for k in ops.admin("GET", "/admin/tenants/acme/keys").json()["keys"]]
    for key_id in key_ids:
        for grace in (3600, 0):
            r = ops.admin("POST", f"/admin/keys/{key_id}/rotate", json={"grace_s": grace})
            secrets.append(ok(r, 200)["key"])
    for role in ("admin", "viewer"):
        secrets.append(ok(ops.admin("POST", "/admin/keys", json={"role": role}), 201)["key"])
    client = redis_client(redis_url)
    # Every hash there is or was: of each secret, and whatever the records hold now.
    hashes = {apikeys.hash_key(PEPPER, s) for s in secrets}
    for raw in client.hgetall(keys.tenant_keys("acme")).values():
        doc = orjson.loads(raw)
        hashes |= {doc["hash"], doc.get("prev_hash") or doc["hash"]}
    for raw in client.hgetall(keys.ADMIN_KEYS).values():
        hashes.add(orjson.loads(raw)["hash"])
    salt = orjson.loads(client.get(keys.tenant_record("acme")))["cache_salt"]
    ops.admin("DELETE", f"/admin/keys/{key_ids[0]}")
    ops.admin("DELETE", "/admin/tenants/acme")

    stream = client.xrange(keys.AUDIT_STREAM)
    assert len(stream) == 1 + 3 + 6 + 2 + 2
    raw_text = json.dumps(stream)
    api_text = ops.admin("GET", "/admin/audit", params={"limit": 1000}).text
    for text in (raw_text, api_text):
        for secret in secrets:
            assert secret not in text and secret.split("-", 2)[2] not in text
        for h in hashes:
            assert h not in text
        assert salt not in text


def test_since_and_limit(ops: Ops) -> None:
    for i in range(3):
        ops.admin("POST", "/admin/tenants", json={"id": f"t{i}"})
    time.sleep(0.05)
    mark = time.time()
    time.sleep(0.05)
    for i in range(3, 6):
        ops.admin("POST", "/admin/tenants", json={"id": f"t{i}"})
    assert [e["target"] for e in entries(ops)] == ["t5", "t4", "t3", "t2", "t1", "t0"]
    assert [e["target"] for e in entries(ops, since=mark)] == ["t5", "t4", "t3"]
    assert [e["target"] for e in entries(ops, limit=2)] == ["t5", "t4"]
    assert [e["target"] for e in entries(ops, since=mark, limit=1)] == ["t5"]
    assert entries(ops, since=time.time() + 60) == []
    assert len(entries(ops, limit=1000)) == 6
    for params, param in (
        ({"limit": 0}, "limit"),
        ({"limit": 1001}, "limit"),
        ({"limit": "many"}, "limit"),
        ({"since": -1}, "since"),
        ({"since": "yesterday"}, "since"),
        ({"since": "inf"}, "since"),
        ({"limit": "1_0"}, "limit"),  # int() reads it; found from outside
        ({"since": "1_796_570_790"}, "since"),
    ):
        r = ops.admin("GET", "/admin/audit", params=params)
        assert r.status_code == 400, (params, r.text)
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (
            "invalid_request",
            param,
        )


def test_the_stream_is_capped(ops: Ops, redis_url: str) -> None:
    # The gateway writes with the documented cap ...
    assert ops.gw.app.state.tenants.audit.maxlen == audit.MAXLEN == 100_000

    # ... and XADD MAXLEN ~ keeps the stream near it, whatever the number of writes (a
    # small cap here, so the test need not write 100 000 entries; Redis trims whole
    # stream nodes of 100 entries, hence the slack).
    async def write(n: int, cap: int) -> int:
        client = aredis_client(redis_url)
        try:
            log = audit.AuditLog(client, maxlen=cap)
            for i in range(n):
                await log.record(actor="bootstrap", role="admin", action="tenant.update",
                                 target=f"t{i}", fields={"name": ["", str(i)]})  # fmt: skip
            return int(await client.xlen(keys.AUDIT_STREAM))
        finally:
            await client.aclose()

    length = asyncio.run(write(1000, 50))
    assert 50 <= length <= 50 + 100
    newest = entries(ops, limit=1)[0]
    assert newest["target"] == "t999" and newest["fields"] == {"name": ["", "999"]}
    # The same cap through the gateway's own log.
    ops.gw.app.state.tenants.audit.maxlen = 10
    ops.admin("POST", "/admin/tenants", json={"id": "acme"})
    for i in range(150):
        ops.admin("PATCH", "/admin/tenants/acme", json={"name": f"n{i}"})
    assert len(entries(ops, limit=1000)) <= 10 + 100


def test_steergate_audit_prints_the_log(ops: Ops, cli: Any) -> None:  # noqa: F811 - fixture
    assert cli("tenant", "create", "acme", "--rpm", "30")[0] == 0
    time.sleep(0.05)
    mark = time.time()
    time.sleep(0.05)
    assert cli("tenant", "update", "acme", "--rpm", "45")[0] == 0
    code, out, _ = cli("key", "create", "acme", "--name", "bot", "--key-only")
    secret = out.strip()

    code, out, err = cli("audit")
    assert code == 0, err
    lines = [line for line in out.splitlines() if "bootstrap" in line]
    assert [next(a for a in ("tenant.create", "tenant.update", "key.create") if a in line)
            for line in lines] == ["key.create", "tenant.update", "tenant.create"]  # fmt: skip
    assert '"limits.rpm":[30,45]' in out and "acme" in out
    assert secret not in out
    code, out, _ = cli("audit", "--since", str(mark))
    assert code == 0 and "tenant.update" in out and "tenant.create" not in out
    code, out, _ = cli("audit", "--limit", "1", "--json")
    doc = json.loads(out)
    assert [e["action"] for e in doc] == ["key.create"] and doc[0]["fields"]["name"] == "bot"
    code, out, _ = cli("audit", "--since", "1h", "--json")
    assert len(json.loads(out)) == 3
    assert cli("audit", "--limit", "0")[0] == 2
    assert cli("audit", "--since", "last tuesday")[0] == 2
