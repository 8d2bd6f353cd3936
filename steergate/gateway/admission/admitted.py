"""What an admitted request holds until it is settled: its lease, its reservation and
what its response needs. Made by the limiter (``limits.py``), released and charged by
settlement (``settlement.py``); neither module imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass, field

from steergate.gateway.store.key_names import LatchEntry
from steergate.gateway.tenancy.records import Tenant


@dataclass
class Admission:
    """An admitted request: what settlement and the response need."""

    tenant: Tenant
    lease_id: str
    reserved_tokens: int
    conversation_id: str | None
    latch: bool
    #: The conversation's ledger entry before this request (``LatchEntry``; "" for none).
    prev_latch: str
    evicted: list[str]
    headers: dict[str, str] = field(default_factory=dict)
    unmetered: bool = False
    #: Current content digest of each named vector the request uses ("" = no such vector).
    vector_digests: dict[str, str] = field(default_factory=dict)
    #: Current content digest of each named vector the conversation's recorded latch
    #: steers with (``LatchEntry.names``; "" = deleted since).
    latch_vector_digests: dict[str, str] = field(default_factory=dict)
    #: When the lease expires unless renewed (ms, this gateway's clock).
    lease_expiry_ms: int = 0
    #: The API key that made the request ("" for none): its rollups and its own limits.
    key_id: str = ""
    #: The conversation's ledger entry as this admission left it: the pending
    #: "bytes:kind" of a latch it planned, else ``prev_latch``. Settlement undoes or
    #: drops only this entry: one a concurrent turn wrote since is not its to change.
    left_latch: str = ""
    #: What admission removed for each latch it evicted: (conversation, last use,
    #: ledger entry, spec). Handed back to settlement, which puts them back should this
    #: turn's latch not be kept (``settle_request.lua``).
    evicted_latches: tuple[tuple[str, str, str, str], ...] = ()
    #: The latch this turn's engine stored, as (ledger entry, spec), when recording it
    #: failed (Redis unavailable as the turn ended): settlement, retried until Redis
    #: takes it, records it instead (``settle_request.lua`` "record").
    unrecorded_latch: tuple[str, str] | None = None

    @property
    def latch_digest(self) -> str:
        """Digest of the latch Redis holds for the conversation ("" = none)."""
        return LatchEntry.parse(self.prev_latch).digest
