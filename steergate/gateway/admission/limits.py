"""Admission: one Lua call decides concurrency, requests/min, tokens/min and the
latch quota for a request, and returns everything the response headers need.

Token reservation: the prompt is estimated at one token per 4 characters (the usual
English average; tool schemas and tool calls count as their JSON), plus what a chat
template adds to a conversation (chat and Responses), plus ``max_tokens``
(``max_completion_tokens``; 256 when absent), capped at the tenant's tpm so a single
large request is admissible when the bucket is full. Settlement later corrects the
reservation to the engine's ``usage``.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from typing import TYPE_CHECKING, Any

import orjson

from steergate.gateway.admission import refusals
from steergate.gateway.admission.admitted import Admission
from steergate.gateway.admission.refusals import Refused
from steergate.gateway.store import key_names as keys
from steergate.gateway.store.connection import store_errors, store_unavailable
from steergate.gateway.store.scripts import AdmitRequest, Scripts, TenantGone
from steergate.gateway.tenancy.records import Tenant
from steergate.gateway.tracing import span
from steergate.shared.errors import APIError

if TYPE_CHECKING:
    from steergate.gateway.admission.settlement import Settler
    from steergate.gateway.tenancy.records import ApiKey

log = logging.getLogger("steergate.gateway.limits")

DEFAULT_COMPLETION_RESERVE = 256
CHARS_PER_TOKEN = 4


def text_tokens(chars: int) -> int:
    """The gateway's one estimate of how many tokens ``chars`` characters of text are
    (before the engine counts them): ``CHARS_PER_TOKEN`` a token, rounded up."""
    return math.ceil(chars / CHARS_PER_TOKEN)

#: Tokens a chat template adds to a conversation: once per prompt (a default system
#: prompt, the generation prompt) and per message (role markers, separators). SmolLM2's
#: adds 30 to one user message, 14 to system + user, 32 to user + assistant and 43 to four
#: messages; these give 30, 36, 36 and 48. Settlement charges what the engine counted.
TEMPLATE_TOKENS_PER_PROMPT = 24
TEMPLATE_TOKENS_PER_MESSAGE = 6
#: admit_request.lua's status for an admission that ran after its deadline.
LATE = 5
#: Added to the Redis timeout for the deadline. An admission that runs inside the slack
#: after its client gave up is released by its cancellation (``Settler.cancel``).
DEADLINE_SLACK_S = 0.5
#: A lease id ``<random>~<tokens>`` holds that many tokens of the tenant's token budget
#: until the lease leaves (settled or expired): what the scripts match (``~(%d+)$``).
HELD_MARK = "~"


def period_left_ms(now_ms: int, period: str) -> int:
    """Milliseconds until the UTC day or calendar month after ``now_ms`` starts."""
    return keys.period_end_s(now_ms / 1000, period) * 1000 - now_ms


def template_tokens(messages: int) -> int:
    """What a chat template adds to a conversation of ``messages`` messages."""
    return TEMPLATE_TOKENS_PER_PROMPT + TEMPLATE_TOKENS_PER_MESSAGE * messages


def estimate_tokens(body: dict[str, Any]) -> int:
    """Prompt estimate + completion budget (see module docstring)."""
    chars = 0
    templated = 0  # tokens the chat template adds
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    elif isinstance(prompt, list):
        chars += sum(
            len(p) if isinstance(p, str) else 4 * len(p) if isinstance(p, list) else 4
            for p in prompt
        )
    for text in (body.get("input"), body.get("instructions")):  # the Responses API
        if isinstance(text, str):
            chars += len(text)
    messages = body.get("messages")
    if isinstance(body.get("input"), list):  # Responses API input items read like messages
        messages = body["input"]
    if isinstance(messages, list) or isinstance(body.get("input"), str):
        # a Responses string input is one user message; instructions one system message
        count = len(messages) if isinstance(messages, list) else 1
        templated = template_tokens(count + isinstance(body.get("instructions"), str))
    for msg in messages if isinstance(messages, list) else []:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(
                len(str(part.get("text", ""))) for part in content if isinstance(part, dict)
            )
        if isinstance(msg, dict) and isinstance(msg.get("tool_calls"), list):
            chars += _json_chars(msg["tool_calls"])
    # The chat template writes the tool schemas into the prompt: a 100 KB `tools` array
    # is about 25k prompt tokens, which a stream left after its first event used to be
    # charged nothing for (and tokens/min never saw).
    for field in ("tools", "functions"):
        if isinstance(body.get(field), list):
            chars += _json_chars(body[field])
    budget = body.get(
        "max_completion_tokens", body.get("max_tokens", body.get("max_output_tokens"))
    )
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        budget = DEFAULT_COMPLETION_RESERVE
    n = body.get("n", 1)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    steering = body.get("steering")
    if isinstance(steering, dict) and steering.get("compare") is True:
        # steering.compare: the engine runs the request twice (steergate/engine/http/compare.py)
        return 2 * (text_tokens(chars) + templated + budget * n)
    return text_tokens(chars) + templated + budget * n


def _json_chars(value: Any) -> int:
    try:
        return len(orjson.dumps(value))
    except (TypeError, orjson.JSONEncodeError):  # pragma: no cover - parsed JSON encodes
        return 0


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


def _headers(tenant: Tenant, r: list[Any], key_rpm: int = 0) -> dict[str, str]:
    """``key_rpm``: the key's own requests/min (0: none). The remaining figure is the
    tighter of the tenant's and the key's, so the limit shown is the tighter one too."""
    lim = tenant.limits
    rpm = min(lim.rpm, key_rpm) if key_rpm else lim.rpm
    return {
        "x-ratelimit-limit-requests": str(rpm),
        "x-ratelimit-remaining-requests": str(max(0, int(r[2]))),
        "x-ratelimit-reset-requests": duration(int(r[3])),
        "x-ratelimit-limit-tokens": str(lim.tpm),
        "x-ratelimit-remaining-tokens": str(max(0, int(r[4]))),
        "x-ratelimit-reset-tokens": duration(int(r[5])),
    }


class Limiter:
    """Runs admit_request.lua; raises 429 (with Retry-After) or 503 store_unavailable.

    With a ``settler`` (the app always has one), an admitted lease is renewed while its
    request runs (``accounting.Leases``), an admission whose answer never came is
    cancelled, and each admission carries a deadline (``redis_timeout_s`` after it was
    sent, when its client gives up, plus ``DEADLINE_SLACK_S`` for event-loop delays and
    the clock offset's error) after which admit_request.lua refuses it without writing
    anything."""

    def __init__(
        self,
        scripts: Scripts,
        *,
        lease_ttl_s: float = 30.0,
        fail_open: bool = False,
        settler: Settler | None = None,
        redis_timeout_s: float = 0.0,
    ) -> None:
        self.scripts = scripts
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.fail_open = fail_open
        self.settler = settler
        self.deadline_s = redis_timeout_s + DEADLINE_SLACK_S if redis_timeout_s > 0 else 0.0
        #: A latch being stored that no live request has touched for this long was
        #: abandoned (``AdmitRequest.pending_horizon_ms``); live ones are touched every TTL/2.
        self.pending_horizon_ms = 2 * self.lease_ttl_ms

    @staticmethod
    def new_lease_id() -> str:
        return secrets.token_hex(8)

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
        api_key: ApiKey | None = None,
    ) -> Admission:
        """``api_key``: the caller's key (``auth.caller_key``): its id, and its own
        ``limits.rpm`` / ``limits.max_concurrency`` (None: the tenant's only)."""
        lim = tenant.limits
        key_id = api_key.key_id if api_key else ""
        key_rpm = (api_key.limits.rpm or 0) if api_key else 0
        key_conc = (api_key.limits.max_concurrency or 0) if api_key else 0
        budget = lim.token_budget
        now_ms = int(time.time() * 1000)
        cost = min(tokens, lim.tpm)
        lease_id = self.new_lease_id()
        if budget is not None and cost > 0:
            # Its reservation counts against the budget until it settles: the id says how
            # much, for every script that releases it (admit_request.lua, KEYS[16]).
            lease_id = f"{lease_id}{HELD_MARK}{cost}"
        expiry_ms = now_ms + self.lease_ttl_ms
        deadline = (
            self.settler.leases.deadline(now_ms, self.deadline_s)
            if self.settler is not None and self.deadline_s > 0
            else 0
        )
        # Leases of this tenant's finished requests, released by this same call.
        finished = self.settler.leases.take_finished(tenant.id) if self.settler else []
        call = AdmitRequest(
            tenant_id=tenant.id,
            generation=tenant.created_at,
            now_ms=now_ms,
            limits=lim,
            cost=cost,
            lease_id=lease_id,
            lease_expiry_ms=expiry_ms,
            conversation_id=conversation_id or "",
            store_latch=latch,
            latch_bytes=latch_bytes,
            latch_kind=latch_kind,
            deadline_ms=deadline,
            pending_horizon_ms=self.pending_horizon_ms,
            key_id=key_id,
            key_rpm=key_rpm,
            key_concurrency=key_conc,
            budget_left_ms=period_left_ms(now_ms, budget.period) if budget else 0,
            vector_names=vector_names or (),
            finished_leases=finished,
        )
        try:
            async with store_errors():
                with span("admission", tenant_id=tenant.id):
                    r = await self.scripts.run(call)
        except TenantGone:
            raise  # deleted since the key was resolved: nothing was written
        except APIError:
            if self.settler is not None:  # it may still run (a hung Redis replays it)
                lost = Admission(
                    tenant, lease_id, cost, None, False, "", [],
                    lease_expiry_ms=expiry_ms, key_id=key_id,
                )  # fmt: skip
                self.settler.cancel(lost)
            if not self.fail_open:
                raise
            log.warning("rate-limit store unavailable: admitting UNMETERED (fail-open is set)")
            return Admission(tenant, lease_id, 0, conversation_id, False, "", [], unmetered=True)
        headers = _headers(tenant, r, key_rpm)
        names = list(vector_names or ())
        n_names = len(names)
        status = int(r[0])
        if status == LATE:  # only a retried send can see this: its client timed out
            raise store_unavailable()
        if status:
            raise _rejection(status, tenant, int(r[1]), headers, key_rpm, key_conc)
        digests = {n: str(d or "") for n, d in zip(names, r[7 : 7 + n_names], strict=True)}
        prev = str(r[6] or "")
        # then the current digests of the vectors the conversation's latch steers with
        refs = keys.LatchEntry.parse(prev).names
        ref_digests = {
            n: str(d or "")
            for n, d in zip(refs, r[7 + n_names : 7 + n_names + len(refs)], strict=True)
        }
        n_names += len(refs)
        n_evicted = int(r[7 + n_names]) if len(r) > 7 + n_names else 0
        evicted = [str(v) for v in r[8 + n_names : 8 + n_names + n_evicted]]
        # admit_request.lua plans no latch for one naming a vector the tenant lacks
        planned = latch and bool(conversation_id) and all(digests.values())
        adm = Admission(
            tenant=tenant,
            lease_id=lease_id,
            reserved_tokens=cost,
            conversation_id=conversation_id,
            latch=latch,
            prev_latch=prev,
            evicted=evicted,
            evicted_latches=_saved_latches(evicted, r[8 + n_names + len(evicted) :]),
            headers=headers,
            vector_digests=digests,
            latch_vector_digests=ref_digests,
            lease_expiry_ms=expiry_ms,
            key_id=key_id,
            left_latch=_left_latch(prev, latch_bytes, latch_kind, names) if planned else prev,
        )
        if self.settler is not None:
            self.settler.leases.hold(adm)
            self.settler.redis_answered()
        return adm

    async def admit_plain(self, tenant: Tenant, api_key: ApiKey | None) -> Admission:
        """A request that is not inference (a vector upload, the model list, the
        tokenizer): one request against requests/min and concurrency, no tokens, no
        latch."""
        return await self.admit(
            tenant,
            tokens=0,
            conversation_id=None,
            latch=False,
            latch_bytes=0,
            latch_kind="ref",
            api_key=api_key,
        )


def _rejection(
    status: int,
    tenant: Tenant,
    retry_ms: int,
    headers: dict[str, str],
    key_rpm: int = 0,
    key_conc: int = 0,
) -> Refused:
    """The 429 for an admission refusal (``gateway/refusals.py``). Only a rate limit
    (GCRA) knows when it will pass: it carries that exact time (``Retry-After`` /
    ``retry-after-ms``). The concurrency limit passes when a running request ends
    (unknown: the client backs off on its own), the latch quota never by waiting
    (``x-should-retry: false``); the registry in ``shared/errors.py`` sets those
    headers from the code. A budget passes when its period rolls over: Retry-After says
    when, though x-should-retry is false (retrying sooner cannot help)."""
    refusal = refusals.BY_STATUS[status]
    retry_ms = max(1, retry_ms)
    lim = tenant.limits
    budget = lim.token_budget
    limits = {
        "rpm": lim.rpm,
        "tpm": lim.tpm,
        "max_concurrency": lim.max_concurrency,
        "token_budget": budget.tokens if budget else 0,
        "key_rpm": key_rpm,
        "key_max_concurrency": key_conc,
    }
    return Refused(
        refusal,
        headers=headers,
        retry_after_ms=retry_ms if refusal.says_when else None,
        limit=limits.get(refusal.limit, 0),
        retry=duration(retry_ms),
        period=budget.period if budget else "day",
    )


def _saved_latches(
    evicted: list[str], saved: list[Any]
) -> tuple[tuple[str, str, str, str], ...]:
    """Each evicted recorded latch with its last use, entry and spec (a pending entry
    that admission reclaimed is no latch to put back)."""
    out = []
    for i, conv in enumerate(evicted):
        used, info, spec = (str(v or "") for v in saved[3 * i : 3 * i + 3])
        if info:
            out.append((conv, used, info, spec))
    return tuple(out)


def _left_latch(prev: str, nbytes: int, kind: str, names: list[str]) -> str:
    """The pending entry of a planned latch, as admit_request.lua writes it: it holds the
    larger of its own and the replaced latch's bytes until the turn settles
    (``keep_latch.lua`` sets the exact size), so a failed shrinking turn never puts the
    tenant over its quota; and the names of both latches' vectors."""
    before = keys.LatchEntry.parse(prev)
    both = tuple(dict.fromkeys((*names, *before.names)))
    return str(keys.LatchEntry(max(nbytes, before.nbytes), kind, "", both))
