"""Issue 23, defect 1: the installed ``steergate gateway``, started as a user starts it
(the console script, from a folder outside the checkout, no PYTHONPATH into it: see
tests/harness.py "The installed product"), serves every file it ships. Before the fix
the dashboard read ``resources.files("gateway")``, a package that exists only inside
the checkout: ``GET /dashboard`` was a 500 in every installed gateway."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.conftest import FakeEngine, installed_gateway, start_stub_engine
from tests.harness import ROOT, GatewayProcess

STATIC = ROOT / "steergate" / "gateway" / "static"


@pytest.fixture()
def installed(redis_url: str) -> Iterator[GatewayProcess]:
    engine: FakeEngine = start_stub_engine()
    gw = installed_gateway(redis_url, engine.url)
    try:
        yield gw
    finally:
        gw.stop()
        engine.server.stop()


def _outside_checkout(gw: GatewayProcess) -> None:
    """The process really runs as installed: its folder and import path are not the
    checkout's (the checkout on the path would hide the bug)."""
    assert gw.proc is not None
    cwd = Path(os.readlink(f"/proc/{gw.proc.pid}/cwd")).resolve()
    assert ROOT not in (cwd, *cwd.parents), cwd
    environ = Path(f"/proc/{gw.proc.pid}/environ").read_bytes().split(b"\0")
    paths = [e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"PYTHONPATH=")]
    for entry in (p for value in paths for p in value.split(os.pathsep) if p):
        assert Path(entry).resolve() != ROOT, entry


def test_installed_gateway_serves_the_dashboard_and_its_assets(
    installed: GatewayProcess,
) -> None:
    _outside_checkout(installed)
    page = httpx.get(installed.url + "/dashboard", timeout=10)
    assert page.status_code == 200, page.text
    assert page.headers["content-type"].startswith("text/html")
    assert page.content == (STATIC / "dashboard.html").read_bytes()
    assets = re.findall(r'(?:href|src)="(/dashboard/[^"]+)"', page.text)
    assert sorted(assets) == ["/dashboard/dashboard.css", "/dashboard/dashboard.js"]
    types = {"dashboard.css": "text/css", "dashboard.js": "text/javascript"}
    for path in assets:
        r = httpx.get(installed.url + path, timeout=10)
        name = path.rsplit("/", 1)[1]
        assert r.status_code == 200, (path, r.text)
        assert r.headers["content-type"].startswith(types[name])
        assert r.content == (STATIC / name).read_bytes()
        assert "default-src 'none'" in r.headers["content-security-policy"]
