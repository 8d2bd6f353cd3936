"""Where from-examples' contrast math runs (``contrast.compute``, every layer of one
job): threads of its own, one job at a time per tenant.

Not on the default executor: its threads also decode GGUF uploads (under a 5 s bound)
and large ``/v1/tokenize`` bodies, and a tenant's ``pca`` jobs (leave-one-out power
iterations, seconds per layer on a wide model) held every one of them, so another
tenant's GGUF upload was refused. Here a tenant's jobs queue behind its own
(``TenantTurns``), and numpy's linear algebra releases the GIL while it runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from steergate.gateway.admission.turns import TenantTurns

T = TypeVar("T")

#: Jobs computing at once, gateway-wide (each one tenant's).
THREADS = 2


class ContrastJobs:
    """Owned by the app's lifespan: ``await jobs.run(tenant_id, fn)``."""

    def __init__(self, threads: int = THREADS) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="steergate-contrast")
        self._turns = TenantTurns()

    async def run(self, tenant_id: str, fn: Callable[[], T]) -> T:
        """``fn()`` on a contrast thread, once this tenant's earlier jobs are done. A
        caller cancelled meanwhile (its client left) leaves a running ``fn`` to finish
        on its thread; its tenant's next job waits for it."""
        async with self._turns.turn(tenant_id):
            future = asyncio.get_running_loop().run_in_executor(self._pool, fn)
            try:
                return await asyncio.shield(future)
            except asyncio.CancelledError:
                await asyncio.wait([future])  # the thread is busy until fn returns
                raise

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
