"""When each API key was last used, recorded off the hot path.

An authenticated request only notes ``key_id -> now`` in this replica's memory (a
dict assignment; no Redis call). A background task flushes what accumulated every
``FLUSH_INTERVAL_S`` seconds: one ``record_key_use.lua`` call per tenant with keys
used since the last flush, whatever the number of requests. The script writes a time
only for a key that still exists (a flush racing a revoke or a tenant delete recreates
nothing) and only if it is newer than the stored one (replicas flush independently).
So ``last_used_at`` in the key list lags real use by up to one interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict

from steergate.gateway.store.scripts import RecordKeyUse, Scripts

log = logging.getLogger("steergate.gateway.keyuse")

#: Seconds between flushes of last-use times (per replica).
FLUSH_INTERVAL_S = 5.0


class KeyUse:
    """Replica-local last-use times, flushed to Redis in batches."""

    def __init__(self, scripts: Scripts, interval_s: float = FLUSH_INTERVAL_S) -> None:
        self.scripts = scripts
        self.interval_s = interval_s
        self._pending: dict[str, tuple[str, float]] = {}  # key_id -> (tenant_id, unix s)
        #: Script calls made by flushes (one per tenant per flush), for tests and logs.
        self.flush_calls = 0

    def touch(self, tenant_id: str, key_id: str, now: float) -> None:
        """Hot path: note the use. No I/O."""
        self._pending[key_id] = (tenant_id, now)

    def pending(self) -> int:
        return len(self._pending)

    async def flush(self) -> None:
        if not self._pending:
            return
        batch, self._pending = self._pending, {}
        by_tenant: dict[str, list[tuple[str, float]]] = defaultdict(list)
        for key_id, (tenant_id, used) in batch.items():
            by_tenant[tenant_id].append((key_id, used))
        results = await asyncio.gather(
            *(self._write(tid, uses) for tid, uses in by_tenant.items()), return_exceptions=True
        )
        failed = {
            tid
            for tid, res in zip(by_tenant, results, strict=True)
            if isinstance(res, BaseException)
        }
        if failed:
            # Keep them for the next flush, unless a newer use was noted meanwhile.
            for key_id, (tenant_id, used) in batch.items():
                if tenant_id in failed and key_id not in self._pending:
                    self._pending[key_id] = (tenant_id, used)
            log.warning("last-used flush failed for %d tenant(s); retrying later", len(failed))

    async def _write(self, tenant_id: str, uses: list[tuple[str, float]]) -> int:
        self.flush_calls += 1
        return int(await self.scripts.run(RecordKeyUse(tenant_id=tenant_id, uses=uses)))

    async def run(self, stop: asyncio.Event) -> None:
        """Flush every ``interval_s`` until ``stop``, then once more."""
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never let the flusher die
                log.warning("last-used flush failed: %s", type(exc).__name__)
