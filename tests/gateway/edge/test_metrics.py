"""``GET /metrics``: every documented metric exists, Grafana and Prometheus configs only
use what exists, tenant ids (never keys) as labels, health gauges tell the truth."""

# ruff: noqa: F811 - pytest fixtures are imported, then named as parameters
from __future__ import annotations

import json
import re
import time

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from steergate.gateway.app import create_app
from tests.gateway.conftest import gateway_settings
from tests.gateway.ops_env import ADMIN, Ops, bearer, ops  # noqa: F401 - fixture
from tests.harness import ROOT, RedisProcess, free_port

INLINE_LATCH = {"vectors": [{"hook": "post_block", "layers": {"1": [0.5] * 8}}], "latch": True}
MONITORING = ROOT / "deploy" / "monitoring"
DOC_ROW = re.compile(r"^\|\s*`(steergate_[a-z0-9_]+)`\s*\|\s*(\w+)\s*\|\s*([^|]*)\|")


def documented() -> dict[str, tuple[str, set[str]]]:
    """name -> (type, labels) from the metrics tables in docs/ (docs/metrics.md, and
    docs/operations.md once the table is folded in there)."""
    rows: dict[str, tuple[str, set[str]]] = {}
    for doc in ("metrics.md", "operations.md"):
        path = ROOT / "docs" / doc
        for line in path.read_text().splitlines() if path.exists() else []:
            m = DOC_ROW.match(line)
            if m:
                labels = set(re.findall(r"`([a-z_]+)`", m.group(3)))
                assert rows.get(m.group(1), (m.group(2), labels)) == (m.group(2), labels), line
                rows[m.group(1)] = (m.group(2), labels)
    assert len(rows) >= 15, "the metrics table in docs/ was not found"
    return rows


def scrape(url: str) -> dict[str, tuple[str, list]]:
    """family name as written in '# TYPE' -> (type, samples)."""
    r = httpx.get(url + "/metrics", headers=ADMIN, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", r.text, flags=re.M))
    out: dict[str, tuple[str, list]] = {}
    for fam in text_string_to_metric_families(r.text):
        name = fam.name + ("_total" if fam.type == "counter" else "")
        out[name] = (fam.type, fam.samples)
    assert set(types) >= {n for n in out if n.startswith("steergate_")}
    return out


def traffic(ops: Ops) -> str:
    """A 200, a latch, a 429 for tenant acme; returns its key."""
    key = ops.tenant("acme", rpm=2, latch_count=4, latch_bytes=4096)
    assert ops.chat(key, conversation_id="c1", steering=INLINE_LATCH).status_code == 200
    # captured bytes are metered (the stub runs no model: 0 rows, 0 bytes)
    capture = {"sites": [{"hook": "post_block", "layers": [1]}]}
    assert ops.chat(key, capture=capture).status_code == 200
    assert ops.chat(key).status_code == 429
    return key


def test_every_documented_metric_exists_with_its_type_and_labels(ops: Ops) -> None:
    traffic(ops)
    streamer = ops.tenant("streamer")  # a stream: time to first token
    assert ops.chat(streamer, stream=True).status_code == 200
    families = scrape(ops.url)
    for name, (kind, labels) in documented().items():
        assert name in families, f"{name} is documented but not in /metrics"
        ftype, samples = families[name]
        assert ftype == kind, (name, ftype, kind)
        assert samples, f"{name} has no samples after traffic"
        seen = set(samples[0].labels) - {"le"}
        assert seen == labels, (name, seen, labels)


def test_every_steergate_metric_in_the_output_is_documented(ops: Ops) -> None:
    traffic(ops)
    exposed = {n for n in scrape(ops.url) if n.startswith("steergate_")}
    assert exposed == set(documented())


def test_per_tenant_counters_move_and_labels_are_tenant_ids_never_keys(ops: Ops) -> None:
    key = traffic(ops)
    text = httpx.get(ops.url + "/metrics", headers=ADMIN).text
    assert key not in text and key[:12] not in text and key[6:18] not in text
    fams = scrape(ops.url)
    requests = {
        (s.labels["route"], s.labels["code"]): s.value
        for s in fams["steergate_requests_total"][1]
        if s.name == "steergate_requests_total" and s.labels["tenant"] == "acme"
    }
    assert requests[("/v1/chat/completions", "200")] == 2
    assert requests[("/v1/chat/completions", "429")] == 1
    rejections = {
        s.labels["cause"]: s.value
        for s in fams["steergate_rejections_total"][1]
        if s.name == "steergate_rejections_total"
    }
    assert rejections == {"rate_limit_exceeded": 1}
    latch = {
        s.labels["state"]: s.value
        for s in fams["steergate_latch_events_total"][1]
        if s.name == "steergate_latch_events_total"
    }
    assert latch == {"latched": 1}
    used = {
        s.labels["quota"]: s.value
        for s in fams["steergate_quota_used"][1]
        if s.labels["tenant"] == "acme"
    }
    assert used["requests_per_minute"] == 2 and used["latch_bytes"] == 32
    count = [
        s.value
        for s in fams["steergate_request_duration_seconds"][1]
        if s.name == "steergate_request_duration_seconds_count"
        and s.labels == {"tenant": "acme", "route": "/v1/chat/completions"}
    ]
    assert count == [3]
    ops.wait_for(
        lambda: (
            [
                s.value
                for s in scrape(ops.url)["steergate_tokens_total"][1]
                if s.name == "steergate_tokens_total"
            ]
            == [16]
        )
    )


def test_route_label_is_the_template_not_the_path(ops: Ops) -> None:
    key = ops.tenant("acme")
    assert (
        httpx.delete(
            ops.url + "/v1/steering/latches/secret-conv-1", headers=bearer(key)
        ).status_code
        == 404
    )
    text = httpx.get(ops.url + "/metrics", headers=ADMIN).text
    assert "secret-conv-1" not in text
    assert 'route="/v1/steering/latches/{conversation_id}"' in text


def test_deleted_tenant_disappears_from_the_next_scrape(ops: Ops) -> None:
    traffic(ops)
    assert 'tenant="acme"' in httpx.get(ops.url + "/metrics", headers=ADMIN).text
    assert ops.admin("DELETE", "/admin/tenants/acme").status_code == 204
    assert 'tenant="acme"' not in httpx.get(ops.url + "/metrics", headers=ADMIN).text


def test_a_deleted_tenant_disappears_from_every_replicas_scrape(ops: Ops, start_gateway) -> None:  # type: ignore[no-untyped-def]
    """Only the replica that served the delete forgot the tenant's series; the others
    kept them until restart, and a tenant re-created with its id continued them."""
    other = start_gateway(engine_urls=ops.engine_url)
    key = traffic(ops)
    r = httpx.get(other.url + "/v1/usage", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200
    assert 'tenant="acme"' in httpx.get(other.url + "/metrics", headers=ADMIN).text
    assert ops.admin("DELETE", "/admin/tenants/acme").status_code == 204
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if 'tenant="acme"' not in httpx.get(other.url + "/metrics", headers=ADMIN).text:
            break
        time.sleep(0.1)
    assert 'tenant="acme"' not in httpx.get(other.url + "/metrics", headers=ADMIN).text


def test_engine_gauges_follow_the_engine_and_a_dead_engine_is_0(ops: Ops, start_gateway) -> None:  # type: ignore[no-untyped-def]
    ops.tenant("acme")
    ops.engine.plant_latch("acme~x")  # one float32 site of the stub's hidden size 8
    fams = scrape(ops.url)
    assert [s.value for s in fams["steergate_engine_latched_bytes"][1]] == [32]
    assert [s.value for s in fams["steergate_engine_up"][1]] == [1]
    dead = f"http://127.0.0.1:{free_port()}"
    gw = start_gateway(engine_urls=f"{ops.engine_url},{dead}")
    up = {s.labels["engine"]: s.value for s in scrape(gw.url)["steergate_engine_up"][1]}
    assert up == {ops.engine_url: 1, dead: 0}


def test_redis_down_is_reported_not_a_failed_scrape(ops: Ops, redis_server: RedisProcess) -> None:
    ops.tenant("acme")
    assert [s.value for s in scrape(ops.url)["steergate_store_up"][1]] == [1]
    redis_server.stop()
    try:
        started = time.monotonic()
        fams = scrape(ops.url)
        assert time.monotonic() - started < 5
        assert [s.value for s in fams["steergate_store_up"][1]] == [0]
        assert fams["steergate_quota_used"][1] == []
        assert [s.value for s in fams["steergate_engine_up"][1]] == [1]
    finally:
        redis_server.start()


def test_each_app_has_its_own_registry(ops: Ops, start_gateway) -> None:  # type: ignore[no-untyped-def]
    a, b = (
        create_app(gateway_settings(None, "http://x")),
        create_app(gateway_settings(None, "http://x")),
    )
    assert a.state.metrics is not b.state.metrics
    assert a.state.metrics.registry is not b.state.metrics.registry
    other = start_gateway(engine_urls=ops.engine_url)
    traffic(ops)
    assert not [s for s in scrape(other.url)["steergate_requests_total"][1]]


# ---------------------------------------------------------------------------- configs


def test_grafana_dashboard_parses_and_queries_only_existing_metrics(ops: Ops) -> None:
    traffic(ops)
    exposed = set(scrape(ops.url))
    histograms = {n for n, (t, _) in scrape(ops.url).items() if t == "histogram"}
    dashboards = list((MONITORING / "grafana" / "dashboards").glob("*.json"))
    assert dashboards
    for path in dashboards:
        dash = json.loads(path.read_text())
        exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
        exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
        assert len(exprs) >= 10
        for expr in exprs:
            for name in re.findall(r"\b(steergate_[a-z0-9_]+)", expr):
                base = re.sub(r"_(bucket|sum|count)$", "", name)
                assert name in exposed or base in histograms, f"{path.name}: {name} does not exist"
        uids = {t["datasource"]["uid"] for p in dash["panels"] for t in p.get("targets", [])}
        assert uids == {"steergate-prometheus"}


def test_grafana_provisioning_and_prometheus_config_agree() -> None:
    ds = yaml.safe_load(
        (MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    assert ds["datasources"][0]["uid"] == "steergate-prometheus"
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    providers = yaml.safe_load(
        (MONITORING / "grafana/provisioning/dashboards/steergate.yml").read_text()
    )
    assert providers["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    prom = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    job = prom["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics"
    assert job["authorization"]["type"] == "Bearer"  # /metrics needs the scrape token
    assert job["static_configs"][0]["targets"] == ["gateway:8080"]


def test_docs_metrics_file_lists_the_same_metrics_as_the_code() -> None:
    # Cheap guard that does not need a gateway: names in the doc appear in the code.
    code = (ROOT / "steergate" / "gateway" / "edge" / "metrics.py").read_text()
    for name in documented():
        stem = re.sub(r"_total$", "", name)
        assert f'"{stem}"' in code or f'"{name}"' in code, name
