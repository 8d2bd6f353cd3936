"""A request the engine refuses (vLLM's own 400, e.g. ``max_tokens: -1``) generated
nothing, so it is refunded entirely, as docs/gateway.md says: it used to be charged its
whole reservation (257 tokens) when it was not streamed. Real Redis, the gateway, the
stub engine's copy of vLLM's refusal."""

# ruff: noqa: F811 - pytest fixtures are imported, then named as parameters
from __future__ import annotations

import pytest

from tests.gateway.ops_env import Ops, ops  # noqa: F401 - fixture


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_engine_refuses_is_not_charged(ops: Ops, stream: bool) -> None:
    key = ops.tenant("acme", tpm=1000)
    refused = ops.chat(key, max_tokens=-1, stream=stream)  # the gateway reserves 1 + 256
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "max_tokens"
    ops.wait_for(lambda: ops.get(key, "/v1/usage").json()["responses_total"].get("4xx") == 1)
    usage = ops.get(key, "/v1/usage").json()
    assert usage["tokens_total"] == 0
    assert usage["quotas"]["tokens_per_minute"]["used"] == 0
    assert usage["quotas"]["concurrency"]["used"] == 0
    assert usage["requests_made"]["total"] == 1
    # A served request is still charged what the engine reports.
    assert ops.chat(key).status_code == 200
    ops.wait_for(lambda: ops.get(key, "/v1/usage").json()["tokens_total"] > 0)
