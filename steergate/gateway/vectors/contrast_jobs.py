"""Where from-examples' contrast math runs (``contrast.compute``, every layer of one
job): threads of its own, one job at a time per tenant; and the bound on the
activations its jobs hold (:class:`ActivationMemory`).

Not on the default executor: its threads also decode GGUF uploads (under a 5 s bound)
and large ``/v1/tokenize`` bodies, and a tenant's ``pca`` jobs (leave-one-out power
iterations, seconds per layer on a wide model) held every one of them, so another
tenant's GGUF upload was refused. Here a tenant's jobs queue behind its own
(``TenantTurns``), and numpy's linear algebra releases the GIL while it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from steergate.gateway.admission.turns import TenantTurns
from steergate.gateway.admission.units import format_bytes
from steergate.shared.errors import APIError

T = TypeVar("T")

#: Jobs computing at once, gateway-wide (each one tenant's).
THREADS = 2
#: ``STEERGATE_EXAMPLES_MEMORY_BYTES``'s default (steergate/shared/settings.py).
MEMORY_BYTES = 2 * 1024**3


class ContrastJobs:
    """Owned by the app's lifespan: ``async with jobs.memory.hold(tenant_id, nbytes)``
    around a job, ``await jobs.run(tenant_id, fn)`` for its math."""

    def __init__(self, threads: int = THREADS, memory_bytes: int = MEMORY_BYTES) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="steergate-contrast")
        self._turns = TenantTurns()
        self.memory = ActivationMemory(memory_bytes)

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


class ActivationMemory:
    """The captured activations from-examples jobs hold at once, gateway-wide: each job
    holds ``examples x layers x hidden x 4`` bytes from its first capture until its
    vector is stored (1.3 GB for 512 examples of an 80-layer, 8192-wide model).

    ``async with memory.hold(tenant_id, nbytes)``: one hold per tenant at a time (a
    tenant's next job waits for its previous one, never for another tenant's); a hold
    that would pass ``limit`` with other tenants' jobs is refused at once, 503
    ``gateway_busy`` (retryable, nothing charged), rather than queued behind them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._turns = TenantTurns()

    @contextlib.asynccontextmanager
    async def hold(self, tenant_id: str, nbytes: int) -> AsyncIterator[None]:
        async with self._turns.turn(tenant_id):
            if self.held + nbytes > self.limit:
                raise APIError(
                    "gateway_busy",
                    f"Other from-examples jobs hold {format_bytes(self.held)} of the "
                    f"gateway's {format_bytes(self.limit)} for activations; this job needs "
                    f"{format_bytes(nbytes)}. Retry shortly.",
                )
            self.held += nbytes
            try:
                yield
            finally:
                self.held -= nbytes
