"""Issue 23, defect 2, as the attack: tenant A (max_concurrency 2) sends maximal
hostile steering bodies (7.8 MB, valid JSON, invalid steering at the very end; inline
arrays and packed base64) as fast as its limits let it, against a real gateway process
and Redis; tenant B's ``GET /v1/usage`` and small steered chats meanwhile stay within
100 ms of their p95 without the attack. Before the fix B's p95 was seconds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.gateway.conftest import FakeEngine, installed_gateway, make_tenant
from tests.gateway.hostile_load import p95, probe, summary, under_attack
from tests.harness import GatewayProcess

pytestmark = pytest.mark.timed

ATTACK_S = 8.0


@pytest.fixture()
def gateway_process(redis_url: str, fake_engine: FakeEngine) -> Iterator[GatewayProcess]:
    gw = installed_gateway(redis_url, fake_engine.url)
    yield gw
    gw.stop()


@pytest.mark.parametrize("kind", ["chat", "vector"])
def test_hostile_steering_bodies_cost_another_tenant_under_100_ms_of_p95(
    gateway_process: GatewayProcess, redis_url: str, kind: str
) -> None:
    """``chat``: the issue's attack, as chat steering; ``vector``: the same bodies as
    vector uploads (the named vectors the 400 points to)."""
    url = gateway_process.url
    key_a = make_tenant(redis_url, "attacker", max_concurrency=2)
    key_b = make_tenant(redis_url, "bystander", rpm=100_000)
    quiet = probe(url, key_b, ATTACK_S - 1.5)
    loud, codes = under_attack(url, key_a, key_b, ATTACK_S, kind)
    print("\n" + summary("B without attack", quiet.all))
    print(summary("B during attack  ", loud.all))
    print(summary("  of which usage ", loud.usage), "|", summary("chat", loud.chat))
    print("A's answers:", codes, "B's statuses:", loud.statuses)
    assert set(loud.statuses) == {200} and set(quiet.statuses) == {200}
    # Every hostile body was refused, and refused as what it is (or by A's own limits).
    assert codes and all(c.split()[0] in ("400", "429") for c in codes), codes
    assert sum(n for c, n in codes.items() if c.startswith("400")) >= 4, codes
    assert p95(loud.all) <= p95(quiet.all) + 100, (p95(quiet.all), p95(loud.all))
