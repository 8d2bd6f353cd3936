"""Settlement, off the hot path: finished requests are queued and flushed every few
milliseconds as one pipeline of settle_request.lua calls.

A finished request's lease stops counting against concurrency at once: its id is kept
(:meth:`Leases.finish`) and released by the next admission of its tenant on this gateway,
inside that same admit_request.lua call (no extra round trip). Its settlement, which
under load lands about one request-duration later, then charges it exactly once.

A settlement releases the concurrency lease (if no admission did first), corrects the
token reservation to the engine's reported ``usage``, counts the status class, and
fixes latch accounting from the engine's ``x-steering-latch`` answer. The loop does
Redis work only (no engine I/O), so one tenant's settlements never wait on another's
engine calls.

Leases cannot strand (docs/operations.md, "Recovery bounds"):

- a lease lives ``lease_ttl_s`` (30 s) and :class:`Leases` renews it while its request
  runs, so a lease that nobody renews is gone within one TTL;
- an admission whose reply never came (timeout) is *cancelled*: its lease id is released
  as soon as Redis answers again, in case the admission landed after all; one that runs
  after its deadline is refused by admit_request.lua itself;
- a settlement is retried until Redis takes it (settle_request.lua is idempotent), and
  given up only once its lease has provably expired (then only usage counts are lost).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from steergate.gateway.admission.admitted import Admission
from steergate.gateway.store.connection import Redis, is_cluster
from steergate.gateway.store.scripts import (
    RenewLeases,
    Scripts,
    SettleRequest,
    TenantGone,
    evalsha,
    tenant_gone,
    wire,
)
from steergate.gateway.tracing import span
from steergate.shared.engine_api import DROP_STATES, KEEP_STATES
from steergate.shared.log_limits import RateLimitedWarning

log = logging.getLogger("steergate.gateway.accounting")


#: Default lease TTL (settings: ``lease_ttl_s``).
LEASE_TTL_S = 30.0
#: A settlement is given up once its lease expired this long ago (clock skew between
#: gateways, which sweep each other's leases by their own clocks).
EXPIRY_GRACE_MS = 2000
#: How often the Redis clock is read for admission deadlines.
CLOCK_EVERY_S = 60.0
#: Finished leases one admission releases at most (the rest wait for the next one, or
#: for their settlement).
RELEASE_PER_ADMISSION = 64
#: Finished leases kept per tenant awaiting an admission; past it the oldest are left
#: to their settlement (a tenant that stopped sending needs no early release).
MAX_FINISHED = 1024


#: The status settled (and logged, and counted in metrics) for a request whose client
#: disconnected before its answer ended: nginx's "client closed request". Nobody
#: receives it; ``/v1/usage`` counts it as a 4xx, so requests made and responses add up.
CLIENT_CLOSED = 499


@dataclass(frozen=True)
class Outcome:
    admission: Admission
    status: int  # HTTP status the client got (CLIENT_CLOSED: it went away first)
    tokens_used: int  # prompt + completion; -1: unknown (the reservation is charged)
    latch_state: str | None  # the engine's x-steering-latch, if any
    steered: bool = False  # the request carried its own ``steering``
    #: An admission whose answer never came (see ``Settler.cancel``).
    cancelled: bool = False
    #: The prompt's share of ``tokens_used`` (the rest is completion). Where the engine
    #: reported no usage, the charge is the reservation, billed as prompt tokens.
    prompt_tokens: int = -1

    def split(self) -> tuple[int, int]:
        """(prompt, completion) tokens to bill."""
        total = self.tokens_used if self.tokens_used >= 0 else self.admission.reserved_tokens
        prompt = total if self.tokens_used < 0 or self.prompt_tokens < 0 else self.prompt_tokens
        prompt = min(max(0, prompt), total)
        return prompt, total - prompt


def status_class(status: int) -> str:
    if status == 429:
        return "429"
    if 200 <= status < 300:
        return "2xx"
    if 400 <= status < 500:
        return "4xx"
    if status >= 500:
        return "5xx"
    return ""


def latch_action(o: Outcome) -> str:
    a = o.admission
    if not a.conversation_id:
        return ""
    if o.latch_state in DROP_STATES:
        if not a.latch and a.prev_latch and not a.latch_digest:
            # A plain turn while another turn stores the conversation's latch: the latch
            # its engine dropped is not the one that turn is storing (its entry's).
            return ""
        return "drop"
    if a.latch:
        if o.latch_state in KEEP_STATES:
            return "record" if a.unrecorded_latch else "keep"
        return "restore"  # failed or not stored: put the earlier latch state back
    # An engine that lacks a latch Redis holds asks for it (409 latch_missing) instead of
    # answering "none", so a plain turn never tells us a latch is gone: Redis keeps it.
    return ""


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class _Live:
    tenant_id: str
    expiry_ms: int
    #: The conversation whose latch the request is storing ("": none).
    storing: str


class Leases:
    """The leases this process holds for requests still running: renewed every
    ``ttl_s / 6`` once a third of their TTL is used (short requests cost nothing), with
    one renew_leases.lua call per tenant. Also keeps the offset of Redis's clock, for
    admission deadlines (admit_request.lua compares them with its own TIME)."""

    def __init__(self, redis: Redis, scripts: Scripts, *, ttl_s: float = LEASE_TTL_S) -> None:
        self.redis = redis
        self.scripts = scripts
        self.ttl_ms = int(ttl_s * 1000)
        #: Redis's clock minus ours (ms); 0 until first read.
        self.offset_ms = 0
        self._clock_read_at = -CLOCK_EVERY_S
        self._live: dict[str, _Live] = {}
        #: Per tenant: lease ids of requests whose answer ended, settlement not yet
        #: applied (an insertion-ordered dict as an ordered set).
        self._finished: dict[str, dict[str, None]] = {}
        self.renewals = 0  # figures for tests
        self.lost = 0

    def expiry(self, at_ms: int) -> int:
        return at_ms + self.ttl_ms

    def deadline(self, at_ms: int, budget_s: float) -> int:
        """``at_ms`` (our clock) + ``budget_s``, in Redis's clock."""
        return at_ms + self.offset_ms + int(budget_s * 1000)

    def hold(self, adm: Admission) -> None:
        storing = adm.conversation_id if (adm.latch and adm.conversation_id) else ""
        self._live[adm.lease_id] = _Live(adm.tenant.id, adm.lease_expiry_ms, storing or "")

    def release(self, adm: Admission) -> int:
        """Stop renewing; the lease's last known expiry (our clock)."""
        live = self._live.pop(adm.lease_id, None)
        return live.expiry_ms if live is not None else adm.lease_expiry_ms

    def finish(self, adm: Admission) -> None:
        """``adm``'s answer ended: the next admission of its tenant releases its lease."""
        done = self._finished.setdefault(adm.tenant.id, {})
        done[adm.lease_id] = None
        if len(done) > MAX_FINISHED:
            del done[next(iter(done))]

    def take_finished(self, tenant_id: str) -> list[str]:
        """Finished lease ids for an admission of ``tenant_id`` to release (forgotten
        here: if that admission fails, their settlement releases them)."""
        done = self._finished.get(tenant_id)
        if not done:
            return []
        if len(done) <= RELEASE_PER_ADMISSION:
            del self._finished[tenant_id]
            return list(done)
        ids = [done.popitem()[0] for _ in range(RELEASE_PER_ADMISSION)]  # newest first
        return ids

    def settled(self, tenant_id: str, lease_id: str) -> None:
        """Its settlement reached Redis: nothing left to release early."""
        done = self._finished.get(tenant_id)
        if done is not None:
            done.pop(lease_id, None)
            if not done:
                del self._finished[tenant_id]

    def __len__(self) -> int:
        return len(self._live)

    async def read_clock(self) -> None:
        t0 = time.time()
        sec, usec = await self.redis.time()
        t1 = time.time()
        self.offset_ms = int(sec * 1000 + usec // 1000 - (t0 + t1) * 500)
        self._clock_read_at = time.monotonic()

    async def renew(self) -> None:
        """One heartbeat: renew every lease past a third of its TTL."""
        at = now_ms()
        due: dict[str, list[str]] = collections.defaultdict(list)
        for lease_id, live in self._live.items():
            if live.expiry_ms - at < self.ttl_ms * 2 // 3:
                due[live.tenant_id].append(lease_id)
        for tenant_id, ids in due.items():
            ids = [i for i in ids if i in self._live]  # some may have settled meanwhile
            storing = [self._live[i].storing for i in ids if self._live[i].storing]
            if not ids:
                continue
            expiry = self.expiry(at)
            out = await self.scripts.run(
                RenewLeases(
                    tenant_id=tenant_id,
                    now_ms=at,
                    expiry_ms=expiry,
                    lease_ids=ids,
                    storing=storing,
                )
            )
            for lease_id, renewed in zip(ids, out, strict=True):
                held = self._live.get(lease_id)
                if held is None:  # settled meanwhile
                    continue
                if int(renewed):
                    held.expiry_ms = expiry
                    self.renewals += 1
                else:  # expired while Redis could not be reached: nothing left to renew
                    self._live.pop(lease_id)
                    self.lost += 1
                    log.warning("a running request lost its lease (expired before renewal)")

    async def run(self, stop: asyncio.Event) -> None:
        tick = self.ttl_ms / 6000
        while not stop.is_set():
            try:
                if time.monotonic() - self._clock_read_at >= CLOCK_EVERY_S:
                    await self.read_clock()
                await self.renew()
            except Exception as exc:  # noqa: BLE001 - never let the heartbeat die; next tick
                log.warning("lease heartbeat failed (%s)", type(exc).__name__)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), tick)


@dataclass
class _Item:
    outcome: Outcome
    #: When the request's lease expires (our clock): past it, the settlement may be dropped.
    expiry_ms: int


class Settler:
    """Batches outcomes into one Redis pipeline per flush; retries what Redis did not take."""

    def __init__(
        self,
        redis: Redis,
        scripts: Scripts,
        *,
        lease_ttl_s: float = LEASE_TTL_S,
        flush_interval_s: float = 0.002,
        max_batch: int = 512,
        max_pending: int = 50_000,
        max_backoff_s: float = 0.25,
    ) -> None:
        self.redis = redis
        self.scripts = scripts
        self.leases = Leases(redis, scripts, ttl_s=lease_ttl_s)
        self.flush_interval_s = flush_interval_s
        self.max_batch = max_batch
        self.max_pending = max_pending
        self.max_backoff_s = max_backoff_s
        #: Once per 10 s, with a count: a batch retried every backoff step for as long
        #: as Redis is down was a line each time.
        self._failing = RateLimitedWarning(interval=10.0, logger=log)
        # A deque and one future to wake the flusher: asyncio.Queue + wait_for would
        # create a task per wait, on every request at low concurrency.
        self._pending: collections.deque[_Item] = collections.deque()
        self._wake: asyncio.Future[None] | None = None
        #: Cuts a retry back-off short once Redis is known to answer again.
        self._nudge: asyncio.Future[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        #: Figures (tests, logs): settlements retried, given up (lease expired), shed.
        self.retried = 0
        self.dropped = 0
        self.shed = 0

    #: Called with every outcome Redis has settled (the app's metrics: tokens by tenant),
    #: so the counters are the numbers the rollups hold: a settlement given up after its
    #: lease expired was counted there but never charged (found from outside).
    on_outcome: Callable[[Outcome], None] | None = None

    def submit(self, outcome: Outcome) -> None:
        if outcome.admission.unmetered:
            return
        self.leases.finish(outcome.admission)
        self._enqueue(_Item(outcome, self.leases.release(outcome.admission)))

    def cancel(self, adm: Admission) -> None:
        """An admission whose answer never came: release its lease (and refund its
        tokens) in case it landed after all. A no-op in Redis if it never did."""
        bare = Admission(
            adm.tenant,
            adm.lease_id,
            adm.reserved_tokens,
            None,
            False,
            "",
            [],
            lease_expiry_ms=adm.lease_expiry_ms,
            key_id=adm.key_id,  # its key's lease is released too
        )
        self._enqueue(_Item(Outcome(bare, 0, 0, None, cancelled=True), adm.lease_expiry_ms))

    def _enqueue(self, item: _Item) -> None:
        self._idle.clear()
        self._pending.append(item)
        if len(self._pending) > self.max_pending:
            self._shed()
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def _shed(self) -> None:
        """Back-pressure (Redis far behind): give up the settlements of the tenant with
        the most queued, oldest first, so the others' are kept. A shed settlement's lease
        expires within its TTL; only its usage counts are lost."""
        counts = collections.Counter(i.outcome.admission.tenant.id for i in self._pending)
        top = counts.most_common(1)[0][0]
        n = min(counts[top], len(self._pending) - self.max_pending * 9 // 10)
        kept: collections.deque[_Item] = collections.deque()
        for item in self._pending:
            if n > 0 and item.outcome.admission.tenant.id == top:
                n -= 1
                self.shed += 1
                continue
            kept.append(item)
        self._pending = kept
        log.error("settlement queue over %d: shed tenant %s's oldest", self.max_pending, top)

    def pending(self) -> int:
        return len(self._pending)

    def redis_answered(self) -> None:
        """An admission just went through: retry what failed now, not after the back-off
        (after a hang, every moment a lost lease is still held costs the tenant)."""
        nudge = self._nudge
        if nudge is not None and not nudge.done():
            nudge.set_result(None)

    async def _back_off(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        nudge = self._nudge = loop.create_future()
        timer = loop.call_later(seconds, _resolve, nudge)
        try:
            await nudge
        finally:
            timer.cancel()
            self._nudge = None

    async def drain(self) -> None:
        """Wait until everything submitted so far is settled (tests, shutdown)."""
        while self._pending or not self._idle.is_set():
            await asyncio.sleep(self.flush_interval_s)

    async def _wait_for_work(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        wake = self._wake = loop.create_future()
        timer = loop.call_later(timeout_s, _resolve, wake)
        try:
            await wake
        finally:
            timer.cancel()
            self._wake = None

    async def run(self, stop: asyncio.Event) -> None:
        heartbeat = asyncio.create_task(self.leases.run(stop))
        try:
            await self._run(stop)
        finally:
            heartbeat.cancel()

    async def _run(self, stop: asyncio.Event) -> None:
        backoff = 0.0
        while not (stop.is_set() and not self._pending):
            if not self._pending:
                self._idle.set()
                await self._wait_for_work(0.2)  # wakes on submit; sees ``stop`` within 0.2 s
                continue
            if backoff:  # after a failure: Redis is down or hung
                await self._back_off(backoff)
            await asyncio.sleep(self.flush_interval_s)  # let a batch gather
            batch = [self._pending.popleft()]
            while self._pending and len(batch) < self.max_batch:
                batch.append(self._pending.popleft())
            failed = await self._flush(batch)
            if failed:
                self._pending.extendleft(reversed(failed))
                backoff = min(self.max_backoff_s, max(0.05, backoff * 2))
            else:
                backoff = 0.0
            if not self._pending:
                self._idle.set()

    async def _flush(self, batch: list[_Item]) -> list[_Item]:
        """Settle ``batch``; what must be tried again. One tenant's failing call fails
        only its own settlement; a connection failure fails the batch (sent again as a
        whole: settle_request.lua is idempotent). A settlement refused because its tenant
        was deleted meanwhile is done: nothing of that tenant is left to charge."""
        try:
            with span("settlement", requests=len(batch)):
                results = await self._settle([item.outcome for item in batch])
        except Exception as exc:  # noqa: BLE001 - Redis down, hung, or restarting
            self._failing.warn(
                "settlement of %d failed (%s); retrying", len(batch), type(exc).__name__
            )
            results = [exc] * len(batch)
        failed = []
        for item, r in zip(batch, results, strict=True):
            if isinstance(r, Exception) and not tenant_gone(r):
                failed.append(item)
            else:
                a = item.outcome.admission
                self.leases.settled(a.tenant.id, a.lease_id)
                if self.on_outcome is not None and not isinstance(r, Exception):
                    self.on_outcome(item.outcome)
        if not failed:
            return []
        at = now_ms()
        again = [i for i in failed if at <= i.expiry_ms + EXPIRY_GRACE_MS]
        self.retried += len(again)
        if len(again) < len(failed):
            self.dropped += len(failed) - len(again)
            log.error(
                "gave up %d settlements whose leases have expired (usage counts lost)",
                len(failed) - len(again),
            )
        return again

    async def _settle(self, batch: list[Outcome]) -> list[Any]:
        """One pipeline of EVALSHA calls; per call, its result or its error. (redis-py's
        Script-in-pipeline would add a SCRIPT EXISTS round trip to every flush; NOSCRIPT
        after a Redis restart is handled here instead, re-running only the calls that hit
        it.)"""
        now_ms = int(time.time() * 1000)
        script = self.scripts.settle_request
        calls = []
        for o in batch:
            a = o.admission
            prompt, completion = o.split()
            action = latch_action(o)
            record = a.unrecorded_latch if action == "record" and a.unrecorded_latch else ("", "")
            call = SettleRequest(
                tenant_id=a.tenant.id,
                generation=a.tenant.created_at,
                now_ms=now_ms,
                lease_id=a.lease_id,
                tpm=a.tenant.limits.tpm,
                token_delta=(o.tokens_used - a.reserved_tokens) if o.tokens_used >= 0 else 0,
                status_class=status_class(o.status),
                tokens_used=o.tokens_used if o.tokens_used >= 0 else a.reserved_tokens,
                conversation_id=a.conversation_id or "",
                latch_action=action,
                prev_latch=a.prev_latch,
                cancel_expiry_ms=a.lease_expiry_ms if o.cancelled else 0,
                prompt_tokens=prompt,
                completion_tokens=completion,
                key_id=a.key_id,
                left_latch=a.left_latch,
                latch_count_quota=a.tenant.limits.latch_count,
                latch_bytes_quota=a.tenant.limits.latch_bytes,
                record_info=record[0],
                record_spec=record[1],
                evicted_latches=a.evicted_latches if action in ("drop", "restore") else (),
            )
            calls.append(wire(call))
        if len(calls) == 1:  # the usual case at low load: a pipeline costs more than it saves
            try:
                return [await evalsha(script, *calls[0])]
            except TenantGone as exc:  # deleted while it ran: nothing left to charge
                return [exc]
        if is_cluster(self.redis):
            # A cluster pipeline refuses EVALSHA (redis-py cannot route it by slot), so
            # on a cluster the batch is concurrent calls, each to its tenant's node.
            return await asyncio.gather(
                *(evalsha(script, ks, args) for ks, args in calls), return_exceptions=True
            )
        results: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        for _ in range(2):
            pipe = self.redis.pipeline(transaction=False)
            for i in todo:
                ks, args = calls[i]
                pipe.evalsha(script.sha, len(ks), *ks, *args)
            out = await pipe.execute(raise_on_error=False)
            missing = []
            for i, r in zip(todo, out, strict=True):
                if isinstance(r, NoScriptError):
                    missing.append(i)
                    results[i] = r
                elif isinstance(r, Exception) and not isinstance(r, ResponseError):
                    raise r  # the connection, not the call: the caller retries the batch
                else:
                    results[i] = r  # a result, or this one call's own error
            if not missing:
                break
            await self.redis.script_load(script.script)
            todo = missing
        return results
