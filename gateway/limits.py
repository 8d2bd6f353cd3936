"""Admission: one Lua call decides concurrency, requests/min, tokens/min and the
latch quota for a request, and returns everything the response headers need.

Token reservation: the prompt is estimated at one token per 4 characters (the usual
English average) plus ``max_tokens`` (``max_completion_tokens``; 256 when absent),
capped at the tenant's tpm so a single large request is admissible when the bucket
is full. Settlement later corrects the reservation to the engine's ``usage``.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from gateway import keys
from gateway.scripts import Scripts, evalsha
from gateway.store import store_errors
from gateway.tenants import Tenant
from shared.errors import APIError

log = logging.getLogger("steergate.gateway.limits")

DEFAULT_COMPLETION_RESERVE = 256
CHARS_PER_TOKEN = 4

_REJECTIONS = {
    1: (
        "rate_limit_exceeded",
        "Rate limit reached for requests per minute ({limit}). Retry in {retry}.",
    ),
    2: (
        "rate_limit_exceeded",
        "Rate limit reached for tokens per minute ({limit}). Retry in {retry}.",
    ),
    3: ("concurrency_limit_exceeded", "Too many concurrent requests (limit {limit})."),
    4: ("latch_quota_exceeded", "Storing this latch would exceed the tenant's latch quota."),
}


@dataclass
class Admission:
    """An admitted request: what settlement and the response need."""

    tenant: Tenant
    lease_id: str
    minute: int
    reserved_tokens: int
    conversation_id: str | None
    latch: bool
    #: The conversation's ledger entry before this request ("bytes:kind[:digest]", "").
    prev_latch: str
    evicted: list[str]
    headers: dict[str, str] = field(default_factory=dict)
    unmetered: bool = False
    #: Current content digest of each named vector the request uses ("" = no such vector).
    vector_digests: dict[str, str] = field(default_factory=dict)

    @property
    def latch_digest(self) -> str:
        """Digest of the latch Redis holds for the conversation ("" = none)."""
        parts = self.prev_latch.split(":")
        return parts[2] if len(parts) > 2 else ""


def estimate_tokens(body: dict[str, Any]) -> int:
    """Prompt estimate + completion budget (see module docstring)."""
    chars = 0
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    elif isinstance(prompt, list):
        chars += sum(
            len(p) if isinstance(p, str) else 4 * len(p) if isinstance(p, list) else 4
            for p in prompt
        )
    messages = body.get("messages")
    for msg in messages if isinstance(messages, list) else []:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(
                len(str(part.get("text", ""))) for part in content if isinstance(part, dict)
            )
    budget = body.get("max_completion_tokens", body.get("max_tokens"))
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        budget = DEFAULT_COMPLETION_RESERVE
    n = body.get("n", 1)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    return math.ceil(chars / CHARS_PER_TOKEN) + budget * n


def duration(ms: float) -> str:
    """OpenAI's reset format: "20ms", "1s", "1.5s", "6m0s", "1h2m3s"."""
    ms = max(0, int(math.ceil(ms)))
    if ms < 1000:
        return f"{ms}ms"
    if ms < 60_000:
        return f"{round(ms / 1000, 3):g}s"
    s = ms // 1000
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}h{m}m{sec}s" if h else f"{m}m{sec}s"


def _headers(tenant: Tenant, r: list[Any]) -> dict[str, str]:
    lim = tenant.limits
    return {
        "x-ratelimit-limit-requests": str(lim.rpm),
        "x-ratelimit-remaining-requests": str(max(0, int(r[2]))),
        "x-ratelimit-reset-requests": duration(int(r[3])),
        "x-ratelimit-limit-tokens": str(lim.tpm),
        "x-ratelimit-remaining-tokens": str(max(0, int(r[4]))),
        "x-ratelimit-reset-tokens": duration(int(r[5])),
    }


class Limiter:
    """Runs admit_request.lua; raises 429 (with Retry-After) or 503 store_unavailable."""

    def __init__(self, scripts: Scripts, *, lease_ttl_s: float, fail_open: bool = False) -> None:
        self.scripts = scripts
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.fail_open = fail_open

    async def admit(
        self,
        tenant: Tenant,
        *,
        tokens: int,
        conversation_id: str | None,
        latch: bool,
        latch_bytes: int,
        latch_kind: str,
        vector_names: list[str] | None = None,
    ) -> Admission:
        lim = tenant.limits
        now_ms = int(time.time() * 1000)
        minute = now_ms // 60000
        lease_id = secrets.token_hex(8)
        cost = min(tokens, lim.tpm)
        args = [
            now_ms,
            lim.rpm,
            lim.tpm,
            cost,
            lim.max_concurrency,
            lease_id,
            now_ms + self.lease_ttl_ms,
            conversation_id or "",
            "1" if latch else "0",
            latch_bytes,
            latch_kind,
            lim.latch_count,
            lim.latch_bytes,
            lim.latch_policy,
            keys.USAGE_MINUTE_TTL_S,
            len(vector_names or ()),
            *(vector_names or ()),
        ]
        try:
            async with store_errors():
                r = await evalsha(
                    self.scripts.admit_request, keys.admit_keys(tenant.id, minute), args
                )
        except APIError:
            if not self.fail_open:
                raise
            log.warning("rate-limit store unavailable: admitting UNMETERED (fail-open is set)")
            return Admission(
                tenant, lease_id, minute, 0, conversation_id, False, "", [], unmetered=True
            )
        headers = _headers(tenant, r)
        names = list(vector_names or ())
        n_names = len(names)
        status = int(r[0])
        if status:
            raise _rejection(status, tenant, int(r[1]), headers)
        return Admission(
            tenant=tenant,
            lease_id=lease_id,
            minute=minute,
            reserved_tokens=cost,
            conversation_id=conversation_id,
            latch=latch,
            prev_latch=str(r[6] or ""),
            evicted=[str(v) for v in r[7 + n_names :]],
            headers=headers,
            vector_digests={
                n: str(d or "") for n, d in zip(names, r[7 : 7 + n_names], strict=True)
            },
        )


def _rejection(status: int, tenant: Tenant, retry_ms: int, headers: dict[str, str]) -> APIError:
    code, template = _REJECTIONS[status]
    retry_ms = max(1, retry_ms)
    limit = {1: tenant.limits.rpm, 2: tenant.limits.tpm, 3: tenant.limits.max_concurrency}.get(
        status, 0
    )
    message = template.format(limit=limit, retry=duration(retry_ms))
    return APIError(
        429,
        code,
        message,
        headers={
            **headers,
            "retry-after": str(max(1, math.ceil(retry_ms / 1000))),
            "retry-after-ms": str(retry_ms),
        },
    )
