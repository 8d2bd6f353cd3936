"""Schemathesis over the gateway's own OpenAPI document (issue 9, proof): generated
requests, valid and invalid, with generated bodies for every route that takes one
(the raw-body inference and vector routes included), against a live gateway with
real Redis and a healthy fake engine. No answer may be 5xx: with Redis and the engine
up, even 502/503/504 would be the gateway's own fault."""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import ADMIN_KEY, make_tenant
from tests.gateway.servers import ServerThread
from tests.gateway.stub_engine import HIDDEN, LAYERS

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
#: Per operation and generation mode (about 20 operations x 2 modes, ~10 s); set
#: STEERGATE_FUZZ_EXAMPLES higher for a deeper run by hand.
MAX_EXAMPLES = int(os.environ.get("STEERGATE_FUZZ_EXAMPLES", "25"))
RAW_BODY_ROUTES = {
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("PUT", "/v1/steering/vectors/{name}"),
    ("POST", "/v1/steering/vectors/{name}/from-examples"),
}


def fit_to_the_served_model(node: Any) -> None:
    """The document cannot know the model's shape; this run's engine does (HIDDEN x
    LAYERS). Narrow every ``layers`` map to it, so that valid vectors are generated
    too and requests get past validation to the limiter, Redis and the engine."""
    if isinstance(node, dict):
        layers = node.get("properties", {}).get("layers")
        if isinstance(layers, dict) and "additionalProperties" in layers:
            layers["propertyNames"] = {"pattern": f"^[0-{LAYERS - 1}]$"}
            layers["minProperties"] = 1
            layers["additionalProperties"] = {
                "type": "array",
                "items": {"type": "number", "minimum": -4, "maximum": 4},
                "minItems": HIDDEN,
                "maxItems": HIDDEN,
            }
        for value in node.values():
            fit_to_the_served_model(value)
    elif isinstance(node, list):
        for value in node:
            fit_to_the_served_model(value)


def test_no_generated_request_gets_a_5xx(gateway: ServerThread, redis_url: str) -> None:
    import schemathesis
    from schemathesis import GenerationMode

    big = {"rpm": 10**9, "tpm": 10**12, "max_concurrency": 1000}
    key = make_tenant(redis_url, "acme", **big)
    tenant = {"Authorization": f"Bearer {key}"}
    doc = httpx.get(gateway.url + "/openapi.json", headers=ADMIN, timeout=10).json()
    fit_to_the_served_model(doc)
    schema = schemathesis.openapi.from_dict(doc)
    ops = [r.ok() for r in schema.get_all_operations()]
    # Tenant routes first: the admin ones create and delete tenants and keys.
    ops.sort(key=lambda o: (o.path.startswith("/admin/"), o.path, o.method))
    seen = {(o.method.upper(), o.path) for o in ops}
    assert RAW_BODY_ROUTES <= seen and len(seen) >= 20, sorted(seen)
    for op in ops:
        if (op.method.upper(), op.path) in RAW_BODY_ROUTES:
            assert op.body, f"{op.method} {op.path} has no documented body to generate"

    failures: list[tuple[Any, ...]] = []
    statuses: Counter[tuple[str, str, int]] = Counter()
    started = time.monotonic()
    for op in ops:
        headers = ADMIN if op.path.startswith("/admin/") else tenant
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz(op, mode, gateway.url, headers, statuses, failures)
    elapsed = time.monotonic() - started
    calls = sum(statuses.values())
    assert not failures, "\n".join(map(str, failures[:20]))
    assert calls >= len(ops) * 10, calls  # the run did exercise every operation
    print(f"schemathesis: {calls} requests over {len(ops)} operations in {elapsed:.1f} s")
    for (method, path, status), n in sorted(statuses.items()):
        print(f"  {method:6} {path:45} {status} x{n}")


def fuzz(
    op: Any,
    mode: Any,
    base_url: str,
    headers: dict[str, str],
    statuses: Counter[tuple[str, str, int]],
    failures: list[tuple[Any, ...]],
) -> None:
    """Up to MAX_EXAMPLES generated requests for one operation in one mode."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=mode))  # type: ignore[misc]
    def check(case: Any) -> None:
        resp = case.call(base_url=base_url, headers=headers, timeout=10)
        statuses[(case.method, case.operation.path, resp.status_code)] += 1
        if resp.status_code >= 500:
            failures.append(
                (
                    mode.value,
                    case.method,
                    case.formatted_path,
                    case.query,
                    repr(case.body)[:300],
                    resp.status_code,
                    resp.text[:200],
                )
            )

    try:
        check()
    except Unsatisfiable:
        # Nothing to make invalid (no body, and any string fits the parameters).
        assert mode is GenerationMode.NEGATIVE, f"{op.method} {op.path}"


@pytest.fixture(autouse=True)
def _quiet_gateway_logs(caplog: pytest.LogCaptureFixture) -> None:
    # Generated garbage makes the gateway log every 4xx cause; keep the output short.
    caplog.set_level("ERROR")
