"""The admin API (contract §3) against a live gateway, fake engine and real Redis."""

# ruff: noqa: F811 - pytest fixtures are imported, then named as parameters
from __future__ import annotations

from typing import Any

import httpx
import pytest

from steergate.gateway.store import key_names as keys
from tests.gateway.ops_env import ADMIN, Ops, bearer, ops  # noqa: F401 - fixture
from tests.harness import redis_client

ADMIN_ROUTES = [
    ("POST", "/admin/tenants"),
    ("GET", "/admin/tenants"),
    ("GET", "/admin/tenants/acme"),
    ("PATCH", "/admin/tenants/acme"),
    ("DELETE", "/admin/tenants/acme"),
    ("POST", "/admin/tenants/acme/keys"),
    ("GET", "/admin/tenants/acme/keys"),
    ("DELETE", "/admin/keys/key_0000"),
    ("GET", "/admin/usage"),
    ("GET", "/admin/engines"),
]


def _error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code", "request_id"}
    assert isinstance(body["error"]["code"], str)
    return body["error"]


def test_admin_routes_refuse_tenant_keys_403_and_missing_or_wrong_keys_401(ops: Ops) -> None:
    tenant_key = ops.tenant("acme")
    for method, path in ADMIN_ROUTES:
        r = httpx.request(method, ops.url + path, headers=bearer(tenant_key), json={})
        assert r.status_code == 403, (method, path)
        assert _error(r)["code"] == "permission_denied"
        assert tenant_key not in r.text
        for headers in ({}, bearer("admin-test-key-wrong"), {"Authorization": "Basic x"}):
            r = httpx.request(method, ops.url + path, headers=headers, json={})
            assert r.status_code == 401, (method, path, headers)
            assert _error(r)["code"] == "invalid_api_key"
    # Nothing was changed by the refused calls.
    assert ops.admin("GET", "/admin/tenants/acme").status_code == 200


def test_create_get_list_tenant_with_defaults_filled_and_no_secret_fields(ops: Ops) -> None:
    r = ops.admin(
        "POST",
        "/admin/tenants",
        json={"id": "acme", "name": "Acme", "limits": {"rpm": 30, "latch_bytes": 4096}},
    )
    assert r.status_code == 201
    created = r.json()
    assert created["id"] == "acme" and created["name"] == "Acme"
    assert created["limits"]["rpm"] == 30 and created["limits"]["latch_bytes"] == 4096
    assert created["limits"]["latch_policy"] == "evict_oldest"  # default
    assert "cache_salt" not in r.text
    assert ops.admin("GET", "/admin/tenants/acme").json() == created
    ops.admin("POST", "/admin/tenants", json={"id": "beta"})
    listed = ops.admin("GET", "/admin/tenants").json()["tenants"]
    assert [t["id"] for t in listed] == ["acme", "beta"]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"id": "Bad_Id"}, "id", "invalid_tenant_id"),
        ({"id": "x" * 33}, "id", "invalid_tenant_id"),
        ({}, "id", "invalid_request"),
        ({"id": "acme", "colour": "red"}, "colour", "invalid_request"),
        ({"id": "acme", "name": 5}, "name", "invalid_request"),
        ({"id": "acme", "limits": []}, "limits", "invalid_request"),
        ({"id": "acme", "limits": {"rpm": 0}}, "limits.rpm", "invalid_request"),
        ({"id": "acme", "limits": {"latch_bytes": -1}}, "limits.latch_bytes", "invalid_request"),
        (
            {"id": "acme", "limits": {"latch_policy": "lru"}},
            "limits.latch_policy",
            "invalid_request",
        ),
        ({"id": "acme", "limits": {"rmp": 5}}, "limits.rmp", "invalid_request"),
        # Strict integers: these were stored as rpm 1 and 600 (the audit's finding).
        ({"id": "acme", "limits": {"rpm": True}}, "limits.rpm", "invalid_request"),
        ({"id": "acme", "limits": {"rpm": "600"}}, "limits.rpm", "invalid_request"),
        ({"id": "acme", "limits": {"tpm": 600.0}}, "limits.tpm", "invalid_request"),
        (
            {"id": "acme", "limits": {"token_budget": {"tokens": True, "period": "day"}}},
            "limits.token_budget.tokens",
            "invalid_request",
        ),
        ({"id": "acme", "allow_overcommit": "yes"}, "allow_overcommit", "invalid_request"),
    ],
)
def test_bad_tenant_input_is_400_naming_the_field(
    ops: Ops, body: dict, param: str, code: str
) -> None:
    r = ops.admin("POST", "/admin/tenants", json=body)
    assert r.status_code == 400, r.text
    err = _error(r)
    assert (err["param"], err["code"]) == (param, code)
    assert err["type"] == "invalid_request_error"
    assert ops.admin("GET", "/admin/tenants").json()["tenants"] == []


def test_malformed_json_body_is_400(ops: Ops) -> None:
    r = httpx.post(ops.url + "/admin/tenants", content=b"{nope", headers=ADMIN)
    assert r.status_code == 400 and _error(r)["code"] == "invalid_json"
    r = httpx.post(ops.url + "/admin/tenants", content=b"[1]", headers=ADMIN)
    assert r.status_code == 400 and _error(r)["param"] == "body"


def test_duplicate_tenant_is_409(ops: Ops) -> None:
    assert ops.admin("POST", "/admin/tenants", json={"id": "acme"}).status_code == 201
    r = ops.admin("POST", "/admin/tenants", json={"id": "acme"})
    assert r.status_code == 409 and _error(r)["code"] == "tenant_exists"


def test_overcommit_is_a_warning_by_default_shown_in_capacity(ops: Ops) -> None:
    # The stub engine's caps: 1024 latches, 256 MiB. Two tenants of 600 latches overcommit;
    # engines are caches, so that costs restores, not latches: allowed, and shown.
    for tenant in ("a", "b"):
        r = ops.admin(
            "POST", "/admin/tenants", json={"id": tenant, "limits": {"latch_count": 600}}
        )
        assert r.status_code == 201
    capacity = ops.admin("GET", "/admin/usage").json()["capacity"]
    assert capacity["latch_count"]["allocated"] == 1200
    assert capacity["latch_count"]["overcommitted"] is True


def test_overcommit_is_409_unless_allowed_when_refused(start_gateway: Any) -> None:
    ops = Ops(start_gateway(refuse_overcommit=True), None, "")  # type: ignore[arg-type]
    ops.wait_for(
        lambda: ops.admin("GET", "/admin/usage").json()["capacity"]["latch_count"][
            "engine_cap_source"
        ]
        == "engines"
    )
    assert (
        ops.admin(
            "POST", "/admin/tenants", json={"id": "a", "limits": {"latch_count": 600}}
        ).status_code
        == 201
    )
    r = ops.admin("POST", "/admin/tenants", json={"id": "b", "limits": {"latch_count": 600}})
    assert r.status_code == 409
    assert (_error(r)["code"], _error(r)["param"]) == ("engine_overcommitted", "limits")
    assert ops.admin("GET", "/admin/tenants/b").status_code == 404
    capacity = ops.admin("GET", "/admin/usage").json()["capacity"]
    assert capacity["latch_count"] == {
        "allocated": 600,
        "engine_cap": 1024,
        "engine_cap_source": "engines",
        "overcommitted": False,
    }
    r = ops.admin(
        "POST",
        "/admin/tenants",
        json={"id": "b", "limits": {"latch_count": 600}, "allow_overcommit": True},
    )
    assert r.status_code == 201
    capacity = ops.admin("GET", "/admin/usage").json()["capacity"]
    assert capacity["latch_count"]["allocated"] == 1200
    assert capacity["latch_count"]["overcommitted"] is True
    # Raising a's quota further is still checked for a (b's flag is b's own).
    r = ops.admin("PATCH", "/admin/tenants/a", json={"limits": {"latch_count": 700}})
    assert r.status_code == 409


def test_patch_changes_only_what_is_given(ops: Ops) -> None:
    ops.admin("POST", "/admin/tenants", json={"id": "acme", "name": "Acme", "limits": {"rpm": 30}})
    r = ops.admin("PATCH", "/admin/tenants/acme", json={"limits": {"tpm": 999}})
    assert r.status_code == 200
    t = r.json()
    assert (t["name"], t["limits"]["rpm"], t["limits"]["tpm"]) == ("Acme", 30, 999)
    r = ops.admin("PATCH", "/admin/tenants/acme", json={"name": "Acme Corp"})
    assert r.json()["name"] == "Acme Corp" and r.json()["limits"]["tpm"] == 999
    r = ops.admin("PATCH", "/admin/tenants/acme", json={"limits": {"max_concurrency": 0}})
    assert r.status_code == 400 and _error(r)["param"] == "limits.max_concurrency"
    r = ops.admin("PATCH", "/admin/tenants/acme", json={"id": "other"})
    assert r.status_code == 400 and _error(r)["param"] == "id"


def test_new_limits_apply_to_the_next_request(ops: Ops) -> None:
    key = ops.tenant("acme", rpm=1)
    assert ops.chat(key).status_code == 200
    assert ops.chat(key).status_code == 429
    ops.admin("PATCH", "/admin/tenants/acme", json={"limits": {"rpm": 1000}})
    ops.wait_for(lambda: ops.chat(key).status_code == 200, timeout=3)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/admin/tenants/ghost"),
        ("PATCH", "/admin/tenants/ghost"),
        ("DELETE", "/admin/tenants/ghost"),
        ("POST", "/admin/tenants/ghost/keys"),
        ("GET", "/admin/tenants/ghost/keys"),
        ("DELETE", "/admin/keys/key_ghost"),
        ("GET", "/admin/usage?tenant=ghost"),
    ],
)
def test_unknown_tenant_or_key_is_404(ops: Ops, method: str, path: str) -> None:
    r = ops.admin(method, path, json={"name": "x"} if method == "PATCH" else None)
    assert r.status_code == 404, r.text
    assert _error(r)["code"] in {"tenant_not_found", "key_not_found"}


def test_key_is_shown_once_listed_masked_and_revoked(ops: Ops) -> None:
    ops.admin("POST", "/admin/tenants", json={"id": "acme"})
    r = ops.admin("POST", "/admin/tenants/acme/keys")
    assert r.status_code == 201
    created = r.json()
    key, key_id = created["key"], created["key_id"]
    assert key.startswith("sk-sg-") and created["prefix"] == key[:12]
    assert r.headers["cache-control"] == "no-store"
    assert ops.get(key, "/v1/usage").status_code == 200
    listed = ops.admin("GET", "/admin/tenants/acme/keys")
    assert [k["key_id"] for k in listed.json()["keys"]] == [key_id]
    assert key not in listed.text and key[12:20] not in listed.text
    assert "hash" not in listed.json()["keys"][0]
    assert ops.admin("DELETE", f"/admin/keys/{key_id}").status_code == 204
    assert ops.get(key, "/v1/usage").status_code == 401
    assert ops.admin("GET", "/admin/tenants/acme/keys").json()["keys"] == []
    assert ops.admin("DELETE", f"/admin/keys/{key_id}").status_code == 404


def test_delete_tenant_clears_keys_latches_vectors_in_redis_and_on_the_engine(
    ops: Ops, redis_url: str
) -> None:
    key = ops.tenant("acme", latch_count=4, latch_bytes=4096)
    other = ops.tenant("other", latch_count=4, latch_bytes=4096)
    steering = {"vectors": [{"hook": "post_block", "layers": {"1": [0.5] * 8}}], "latch": True}
    for k in (key, other):
        assert ops.chat(k, conversation_id="c1", steering=steering).status_code == 200
        r = httpx.put(
            ops.url + "/v1/steering/vectors/calm",
            headers=bearer(k),
            json={"hook": "post_block", "layers": {"1": [0.1] * 8}},
        )
        assert r.status_code == 201, r.text
    # Something the engine holds that Redis never heard of (drift): swept too.
    ops.engine.plant_latch("acme~ghost")
    ops.wait_for(lambda: ops.get(key, "/v1/usage").json()["quotas"]["latch_count"]["used"] == 1)

    assert ops.admin("DELETE", "/admin/tenants/acme").status_code == 204

    assert ops.admin("GET", "/admin/tenants/acme").status_code == 404
    assert ops.get(key, "/v1/usage").status_code == 401
    assert not [c for c in ops.engine.latches if c.startswith("acme~")]
    assert not [n for n in ops.engine.vectors if n.startswith("acme~")]
    client = redis_client(redis_url)
    assert client.keys(f"*{keys.tag('acme')}*") == []
    assert "acme" not in client.smembers(keys.TENANT_INDEX)
    # The other tenant is untouched.
    assert "other~c1" in ops.engine.latches and "other~calm" in ops.engine.vectors
    assert ops.get(other, "/v1/usage").json()["quotas"]["latch_count"]["used"] == 1
    # The id can be reused and starts empty.
    fresh = ops.tenant("acme")
    assert ops.get(fresh, "/v1/usage").json()["quotas"]["latch_count"]["used"] == 0


def test_admin_usage_lists_every_tenant_and_filters_with_history(ops: Ops) -> None:
    a = ops.tenant("a")
    ops.tenant("b")
    assert ops.chat(a).status_code == 200
    doc = ops.admin("GET", "/admin/usage").json()
    assert [t["tenant_id"] for t in doc["tenants"]] == ["a", "b"]
    assert all("history" not in t for t in doc["tenants"])
    ops.wait_for(
        lambda: ops.admin("GET", "/admin/usage").json()["tenants"][0]["responses"]["2xx"] == 1
    )
    one = ops.admin("GET", "/admin/usage?tenant=b&history=true").json()["tenants"]
    assert [t["tenant_id"] for t in one] == ["b"] and len(one[0]["history"]) == 60
    r = ops.admin("GET", "/admin/usage?tenant=Not_An_Id")
    assert r.status_code == 400 and _error(r)["param"] == "tenant"


def test_admin_engines_reports_status_and_a_down_engine(start_gateway, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    key = ops.tenant("acme")
    ops.chat(
        key,
        conversation_id="c1",
        steering={"vectors": [{"hook": "post_block", "layers": {"1": [0.5] * 8}}], "latch": True},
    )
    engines = ops.admin("GET", "/admin/engines").json()["engines"]
    assert len(engines) == 1 and engines[0]["up"] is True
    assert engines[0]["status"]["latched_conversations"] == 1
    assert engines[0]["status"]["max_latched_bytes"] == 268435456

    from tests.harness import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    gw = start_gateway(engine_urls=f"{ops.engine_url},{dead}")
    r = httpx.get(gw.url + "/admin/engines", headers=ADMIN, timeout=10)
    by_url = {e["url"]: e for e in r.json()["engines"]}
    assert by_url[ops.engine_url]["up"] is True
    assert by_url[dead]["up"] is False and by_url[dead]["error"]


def test_urls_are_shown_without_credentials() -> None:
    from steergate.shared.settings import display_url

    assert display_url("http://user:secret@engine:8100") == "http://engine:8100"
    assert display_url("http://engine:8100") == "http://engine:8100"
    # Redis URLs (what `steergate up` prints): a query may carry the password
    assert display_url("redis://:secret@h:6379/0?password=secret#x") == "redis://h:6379/0"
    assert display_url("unix:///run/redis.sock?db=0&password=secret") == "unix:///run/redis.sock"
    assert display_url("unix://user:secret@/run/redis.sock") == "unix:///run/redis.sock"
    assert display_url("http://user:secret@[::1") == "(a URL that does not parse)"


def _all_at_once(requests: list[tuple[str, str, str]]) -> list[httpx.Response]:
    """(method, url, admin path) requests sent together."""
    import asyncio

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30, headers=ADMIN) as client:
            return await asyncio.gather(*(client.request(m, u + p) for m, u, p in requests))

    return asyncio.run(go())


def _audited(ops: Ops, action: str, target: str) -> int:
    entries = ops.admin("GET", "/admin/audit?limit=1000").json()["entries"]
    return sum(1 for e in entries if (e["action"], e["target"]) == (action, target))


def test_concurrent_deletes_of_one_tenant_answer_204_once(start_gateway: Any, ops: Ops) -> None:
    """The race: 12 deletes of one tenant through two replicas used to answer 204 up to
    10 times, each audited and each cleaning the engines. Exactly one deletes it; the
    others are 404 ``tenant_not_found``, as a delete after it would be."""
    other = start_gateway()
    for round_ in range(3):
        tenant = f"gone-{round_}"
        ops.tenant(tenant)
        path = f"/admin/tenants/{tenant}"
        answers = _all_at_once(
            [("DELETE", gw, path) for _ in range(6) for gw in (ops.url, other.url)]
        )
        statuses = sorted(r.status_code for r in answers)
        assert statuses == [204] + [404] * 11, statuses
        assert {_error(r)["code"] for r in answers if r.status_code == 404} == {"tenant_not_found"}
        assert _audited(ops, "tenant.delete", tenant) == 1


def test_concurrent_revokes_of_one_admin_key_answer_204_once(start_gateway: Any, ops: Ops) -> None:
    other = start_gateway()
    for _ in range(3):
        created = ops.admin("POST", "/admin/keys", json={"role": "viewer"})
        assert created.status_code == 201, created.text
        key_id = created.json()["key_id"]
        path = f"/admin/keys/{key_id}"
        answers = _all_at_once(
            [("DELETE", gw, path) for _ in range(6) for gw in (ops.url, other.url)]
        )
        statuses = sorted(r.status_code for r in answers)
        assert statuses == [204] + [404] * 11, statuses
        assert _audited(ops, "admin_key.revoke", key_id) == 1
        who = httpx.get(ops.url + "/admin/tenants", headers=bearer(created.json()["key"]))
        assert who.status_code == 401


def test_concurrent_updates_of_one_tenant_each_keep_their_change(
    start_gateway: Any, ops: Ops
) -> None:
    """The race: PATCHes of different fields of one tenant, at once through two
    replicas, all answered 200 while 3 to 5 of 8 changes were lost (each merged into the
    record it read, the last write won). Now each change is kept, or its request is told
    (409 ``tenant_changed``, retryable) and changed nothing."""
    import asyncio

    other = start_gateway()
    fields = ["rpm", "tpm", "max_concurrency", "latch_count", "latch_bytes", "vector_count"]
    for round_ in range(3):
        tenant = f"busy-{round_}"
        ops.tenant(tenant)
        before = ops.admin("GET", f"/admin/tenants/{tenant}").json()["limits"]
        wanted = {f: before[f] + 7 for f in fields}

        async def storm(tenant: str = tenant, wanted: dict = wanted) -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30, headers=ADMIN) as client:
                return await asyncio.gather(
                    *(
                        client.patch(
                            (ops.url, other.url)[i % 2] + f"/admin/tenants/{tenant}",
                            json={"limits": {field: value}},
                        )
                        for i, (field, value) in enumerate(wanted.items())
                    ),
                    client.patch(ops.url + f"/admin/tenants/{tenant}", json={"name": "renamed"}),
                )

        answers = asyncio.run(storm())
        assert {r.status_code for r in answers} <= {200, 409}, [r.text for r in answers]
        kept = {
            field
            for field, r in zip(wanted, answers, strict=False)
            if r.status_code == 200
        }
        for r in answers:
            if r.status_code == 409:
                assert _error(r)["code"] == "tenant_changed"
        after = ops.admin("GET", f"/admin/tenants/{tenant}")
        limits = after.json()["limits"]
        for field in fields:
            assert limits[field] == (wanted[field] if field in kept else before[field]), field
        assert after.json()["name"] == ("renamed" if answers[-1].status_code == 200 else "")


@pytest.mark.parametrize(
    "name", ["\x1b]8;;https://evil.example\x07x", "a\r\nforged line", "\x00", "\x9b2J", "\u2066x"]
)
def test_names_with_control_characters_are_refused_naming_the_field(ops: Ops, name: str) -> None:
    """A name reaches operators' terminals (``steergate`` tables), logs and CSV: an
    escape sequence, a line break or a bidirectional control in one is a 400."""
    r = ops.admin("POST", "/admin/tenants", json={"id": "acme", "name": name})
    assert (r.status_code, _error(r)["param"]) == (400, "name")
    assert ops.admin("GET", "/admin/tenants/acme").status_code == 404
    ops.admin("POST", "/admin/tenants", json={"id": "acme", "name": "Acme"})
    r = ops.admin("PATCH", "/admin/tenants/acme", json={"name": name})
    assert (r.status_code, _error(r)["param"]) == (400, "name")
    assert ops.admin("GET", "/admin/tenants/acme").json()["name"] == "Acme"
    r = ops.admin("POST", "/admin/keys", json={"role": "viewer", "name": name})
    assert (r.status_code, _error(r)["param"]) == (400, "name")
    # what a name may hold: any printable text, markup-like brackets and emoji included
    r = ops.admin("PATCH", "/admin/tenants/acme", json={"name": "Ünïcode [b]x[/b] 🚀"})
    assert r.status_code == 200, r.text


def test_a_malformed_tenant_or_key_id_in_a_path_is_refused_and_never_echoed(ops: Ops) -> None:
    """Found from outside: ``/admin/tenants/ACME`` was 404 ``tenant_not_found`` echoing the
    id (NUL bytes and 5,000 characters included) while ``.../ACME/usage/export`` was 400
    ``invalid_tenant_id``: the tenant routes never checked the path's id."""
    ops.tenant("acme")
    for bad in ("ACME", "x" * 5000, "acme%00", "acme%0A", "ac%20me"):
        for method, path in [
            ("GET", f"/admin/tenants/{bad}"),
            ("PATCH", f"/admin/tenants/{bad}"),
            ("DELETE", f"/admin/tenants/{bad}"),
            ("POST", f"/admin/tenants/{bad}/keys"),
            ("GET", f"/admin/tenants/{bad}/keys"),
            ("GET", f"/admin/tenants/{bad}/usage/export"),
        ]:
            r = ops.admin(method, path, json={})
            err = _error(r)
            assert (r.status_code, err["code"], err["param"]) == (
                400, "invalid_tenant_id", "tenant_id"
            ), (method, path)
            assert "\x00" not in r.text and "x" * 40 not in r.text
    for bad in ("key_%00zz", "y" * 3000):
        for method, path in [
            ("DELETE", f"/admin/keys/{bad}"),
            ("POST", f"/admin/keys/{bad}/rotate"),
        ]:
            r = ops.admin(method, path, json={})
            err = _error(r)
            assert (r.status_code, err["code"]) == (404, "key_not_found"), (method, path)
            assert "\x00" not in r.text and "y" * 40 not in r.text
    # a well-formed id that does not exist is still named
    r = ops.admin("DELETE", "/admin/keys/key_0123456789abcdef")
    assert r.status_code == 404 and "key_0123456789abcdef" in _error(r)["message"]
    assert ops.admin("GET", "/admin/tenants/acme").status_code == 200  # nothing changed
