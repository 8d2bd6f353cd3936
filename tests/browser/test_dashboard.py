"""The quota dashboard in real headless Chromium (Debian's /usr/bin/chromium driven by
Playwright), against the installed ``steergate gateway`` (started outside the checkout,
tests/harness.py), the fake engine and a real Redis."""

# ruff: noqa: F811 - pytest fixtures are imported, then named as parameters
from __future__ import annotations

import datetime
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from steergate.gateway.tenancy.key_last_use import FLUSH_INTERVAL_S
from tests.gateway.conftest import ADMIN_KEY
from tests.gateway.ops_env import Ops, bearer, installed_ops  # noqa: F401 - fixture
from tests.harness import ROOT

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("STEERGATE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
IMG = ROOT / "docs" / "img"
LATCH = {"vectors": [{"hook": "post_block", "layers": {"1": [0.5] * 8}}], "latch": True}
REFRESH_WAIT_MS = 5000  # the page refreshes every 2 s


@pytest.fixture()
def ops(installed_ops: Ops) -> Ops:  # noqa: F811 - the installed gateway, as a user runs it
    return installed_ops


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture()
def page(browser):  # type: ignore[no-untyped-def]
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    yield pg
    context.close()
    # 401/403 answers during a wrong-key sign-in are logged by Chromium as failed loads.
    assert not [e for e in errors if "status of 40" not in e], errors


def sign_in(page, ops: Ops, key: str) -> None:  # type: ignore[no-untyped-def]
    page.goto(ops.url + "/dashboard")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()


def card(page, quota: str):  # type: ignore[no-untyped-def]
    return page.locator(f'#tenant-quotas [data-quota="{quota}"]')


def test_tenant_signs_in_and_numbers_move_after_requests(page, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    key = ops.tenant("acme", rpm=5, latch_count=4, latch_bytes=4096)
    sign_in(page, ops, key)
    page.locator("#tenant-view").wait_for(state="visible")
    assert page.locator("#tenant-title").inner_text() == "Tenant acme"
    assert "0 / 5" in card(page, "requests_per_minute").inner_text()

    assert ops.chat(key).status_code == 200
    assert ops.chat(key, conversation_id="chat-42", steering=LATCH).status_code == 200
    card(page, "requests_per_minute").get_by_text(re.compile(r"^2 / 5")).wait_for(
        timeout=REFRESH_WAIT_MS
    )
    latch_row = page.locator("#latches tbody tr", has_text="chat-42")
    latch_row.wait_for(timeout=REFRESH_WAIT_MS)
    cells = latch_row.locator("td").all_inner_texts()
    assert cells[1] == "by value" and cells[2] == "32 B" and re.fullmatch(r"\d+s ago", cells[3])
    page.locator("#responses [data-count='2xx']", has_text="2").wait_for(timeout=REFRESH_WAIT_MS)
    assert "Requests per minute over the last 60 minutes" not in page.content()  # label is aria
    chart = page.locator("#chart-requests svg")
    assert "peak 2" in (chart.get_attribute("aria-label") or "")

    # The key is in sessionStorage only: never in the URL, never in localStorage or cookies.
    assert key not in page.url
    assert page.evaluate("sessionStorage.getItem('steergate.dashboard.key')") == key
    assert page.evaluate("localStorage.length") == 0
    assert page.context.cookies() == []


def test_a_quota_bar_reaches_its_limit(page, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    key = ops.tenant(
        "acme",
        rpm=20,
        latch_count=2,
        latch_bytes=4096,
        token_budget={"tokens": 1000, "period": "month"},  # shown in the screenshot
    )
    r = httpx.put(
        ops.url + "/v1/steering/vectors/calm",
        headers=bearer(key),
        json={"hook": "post_block", "layers": {"1": [0.1] * 8}, "description": "demo"},
    )
    assert r.status_code == 201
    for conv in ("support-1", "support-2"):
        assert ops.chat(key, conversation_id=conv, steering=LATCH).status_code == 200
    for _ in range(4):
        ops.chat(key)
    sign_in(page, ops, key)
    latches = card(page, "latch_count")
    latches.get_by_text("at limit").wait_for(timeout=REFRESH_WAIT_MS)
    assert "2 / 2 (100%)" in latches.inner_text()
    assert "full" in (latches.get_attribute("class") or "")
    meter = latches.get_by_role("meter")
    assert (
        meter.get_attribute("aria-valuenow") == "2" and meter.get_attribute("aria-valuemax") == "2"
    )
    assert meter.locator("span").evaluate("e => e.style.width") == "100%"
    assert "full" not in (card(page, "requests_per_minute").get_attribute("class") or "")
    page.locator("#vectors tbody tr", has_text="calm").wait_for()
    IMG.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(IMG / "dashboard-tenant.png"), full_page=True)


def test_a_tenant_cannot_see_another_tenants_data(page, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    mine = ops.tenant("alpha")
    theirs = ops.tenant("bravo")
    assert ops.chat(theirs, conversation_id="bravo-secret-conv", steering=LATCH).status_code == 200
    httpx.put(
        ops.url + "/v1/steering/vectors/bravo-vector",
        headers=bearer(theirs),
        json={"hook": "post_block", "layers": {"1": [0.1] * 8}},
    )
    assert ops.chat(mine, conversation_id="alpha-conv", steering=LATCH).status_code == 200
    sign_in(page, ops, mine)
    page.locator("#latches tbody tr", has_text="alpha-conv").wait_for(timeout=REFRESH_WAIT_MS)
    text = page.locator("body").inner_text()
    assert "bravo" not in text
    assert page.locator("#admin-view").is_hidden()
    # Even asking from the page with this key, the admin API refuses.
    status = page.evaluate(
        "async (k) => (await fetch('/admin/usage',"
        " {headers: {Authorization: 'Bearer ' + k}})).status",
        mine,
    )
    assert status == 403


def test_admin_sees_every_tenant_engines_and_overcommit(page, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    small = ops.tenant("small-co", latch_count=8, latch_bytes=64 * 1024)
    ops.tenant("big-co", latch_count=900, latch_bytes=120 * 2**20)
    ops.tenant("greedy-co", latch_count=300, latch_bytes=100 * 2**20)  # Σ 1208 > cap 1024
    for conv in ("s1", "s2", "s3", "s4"):
        ops.chat(small, conversation_id=conv, steering=LATCH)
    sign_in(page, ops, ADMIN_KEY)
    page.locator("#admin-view").wait_for(state="visible")
    rows = page.locator("#tenants tbody tr")
    rows.first.wait_for()
    assert sorted(rows.evaluate_all("rs => rs.map(r => r.dataset.tenant)")) == [
        "big-co",
        "greedy-co",
        "small-co",
    ]
    assert page.locator("#who-label").inner_text() == "Administrator"

    # Sort by latch use: small-co (4 of 8 latches) comes first, descending.
    page.get_by_role("button", name="Latches", exact=True).click()
    header = page.locator('#tenants th[data-col="latch_count"]')
    assert header.get_attribute("aria-sort") == "descending"
    assert rows.first.get_attribute("data-tenant") == "small-co"
    assert "50%" in rows.first.locator('[data-quota="latch_count"]').inner_text()

    capacity = page.locator('#capacity [data-capacity="latch_count"]')
    assert "OVERCOMMITTED" in capacity.inner_text() and "1,208" in capacity.inner_text()
    assert "fits" in page.locator('#capacity [data-capacity="latch_bytes"]').inner_text()
    engine = page.locator(f'#engines [data-engine="{ops.engine_url}"]')
    assert "up" in engine.inner_text()
    engine.get_by_text(re.compile(r"Latches 4 / 1,024")).wait_for(timeout=REFRESH_WAIT_MS)
    IMG.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(IMG / "dashboard-admin.png"), full_page=True)


def test_wrong_key_shows_an_error_and_stores_nothing(page, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    ops.tenant("acme")
    sign_in(page, ops, "sk-sg-" + "x" * 43)
    error = page.get_by_role("alert")
    error.get_by_text("not accepted").wait_for()
    assert page.locator("#tenant-view").is_hidden() and page.locator("#admin-view").is_hidden()
    assert page.evaluate("sessionStorage.length") == 0
    assert "x" * 43 not in page.url


def test_revoked_key_signs_the_page_out(page, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    ops.tenant("acme")
    created = ops.admin("POST", "/admin/tenants/acme/keys").json()
    sign_in(page, ops, created["key"])
    page.locator("#tenant-view").wait_for(state="visible")
    assert ops.admin("DELETE", f"/admin/keys/{created['key_id']}").status_code == 204
    page.get_by_role("alert").get_by_text("no longer accepted").wait_for(timeout=REFRESH_WAIT_MS)
    assert page.evaluate("sessionStorage.length") == 0


def test_a_key_lacking_a_scope_is_told_which(page, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    """A `usage`-only key (the docs' "reporting" key) gets the tenant view, its latch and
    vector sections saying which scope it lacks, and stays signed in across refreshes; a
    key without `usage` is told that scope is missing, not that it is unknown."""
    ops.tenant("acme")
    reporting = ops.admin("POST", "/admin/tenants/acme/keys", json={"scopes": ["usage"]}).json()
    sign_in(page, ops, reporting["key"])
    page.locator("#tenant-view").wait_for(state="visible")
    page.locator("#latches tbody", has_text="lacks the latches scope").wait_for()
    page.locator("#vectors tbody", has_text="lacks the vectors scope").wait_for()
    page.wait_for_timeout(REFRESH_WAIT_MS // 2)  # several refreshes: still signed in
    assert page.locator("#tenant-view").is_visible()
    assert page.evaluate("sessionStorage.length") == 1

    page.evaluate("sessionStorage.clear()")  # the next load opens the sign-in form
    inference = ops.admin(
        "POST", "/admin/tenants/acme/keys", json={"scopes": ["inference"]}
    ).json()
    sign_in(page, ops, inference["key"])
    page.get_by_role("alert").get_by_text("lacks the usage scope").wait_for()
    assert page.locator("#tenant-view").is_hidden() and page.locator("#admin-view").is_hidden()
    assert page.evaluate("sessionStorage.length") == 0


def test_narrow_window_has_no_page_wide_horizontal_scroll(browser, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    key = ops.tenant("acme")
    ops.chat(
        key, conversation_id="a-rather-long-conversation-identifier-0123456789", steering=LATCH
    )
    context = browser.new_context(viewport={"width": 360, "height": 800})
    page = context.new_page()
    try:
        sign_in(page, ops, key)
        page.locator("#latches tbody tr", has_text="a-rather-long").wait_for(
            timeout=REFRESH_WAIT_MS
        )
        assert page.evaluate("document.documentElement.scrollWidth") <= 361
    finally:
        context.close()


def test_page_loads_nothing_from_other_origins(page, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    requested: list[str] = []
    page.on("request", lambda r: requested.append(r.url))
    r = httpx.get(ops.url + "/dashboard")
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "form-action 'none'" in csp
    page.goto(ops.url + "/dashboard")
    page.get_by_label("API key").wait_for()
    assert requested and all(u.startswith(ops.url) for u in requested)


# ------------------------------------------------------------------ budget, keys, audit


def no_secret_on_page(page, secrets: list[str]) -> None:  # type: ignore[no-untyped-def]
    """None of ``secrets`` in the page: its DOM (text, attributes, titles) or its URL."""
    html, text = page.content(), page.locator("body").inner_text()
    for secret in secrets:
        assert secret not in html and secret not in text and secret not in page.url


def test_tenant_sees_its_budget_bar_move_after_requests(page, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    key = ops.tenant("acme")
    sign_in(page, ops, key)
    page.locator("#tenant-view").wait_for(state="visible")
    page.locator('#tenant-quotas [data-quota="latch_count"]').wait_for()
    assert page.locator("#budget").is_hidden()  # no budget set: no bar

    tokens = 24  # the stub engine charges 8 tokens a request
    r = ops.admin(
        "PATCH",
        "/admin/tenants/acme",
        json={"limits": {"token_budget": {"tokens": tokens, "period": "day"}}},
    )
    assert r.status_code == 200, r.text
    budget = page.locator('#budget [data-quota="token_budget"]')
    budget.get_by_text(f"0 / {tokens} tokens (0%)").wait_for(timeout=REFRESH_WAIT_MS)
    assert "Token budget per UTC day" in budget.inner_text()
    midnight = (int(time.time()) // 86400 + 1) * 86400
    reset = datetime.datetime.fromtimestamp(midnight, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
    assert f"resets {reset} UTC (in " in budget.locator('[data-field="resets"]').inner_text()

    charged = 0
    for _ in range(2):
        r = ops.chat(key)
        assert r.status_code == 200, r.text
        charged += r.json()["usage"]["total_tokens"]
    assert 0 < charged < tokens
    budget.get_by_text(re.compile(rf"^{charged} / {tokens} tokens")).wait_for(
        timeout=REFRESH_WAIT_MS
    )
    meter = budget.get_by_role("meter")
    assert meter.get_attribute("aria-valuenow") == str(charged)
    width = meter.locator("span").evaluate("e => e.style.width")
    assert float(width.rstrip("%")) == pytest.approx(100 * charged / tokens)
    assert "full" not in (budget.get_attribute("class") or "")
    assert f"{tokens - charged} left" in budget.inner_text()

    # Spend the rest: the bar is full, red and says so; the next request is refused.
    while charged < tokens:
        r = ops.chat(key)
        assert r.status_code == 200, r.text
        charged += r.json()["usage"]["total_tokens"]
    budget.get_by_text("at limit").wait_for(timeout=REFRESH_WAIT_MS)
    assert f"{charged} / {tokens} tokens" in budget.inner_text()
    assert "full" in (budget.get_attribute("class") or "")
    assert meter.get_attribute("aria-valuenow") == str(tokens)
    assert meter.locator("span").evaluate("e => e.style.width") == "100%"
    assert "0 left" in budget.inner_text()
    ops.wait_for(lambda: ops.chat(key).status_code == 429)


def test_admin_and_a_viewer_see_a_tenants_keys(page, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    default_key = ops.tenant("acme")  # one unnamed key with every scope, never used
    bravo_key = ops.tenant("bravo")
    r = ops.admin(
        "POST",
        "/admin/tenants/acme/keys",
        json={
            "name": "ci runner",
            "scopes": ["inference", "usage"],
            "limits": {"rpm": 10},
            "expires_at": time.time() + 3 * 86400,
        },
    )
    assert r.status_code == 201, r.text
    ci = r.json()
    soon = {"name": "short-lived", "expires_at": time.time() + 1}
    short = ops.admin("POST", "/admin/tenants/acme/keys", json=soon).json()
    viewer = ops.admin("POST", "/admin/keys", json={"role": "viewer", "name": "dash"}).json()
    assert viewer["role"] == "viewer"
    assert ops.chat(ci["key"]).status_code == 200  # its last use, flushed in the background
    time.sleep(1.2)  # past short-lived's expiry
    assert ops.chat(short["key"]).status_code == 401

    sign_in(page, ops, viewer["key"])
    page.locator("#admin-view").wait_for(state="visible")
    assert page.locator("#tenant-view").is_hidden()
    select = page.get_by_label("Keys of tenant")
    assert select.evaluate("s => [...s.options].map(o => o.value)") == ["acme", "bravo"]
    assert select.input_value() == "acme"
    row = page.locator(f'#keys tbody tr[data-key="{ci["key_id"]}"]')
    row.wait_for()

    def cell(r, field: str) -> str:  # type: ignore[no-untyped-def]
        return str(r.locator(f'[data-field="{field}"]').inner_text())

    assert "ci runner" in cell(row, "name") and ci["key_id"] in cell(row, "name")
    assert cell(row, "prefix") == ci["prefix"] + "…"
    assert cell(row, "scopes") == "inference, usage"
    assert cell(row, "limits") == "10 req/min"
    assert re.fullmatch(r"\d+s ago", cell(row, "created"))
    assert re.fullmatch(r"in [23]d", cell(row, "expires"))
    assert "expired" not in (row.get_attribute("class") or "")
    # Last use is written to Redis every few seconds: the row shows it once flushed.
    flush_s = FLUSH_INTERVAL_S  # the installed gateway's
    row.locator('[data-field="last_used"]').get_by_text(re.compile(r"^\d+s ago$")).wait_for(
        timeout=(flush_s + 6) * 1000
    )

    expired = page.locator(f'#keys tbody tr[data-key="{short["key_id"]}"]')
    assert "expired" in (expired.get_attribute("class") or "")
    assert expired.locator(".badge", has_text="expired").is_visible()
    assert re.fullmatch(r"expired \d+s ago", cell(expired, "expires"))
    plain = page.locator("#keys tbody tr", has_text="unnamed")
    assert cell(plain, "scopes") == "inference, vectors, latches, usage"
    assert cell(plain, "limits") == "the tenant's"
    assert cell(plain, "expires") == "never" and cell(plain, "last_used") == "never"

    # Another tenant's keys, chosen in the select.
    select.select_option("bravo")
    page.locator("#keys tbody tr").first.wait_for()
    page.wait_for_function(
        "() => document.querySelectorAll('#keys tbody tr[data-key]').length === 1"
    )
    assert "ci runner" not in page.locator("#keys").inner_text()
    secrets = [default_key, bravo_key, ci["key"], short["key"], viewer["key"]]
    no_secret_on_page(page, secrets)

    # The bootstrap admin key sees the same.
    page.get_by_role("button", name="Sign out").click()
    sign_in(page, ops, ADMIN_KEY)
    page.locator("#admin-view").wait_for(state="visible")
    row.wait_for()
    assert re.fullmatch(r"\d+s ago", cell(row, "last_used"))
    assert cell(row, "scopes") == "inference, usage"
    no_secret_on_page(page, [*secrets, ADMIN_KEY])


def test_admin_sees_audit_entries_for_actions_just_made(page, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    tenant_key = ops.tenant("acme")  # tenant.create, key.create (by the bootstrap key)
    created = ops.admin("POST", "/admin/keys", json={"role": "admin", "name": "ops"}).json()
    as_ops = {"Authorization": f"Bearer {created['key']}"}
    r = httpx.post(
        ops.url + "/admin/tenants/acme/keys", headers=as_ops, json={"name": "nightly"}, timeout=10
    )
    assert r.status_code == 201, r.text
    nightly = r.json()
    r = httpx.delete(ops.url + f"/admin/keys/{nightly['key_id']}", headers=as_ops, timeout=10)
    assert r.status_code == 204

    sign_in(page, ops, ADMIN_KEY)
    page.locator("#admin-view").wait_for(state="visible")
    rows = page.locator("#audit tbody tr[data-audit]")
    rows.first.wait_for()

    def entry(i: int) -> dict[str, str]:
        row = rows.nth(i)
        return {
            f: str(row.locator(f'[data-field="{f}"]').inner_text())
            for f in ("time", "actor", "action", "target", "fields")
        }

    # Newest first: revoke, create (both by the new admin key), then the bootstrap's.
    got = [entry(i) for i in range(rows.count())]
    assert [e["action"] for e in got] == [
        "key.revoke",
        "key.create",
        "admin_key.create",
        "key.create",
        "tenant.create",
    ]
    revoke, create, made_admin, first_key, tenant = got
    assert revoke["actor"].split() == [created["key_id"], "admin"]
    assert revoke["target"] == nightly["key_id"] and "tenant_id: acme" in revoke["fields"]
    assert create["actor"].split() == [created["key_id"], "admin"]
    assert create["target"] == nightly["key_id"]
    assert "name: nightly" in create["fields"] and "tenant_id: acme" in create["fields"]
    assert "scopes: inference, vectors, latches, usage" in create["fields"]
    assert made_admin["actor"].split() == ["bootstrap", "admin"]
    assert made_admin["target"] == created["key_id"] and "role: admin" in made_admin["fields"]
    assert first_key["target"].startswith("key_")
    assert tenant["target"] == "acme" and "limits.rpm: 600" in tenant["fields"]
    now = datetime.datetime.now(datetime.UTC)
    shown = datetime.datetime.strptime(revoke["time"], "%Y-%m-%d %H:%M:%S")
    assert abs((now.replace(tzinfo=None) - shown).total_seconds()) < 60

    # A write made while the page is open appears at the top, with what it changed.
    r = ops.admin("PATCH", "/admin/tenants/acme", json={"limits": {"rpm": 900}})
    assert r.status_code == 200
    page.locator("#audit tbody tr[data-audit]").first.get_by_text("tenant.update").wait_for(
        timeout=REFRESH_WAIT_MS
    )
    assert entry(0)["fields"] == "limits.rpm: 600 → 900"
    assert entry(0)["target"] == "acme"

    no_secret_on_page(page, [tenant_key, created["key"], nightly["key"], ADMIN_KEY])


def test_admin_view_in_a_narrow_window_has_no_page_wide_scroll(browser, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    tenant = "a-rather-long-tenant-id-0123456"
    ops.tenant(tenant, token_budget={"tokens": 9, "period": "month"})
    ops.admin(
        "POST",
        f"/admin/tenants/{tenant}/keys",
        json={"name": "a key with a long descriptive name " * 3, "limits": {"rpm": 5}},
    )
    context = browser.new_context(viewport={"width": 360, "height": 800})
    page = context.new_page()
    try:
        sign_in(page, ops, ADMIN_KEY)
        page.locator("#admin-view").wait_for(state="visible")
        page.locator("#keys tbody tr[data-key]").first.wait_for()
        page.locator("#audit tbody tr[data-audit]").first.wait_for()
        assert page.evaluate("document.documentElement.scrollWidth") <= 361
    finally:
        context.close()


def test_a_made_vector_shows_its_provenance_and_report(page, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    key = ops.tenant("acme")
    body = {
        "positive": ["the ocean waves", "ocean tides", "deep ocean"],
        "negative": ["city streets", "downtown traffic", "tall towers"],
        "layers": [1, 2],
    }
    r = httpx.post(
        ops.url + "/v1/steering/vectors/sea/from-examples", headers=bearer(key), json=body
    )
    assert r.status_code == 201, r.text
    httpx.put(
        ops.url + "/v1/steering/vectors/plain",
        headers=bearer(key),
        json={"hook": "post_block", "layers": {"1": [0.1] * 8}},
    )
    sign_in(page, ops, key)
    made = page.locator("#vectors tbody tr", has_text="sea")
    made.wait_for(timeout=REFRESH_WAIT_MS)
    summary = made.locator("details.report summary")
    assert "mean_difference · 3+ / 3− · mean" in summary.inner_text()
    summary.click()
    report = made.locator("table.report tbody tr")
    assert report.count() == 2
    layer1 = r.json()["report"]["layers"]["1"]
    cells = report.nth(0).locator("td").all_inner_texts()
    assert cells == [
        "1",
        f"{layer1['norm']:.3f}",
        f"{layer1['separation']:.2f}",
        f"{layer1['accuracy']:.2f}",
    ]
    plain = page.locator("#vectors tbody tr", has_text="plain")
    assert "uploaded" in plain.inner_text()
