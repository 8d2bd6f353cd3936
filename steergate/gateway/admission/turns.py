"""One at a time per tenant: a tenant's heavy jobs (large bodies parsed in worker
processes, from-examples contrast math) queue behind each other, never behind another
tenant's. A shared pool alone would let one tenant's backlog delay everyone; with one
job in flight per tenant, another tenant waits for at most the jobs already running.

Per app (per event loop): the locks are asyncio's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass
class _Turn:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class TenantTurns:
    """``async with turns.turn(tenant_id)``: this tenant's turn. Entries exist only
    while a tenant has a job running or waiting."""

    def __init__(self) -> None:
        self._turns: dict[str, _Turn] = {}

    @contextlib.asynccontextmanager
    async def turn(self, tenant_id: str) -> AsyncIterator[None]:
        turn = self._turns.setdefault(tenant_id, _Turn())
        turn.users += 1
        try:
            async with turn.lock:
                yield
        finally:
            turn.users -= 1
            if not turn.users:
                del self._turns[tenant_id]

    def __len__(self) -> int:
        return len(self._turns)
