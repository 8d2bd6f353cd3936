"""The quota dashboard in real headless Chromium (Debian's /usr/bin/chromium driven by
Playwright), against a live gateway, the fake engine and a real Redis."""

# ruff: noqa: F811 - pytest fixtures are imported, then named as parameters
from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.conftest import ADMIN_KEY, fake_engine, start_gateway  # noqa: F401 - fixtures
from tests.gateway.ops_env import Ops, bearer, ops  # noqa: F401 - fixture
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
    key = ops.tenant("acme", rpm=20, latch_count=2, latch_bytes=4096)
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
