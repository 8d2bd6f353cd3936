"""Optional OpenTelemetry tracing (steergate/gateway/tracing.py): with an in-memory exporter, a
request makes a server span carrying its tenant id and request id, spans opened with
``tracing.span`` nest under it, and the engine receives a ``traceparent`` of the same
trace. With tracing off, no exporter exists, ``span`` is one shared no-op object, the
gateway works, and a client's own ``traceparent`` reaches the engine unchanged."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from steergate.gateway import tracing
from steergate.shared import engine_api
from tests.gateway.conftest import ENGINE_TOKEN, make_tenant
from tests.gateway.ops_env import bearer, chat_body
from tests.gateway.servers import ServerThread
from tests.gateway.stub_engine import StubEngine
from tests.harness import wait_for

OTEL_ENV = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
)
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = f"00-{CLIENT_TRACE_ID}-00f067aa0ba902b7-01"


class HeaderRecorder:
    """Outermost ASGI layer of a stub engine: the headers of every inference request."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.headers: list[dict[str, str]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] in engine_api.STEERED_PATHS:
            self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await self.app(scope, receive, send)


@pytest.fixture()
def recorded_engine() -> Iterator[tuple[str, HeaderRecorder]]:
    recorder = HeaderRecorder(StubEngine(ENGINE_TOKEN).app)
    server = ServerThread(recorder).start()
    yield server.url, recorder
    server.stop()


@pytest.fixture()
def no_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL_ENV:
        monkeypatch.delenv(name, raising=False)
    tracing.shutdown()


@pytest.fixture()
def exporter(no_otel_env: None) -> Iterator[Any]:
    in_memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")
    spans = in_memory.InMemorySpanExporter()
    assert tracing.configure(spans)
    yield spans
    tracing.shutdown()


def server_span(exporter: Any, request_id: str) -> Any:
    """The gateway's SERVER span of the request with this id, once it has ended."""
    return wait_for(
        lambda: next(
            (
                s
                for s in exporter.get_finished_spans()
                if s.attributes.get("steergate.request_id") == request_id
                and s.kind.name == "SERVER"
            ),
            None,
        ),
        5,
    )


def trace_id_of(traceparent: str) -> str:
    return traceparent.split("-")[1]


def chat(url: str, key: str, **headers: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        json=chat_body(),
        headers={**bearer(key), **headers},
        timeout=10,
    )


def test_a_request_is_one_trace_from_the_gateway_to_the_engine(
    exporter: Any,
    start_gateway: Callable[..., ServerThread],
    recorded_engine: tuple[str, HeaderRecorder],
    redis_url: str,
) -> None:
    engine_url, engine = recorded_engine
    gw = start_gateway(engine_urls=engine_url)
    key = make_tenant(redis_url, "acme")
    r = chat(gw.url, key, **{"x-request-id": "trace-me-1"})
    assert r.status_code == 200, r.text
    span = server_span(exporter, "trace-me-1")
    assert span.name == "POST /v1/chat/completions"
    attrs = dict(span.attributes)
    assert attrs["steergate.tenant_id"] == "acme"
    assert attrs["http.route"] == "/v1/chat/completions"
    assert attrs["http.request.method"] == "POST"
    assert attrs["http.response.status_code"] == 200
    assert span.kind.name == "SERVER" and span.parent is None
    assert not any("acme~" in str(v) for v in attrs.values())  # no scoped ids

    sent = engine.headers[-1]
    assert sent["x-request-id"] == "trace-me-1"
    trace_id = format(span.context.trace_id, "032x")
    assert trace_id_of(sent["traceparent"]) == trace_id
    # Every span of this request (the request path's own, where it opens them) is in
    # the same trace and carries the request id.
    mine = [
        s
        for s in exporter.get_finished_spans()
        if s.attributes.get("steergate.request_id") == "trace-me-1"
    ]
    assert all(format(s.context.trace_id, "032x") == trace_id for s in mine)
    # The engine's parent span is one of this trace's spans.
    parent_id = sent["traceparent"].split("-")[2]
    assert parent_id in {format(s.context.span_id, "016x") for s in mine}
    # The request path's stages: auth, admission and proxy are children in this trace,
    # with the tenant id; the engine call is made inside the proxy span.
    by_name = {s.name: s for s in mine}
    for stage in ("auth", "admission", "proxy"):
        assert stage in by_name, sorted(by_name)
        assert by_name[stage].attributes["steergate.tenant_id"] == "acme"
        assert by_name[stage].parent is not None
    assert parent_id == format(by_name["proxy"].context.span_id, "016x")
    # Settlement runs later, in the background, in batches: its own span.
    settled = wait_for(
        lambda: [s for s in exporter.get_finished_spans() if s.name == "settlement"], 5
    )
    assert settled[0].attributes["steergate.requests"] >= 1


def test_a_clients_traceparent_is_the_parent_of_the_gateways_spans(
    exporter: Any,
    start_gateway: Callable[..., ServerThread],
    recorded_engine: tuple[str, HeaderRecorder],
    redis_url: str,
) -> None:
    engine_url, engine = recorded_engine
    gw = start_gateway(engine_urls=engine_url)
    key = make_tenant(redis_url, "acme")
    r = chat(gw.url, key, traceparent=CLIENT_PARENT, **{"x-request-id": "trace-me-2"})
    assert r.status_code == 200, r.text
    span = server_span(exporter, "trace-me-2")
    assert format(span.context.trace_id, "032x") == CLIENT_TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == "00f067aa0ba902b7"
    sent = engine.headers[-1]["traceparent"]
    assert trace_id_of(sent) == CLIENT_TRACE_ID and sent != CLIENT_PARENT  # the gateway's span


def test_span_nests_under_the_current_span_with_steergate_attributes(exporter: Any) -> None:
    with tracing.span("proxy", tenant_id="acme", request_id="r-1", engine=None) as outer:
        assert outer.is_recording()
        with tracing.span("settlement", tenant_id="acme", tokens=8):
            headers = tracing.inject_traceparent({})
    spans = {s.name: s for s in exporter.get_finished_spans()}
    proxy, settle = spans["proxy"], spans["settlement"]
    assert dict(proxy.attributes) == {"steergate.tenant_id": "acme", "steergate.request_id": "r-1"}
    assert settle.attributes["steergate.tokens"] == 8
    assert settle.parent is not None and settle.parent.span_id == proxy.context.span_id
    version, trace_id, parent_id, flags = headers["traceparent"].split("-")
    assert (trace_id, parent_id) == (
        f"{settle.context.trace_id:032x}",
        f"{settle.context.span_id:016x}",
    )
    assert version == "00" and int(flags, 16) & 1  # sampled
    # Outside any span, nothing is injected (e.g. the engine poller's calls).
    assert tracing.inject_traceparent({}) == {}


def test_tracing_off_no_exporter_a_shared_no_op_and_the_clients_traceparent_passes(
    no_otel_env: None,
    start_gateway: Callable[..., ServerThread],
    recorded_engine: tuple[str, HeaderRecorder],
    redis_url: str,
) -> None:
    engine_url, engine = recorded_engine
    gw = start_gateway(engine_urls=engine_url)
    assert not tracing.enabled() and tracing._state.provider is None
    # One shared object, whatever the name and attributes: nothing made per call.
    noop = tracing.span("proxy", tenant_id="acme", request_id="r")
    assert noop is tracing.NOOP_SPAN is tracing.span("admission")
    with noop as inside:
        inside.set_attribute("x", 1)
        assert not inside.is_recording()

    key = make_tenant(redis_url, "acme")
    assert chat(gw.url, key).status_code == 200
    assert "traceparent" not in engine.headers[-1]
    r = chat(gw.url, key, traceparent=CLIENT_PARENT, tracestate="vendor=abc")
    assert r.status_code == 200, r.text
    assert engine.headers[-1]["traceparent"] == CLIENT_PARENT  # passed through unchanged
    assert engine.headers[-1]["tracestate"] == "vendor=abc"
    for bad in ("00-xyz", "ff-" + CLIENT_PARENT[3:], f"00-{'0' * 32}-00f067aa0ba902b7-01"):
        assert chat(gw.url, key, traceparent=bad).status_code == 200
        assert "traceparent" not in engine.headers[-1], bad
    # A streamed answer is proxied the same way.
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json=chat_body(stream=True),
        headers={**bearer(key), "traceparent": CLIENT_PARENT},
        timeout=10,
    )
    assert r.status_code == 200 and "[DONE]" in r.text
    assert engine.headers[-1]["traceparent"] == CLIENT_PARENT
    assert not tracing.enabled()


def test_the_otel_environment_turns_tracing_on(
    no_otel_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not tracing.requested({})
    assert tracing.requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing.requested({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    on = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    assert not tracing.requested({**on, "OTEL_SDK_DISABLED": "true"})
    assert not tracing.requested({**on, "OTEL_TRACES_EXPORTER": "none"})

    pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    from steergate.gateway.app import create_app
    from tests.gateway.conftest import gateway_settings

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    try:
        create_app(gateway_settings(None, "http://127.0.0.1:9"))
        assert tracing.enabled()
        provider = tracing._state.provider
        assert provider.resource.attributes["service.name"] == "steergate-gateway"
    finally:
        tracing.shutdown()
    assert not tracing.enabled()
