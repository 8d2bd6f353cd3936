"""Prometheus gains billed prompt/completion tokens and a time-to-first-token histogram
per tenant (issue 13 item 6): the scrape equals what the client was told."""

from __future__ import annotations

import re
from typing import Any

import httpx
import orjson

from tests.gateway.conftest import ADMIN_KEY, make_tenant

BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_token_counters_and_ttft_match_what_clients_saw(gateway: Any, redis_url: str) -> None:
    key = make_tenant(redis_url, "metered", rpm=1000, max_concurrency=10)
    auth = {"Authorization": f"Bearer {key}"}
    unary = httpx.post(gateway.url + "/v1/chat/completions", json=BODY, headers=auth).json()
    stream = httpx.post(
        gateway.url + "/v1/chat/completions",
        json={**BODY, "stream": True, "stream_options": {"include_usage": True}},
        headers=auth,
    )
    events = [orjson.loads(x[6:]) for x in stream.text.splitlines() if x.startswith("data: {")]
    usages = [unary["usage"], events[-1]["usage"]]
    prompt = sum(u["prompt_tokens"] for u in usages)
    completion = sum(u["completion_tokens"] for u in usages)
    assert prompt > 0 and completion > 0

    text = httpx.get(
        gateway.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    ).text
    assert sample(text, "steergate_prompt_tokens_total", tenant="metered") == prompt
    assert sample(text, "steergate_completion_tokens_total", tenant="metered") == completion
    route = "/v1/chat/completions"
    ttft = "steergate_time_to_first_token_seconds"
    # one stream -> one observation; the unary answer is not a first token
    assert sample(text, ttft + "_count", tenant="metered", route=route) == 1
    assert 0 < sample(text, ttft + "_sum", tenant="metered", route=route) < 10
