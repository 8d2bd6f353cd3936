"""Issue 13 item 3: admin keys with roles. A ``viewer`` reads every admin GET and
writes nothing; the route lists are enumerated from the app, so a route added later is
covered. Admin keys are stored as HMACs only and revoked on every replica within 1 s.
Each rule as the attack against live gateways and real Redis."""

# ruff: noqa: F811 - pytest fixtures are imported, then named as parameters
from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from steergate.gateway.tenancy import api_keys as apikeys
from tests.gateway.conftest import ADMIN_KEY, PEPPER
from tests.gateway.ops_env import ADMIN, Ops, bearer, cli, ops  # noqa: F401 - fixture
from tests.gateway.servers import ServerThread
from tests.harness import redis_client

READS = {"GET", "HEAD"}


def _error(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"}, body
    return body["error"]  # type: ignore[no-any-return]


def admin_key(gw_url: str, role: str, name: str = "", headers: dict[str, str] = ADMIN) -> dict:
    r = httpx.post(gw_url + "/admin/keys", headers=headers, json={"role": role, "name": name})
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


def admin_routes(gw: ServerThread) -> list[tuple[str, str]]:
    """(method, path template) of every route under /admin the app serves."""
    out = []
    for route in gw.app.routes:
        path = getattr(route, "path", "")
        if path == "/admin" or path.startswith("/admin/"):
            out.extend((m, path) for m in sorted(getattr(route, "methods", None) or ()))
    return out


def fill(path: str, values: dict[str, str]) -> str:
    return re.sub(r"\{(\w+)(:\w+)?\}", lambda m: values.get(m.group(1), "x"), path)


class World:
    """A tenant with a key, and one admin and one viewer key, made by the bootstrap key."""

    def __init__(self, ops: Ops) -> None:
        self.ops = ops
        self.tenant_key = ops.tenant("acme")
        self.key_id = ops.admin("GET", "/admin/tenants/acme/keys").json()["keys"][0]["key_id"]
        self.viewer = admin_key(ops.url, "viewer", "dashboards")
        self.admin = admin_key(ops.url, "admin", "ops team")
        self.values = {"tenant_id": "acme", "id": "acme", "key_id": self.key_id}

    def state(self) -> tuple[Any, ...]:
        """What a write could change: tenants, keys, admin keys, the audit log."""
        a = self.ops.admin
        return (
            a("GET", "/admin/tenants").json(),
            a("GET", "/admin/tenants/acme/keys").json(),
            a("GET", "/admin/keys").json(),
            a("GET", "/admin/audit?limit=1000").json(),
        )


@pytest.fixture()
def world(ops: Ops) -> World:
    return World(ops)


def test_a_viewer_is_403_on_every_admin_write_route_and_changes_nothing(world: World) -> None:
    ops = world.ops
    writes = [(m, p) for m, p in admin_routes(ops.gw) if m not in READS]
    assert {f"{m} {p}" for m, p in writes} >= {  # the enumeration sees the known ones
        "POST /admin/tenants",
        "PATCH /admin/tenants/{tenant_id}",
        "DELETE /admin/tenants/{tenant_id}",
        "POST /admin/tenants/{tenant_id}/keys",
        "DELETE /admin/keys/{key_id}",
        "POST /admin/keys/{key_id}/rotate",
        "POST /admin/keys",
    }
    bodies: dict[str, Any] = {
        "/admin/tenants": {"id": "evil"},
        "/admin/tenants/{tenant_id}": {"name": "evil", "limits": {"rpm": 1}},
        "/admin/keys": {"role": "admin"},
        "/admin/keys/{key_id}/rotate": {"grace_s": 0},
    }
    before = world.state()
    viewer = world.viewer["key"]
    for method, template in writes:
        for target in (
            {**world.values, "key_id": world.key_id},
            {**world.values, "key_id": world.admin["key_id"]},
        ):
            r = httpx.request(
                method,
                ops.url + fill(template, target),
                headers=bearer(viewer),
                json=bodies.get(template, {}),
                timeout=10,
            )
            assert r.status_code == 403, (method, template, r.text)
            err = _error(r)
            assert (err["code"], err["type"]) == ("permission_denied", "permission_error")
            assert "viewer" in err["message"] and viewer not in r.text
    assert world.state() == before
    assert ops.get(world.tenant_key, "/v1/usage").status_code == 200
    # The same writes are open to an admin-role key (one shown: it creates a tenant).
    r = httpx.post(
        ops.url + "/admin/tenants", headers=bearer(world.admin["key"]), json={"id": "beta"}
    )
    assert r.status_code == 201, r.text


def test_a_viewer_gets_what_an_admin_gets_on_every_admin_get(world: World) -> None:
    ops = world.ops
    reads = [(m, p) for m, p in admin_routes(ops.gw) if m == "GET"]
    assert {p for _, p in reads} >= {
        "/admin/tenants",
        "/admin/tenants/{tenant_id}",
        "/admin/tenants/{tenant_id}/keys",
        "/admin/keys",
        "/admin/usage",
        "/admin/engines",
        "/admin/audit",
    }
    viewer = bearer(world.viewer["key"])
    for method, template in reads:
        url = ops.url + fill(template, world.values)
        as_viewer = httpx.request(method, url, headers=viewer, timeout=10)
        as_admin = httpx.request(method, url, headers=ADMIN, timeout=10)
        assert as_viewer.status_code not in (401, 403), (template, as_viewer.text)
        assert as_viewer.status_code == as_admin.status_code, template
        if template in ("/admin/tenants", "/admin/keys", "/admin/audit", "/admin/usage"):
            assert as_viewer.status_code == 200
    # Read-only surfaces outside /admin that take an admin key: the viewer reads them too.
    assert httpx.get(ops.url + "/openapi.json", headers=viewer).status_code == 200
    assert httpx.get(ops.url + "/metrics", headers=viewer).status_code == 200


def test_tenant_keys_are_403_and_unknown_or_revoked_admin_keys_401_on_every_admin_route(
    world: World,
) -> None:
    ops = world.ops
    fake_admin = apikeys.generate_admin_key()
    gone = admin_key(ops.url, "admin")
    assert ops.admin("DELETE", f"/admin/keys/{gone['key_id']}").status_code == 204
    for method, template in admin_routes(ops.gw):
        url = ops.url + fill(template, world.values)
        r = httpx.request(method, url, headers=bearer(world.tenant_key), json={}, timeout=10)
        assert r.status_code == 403 and _error(r)["code"] == "permission_denied", template
        for secret in (fake_admin, gone["key"]):
            r = httpx.request(method, url, headers=bearer(secret), json={}, timeout=10)
            assert r.status_code == 401 and _error(r)["code"] == "invalid_api_key", template
    # Admin keys are not tenant keys.
    for secret in (world.admin["key"], world.viewer["key"]):
        assert ops.get(secret, "/v1/usage").status_code == 401


def test_admin_key_revocation_reaches_another_replica_within_1s(
    start_gateway: Callable[..., ServerThread],
) -> None:
    a, b = start_gateway(), start_gateway()
    for role in ("admin", "viewer"):
        created = admin_key(a.url, role)
        secret = bearer(created["key"])
        assert httpx.get(b.url + "/admin/tenants", headers=secret).status_code == 200
        cached = b.app.state.tenants.cache.get(apikeys.hash_key(PEPPER, created["key"]))
        assert cached is not None and cached.role == role  # B answers it from its cache
        r = httpx.delete(a.url + f"/admin/keys/{created['key_id']}", headers=ADMIN)
        assert r.status_code == 204
        t0 = time.monotonic()
        while httpx.get(b.url + "/admin/tenants", headers=secret).status_code != 401:
            assert time.monotonic() - t0 < 1.0, "revoked admin key still accepted after 1 s"
            time.sleep(0.02)
        assert httpx.get(a.url + "/admin/tenants", headers=secret).status_code == 401
    assert httpx.get(a.url + "/admin/keys", headers=ADMIN).json()["keys"] == []


def test_admin_secrets_are_never_stored_in_plain_text(ops: Ops, redis_url: str) -> None:
    made = [admin_key(ops.url, role, f"k{i}") for i, role in enumerate(("admin", "viewer") * 3)]
    # A key made by a non-bootstrap admin, and a tenant key, for good measure.
    made.append(admin_key(ops.url, "viewer", "nested", headers=bearer(made[0]["key"])))
    secrets = [m["key"] for m in made] + [ops.tenant("acme")]
    client = redis_client(redis_url, decode_responses=False)
    # SCAN, not KEYS: a cluster client scans every primary (KEYS asks one node, which
    # may hold none of these, and the check would have nothing to look at).
    names = list(client.scan_iter(match="*"))
    assert names
    for name in names:
        blob = name + (client.dump(name) or b"")
        for secret in secrets:
            random_part = secret.split("-", 2)[2]
            assert secret.encode() not in blob and random_part.encode() not in blob, name
    listed = ops.admin("GET", "/admin/keys")
    assert [k["key_id"] for k in listed.json()["keys"]] == [m["key_id"] for m in made]
    for m in made:
        assert m["key"] not in listed.text and apikeys.hash_key(PEPPER, m["key"]) not in listed.text
    row = listed.json()["keys"][-1]
    assert row == {
        "key_id": made[-1]["key_id"],
        "name": "nested",
        "role": "viewer",
        "prefix": made[-1]["key"][:13],
        "created_at": row["created_at"],
        "created_by": made[0]["key_id"],
    }
    assert made[0]["key"].startswith("sk-sga-") and made[0]["prefix"] == made[0]["key"][:13]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "role"),
        ({"role": "root"}, "role"),
        ({"role": "viewer", "name": 5}, "name"),
        ({"role": "viewer", "scopes": ["x"]}, "scopes"),
    ],
)
def test_bad_admin_key_input_is_400(ops: Ops, body: dict[str, Any], param: str) -> None:
    r = ops.admin("POST", "/admin/keys", json=body)
    assert r.status_code == 400 and _error(r)["param"] == param, r.text
    assert ops.admin("GET", "/admin/keys").json()["keys"] == []


def test_admin_key_cli(ops: Ops, cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    code, out, _ = cli("admin-key", "create", "--role", "viewer", "--name", "grafana", "--key-only")
    assert code == 0 and apikeys.looks_like_admin_key(out.strip())
    viewer = out.strip()
    code, out, _ = cli("admin-key", "list")
    assert code == 0 and "grafana" in out and "viewer" in out and "bootstrap" in out
    assert viewer not in out and viewer[13:] not in out
    key_id = ops.admin("GET", "/admin/keys").json()["keys"][0]["key_id"]
    # The CLI run with the viewer key reads, and is refused writes.
    monkeypatch.setenv("STEERGATE_ADMIN_KEY", viewer)
    assert cli("tenant", "list")[0] == 0
    code, _, err = cli("tenant", "create", "acme")
    assert code == 1 and "permission_denied" in err
    monkeypatch.setenv("STEERGATE_ADMIN_KEY", ADMIN_KEY)
    code, out, _ = cli("admin-key", "revoke", key_id)
    assert code == 0 and "revoked" in out
    assert ops.admin("GET", "/admin/keys").json()["keys"] == []
    assert cli("admin-key", "create", "--role", "root")[0] == 2
