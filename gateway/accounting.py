"""Settlement, off the hot path: finished requests are queued and flushed every few
milliseconds as one pipeline of settle_request.lua calls.

A settlement releases the concurrency lease, corrects the token reservation to the
engine's reported ``usage``, counts the status class, and fixes latch accounting from
the engine's ``x-steering-latch`` answer. If Redis is down the batch is retried a few
times and then dropped (the lease expires by itself; only usage counts are lost).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError

from gateway import keys
from gateway.limits import Admission
from gateway.scripts import Scripts, evalsha
from gateway.store import Redis
from shared.engine_api import DROP_STATES, KEEP_STATES

log = logging.getLogger("steergate.gateway.accounting")


DeleteLatch = Callable[[str, str], Awaitable[None]]  # (tenant_id, client conversation id)


@dataclass(frozen=True)
class Outcome:
    admission: Admission
    status: int  # HTTP status the client got (0: client went away before an answer)
    tokens_used: int
    latch_state: str | None  # the engine's x-steering-latch, if any
    steered: bool = False  # the request carried its own ``steering``


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
        return "drop"
    if a.latch:
        if o.latch_state in KEEP_STATES:
            return "keep"
        return "restore"  # failed or not stored: put the earlier latch state back
    # An engine that lacks a latch Redis holds asks for it (409 latch_missing) instead of
    # answering "none", so a plain turn never tells us a latch is gone: Redis keeps it.
    return ""


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Settler:
    """Batches outcomes into one Redis pipeline per flush."""

    def __init__(
        self,
        redis: Redis,
        scripts: Scripts,
        delete_latch: DeleteLatch,
        *,
        flush_interval_s: float = 0.002,
        max_batch: int = 512,
        retries: int = 3,
    ) -> None:
        self.redis = redis
        self.scripts = scripts
        self.delete_latch = delete_latch
        self.flush_interval_s = flush_interval_s
        self.max_batch = max_batch
        self.retries = retries
        # A deque and one future to wake the flusher: asyncio.Queue + wait_for would
        # create a task per wait, on every request at low concurrency.
        self._pending: collections.deque[Outcome] = collections.deque()
        self._wake: asyncio.Future[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    def submit(self, outcome: Outcome) -> None:
        if outcome.admission.unmetered:
            return
        self._idle.clear()
        self._pending.append(outcome)
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

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
        while not (stop.is_set() and not self._pending):
            if not self._pending:
                self._idle.set()
                await self._wait_for_work(0.2)  # wakes on submit; sees ``stop`` within 0.2 s
                continue
            await asyncio.sleep(self.flush_interval_s)  # let a batch gather
            batch = [self._pending.popleft()]
            while self._pending and len(batch) < self.max_batch:
                batch.append(self._pending.popleft())
            await self._flush(batch)
            if not self._pending:
                self._idle.set()

    async def _flush(self, batch: list[Outcome]) -> None:
        for attempt in range(self.retries):
            try:
                results = await self._settle(batch)
                break
            except Exception as exc:  # Redis down: back off, then give up on this batch
                log.warning("settlement failed (%s), attempt %d", type(exc).__name__, attempt + 1)
                await asyncio.sleep(0.2 * (attempt + 1))
        else:
            log.error("dropped %d settlements; leases expire on their own", len(batch))
            return
        for o, orphaned in zip(batch, results, strict=True):
            if orphaned and o.admission.conversation_id:
                # Stored on the engine after the quota had already evicted it: undo there.
                with contextlib.suppress(Exception):
                    await self.delete_latch(o.admission.tenant.id, o.admission.conversation_id)

    async def _settle(self, batch: list[Outcome]) -> list[int]:
        """One pipeline of EVALSHA calls. (redis-py's Script-in-pipeline would add a
        SCRIPT EXISTS round trip to every flush; NOSCRIPT after a Redis restart is
        handled here instead, re-running only the calls that hit it.)"""
        now_ms = int(time.time() * 1000)
        script = self.scripts.settle_request
        calls = []
        for o in batch:
            a = o.admission
            ks = keys.admit_keys(a.tenant.id, now_ms // 60000)
            args = [
                now_ms,
                a.lease_id,
                a.tenant.limits.tpm,
                (o.tokens_used - a.reserved_tokens) if o.tokens_used >= 0 else 0,
                status_class(o.status),
                o.tokens_used if o.tokens_used >= 0 else a.reserved_tokens,
                a.conversation_id or "",
                latch_action(o),
                a.prev_latch,
                keys.USAGE_MINUTE_TTL_S,
            ]
            calls.append((ks, args))
        if len(calls) == 1:  # the usual case at low load: a pipeline costs more than it saves
            return [int(await evalsha(script, *calls[0]) or 0)]
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
                elif isinstance(r, Exception):
                    raise r
                else:
                    results[i] = r
            if not missing:
                break
            await self.redis.script_load(script.script)
            todo = missing
        return [int(r or 0) for r in results]
