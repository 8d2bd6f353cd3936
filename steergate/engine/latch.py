"""The latch controller: which conversations keep steering between turns.

It lives in the API-server process, one per engine (``--api-server-count`` must
stay 1: a second API server would hold a second, disagreeing map). The workers
never see a latch; they see the resolved payload of each request, which vLLM
broadcasts byte-identically to every tensor-parallel rank. So "identical on
every rank" holds by construction, and the caps bound the one place latches live.

The controller is pure and deterministic: recency is the order of an
``OrderedDict`` (a logical clock), so which latch is evicted is a function of
the operation sequence alone. Wall time is recorded only to display ``last_used``.
No vLLM, torch or I/O here, so it is unit- and property-testable on its own.
"""

from __future__ import annotations

import builtins
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from steergate.shared.clamp import ClampItem
from steergate.shared.engine_api import LatchState
from steergate.shared.latch_spec import LatchSpec, latch_digest
from steergate.shared.log_limits import RateLimitedWarning

log = logging.getLogger("steergate.latch")

Site = tuple[str, int]  # (hook, layer)


@dataclass(frozen=True)
class RefTerm:
    """A named vector kept by reference: applied only while ``name`` still has ``digest``."""

    name: str
    digest: str
    scale: float


@dataclass(frozen=True)
class Latch:
    """What a conversation keeps. ``value_sites`` are float32 vectors already scaled
    and summed per (hook, layer); ``refs`` cost no bytes (the registry holds the data)."""

    phase: str
    value_sites: Mapping[Site, np.ndarray] = field(default_factory=dict)
    refs: tuple[RefTerm, ...] = ()
    clamps: tuple[ClampItem, ...] = ()  # in request order, by value or by reference

    @property
    def nbytes(self) -> int:
        # float32 vectors of hidden_size each: 4 x hidden x number of sites.
        return int(sum(int(v.nbytes) for v in self.value_sites.values())) + sum(
            c.nbytes for c in self.clamps
        )

    @property
    def kind(self) -> Literal["value", "ref"]:
        return "value" if self.value_sites or any(c.sites for c in self.clamps) else "ref"

    def named(self) -> list[tuple[str, str]]:
        """(name, digest) of every by-reference term, adds and clamps: the latch is
        stale once any of them names other content."""
        return [(r.name, r.digest) for r in self.refs] + [
            c.ref for c in self.clamps if c.ref is not None
        ]

    @functools.cached_property
    def digest(self) -> str:
        """The latch's identity, equal to :attr:`LatchSpec.digest` of the same latch
        (how the gateway and an engine agree on which latch a conversation holds)."""
        return latch_digest(self.phase, self.value_sites, self._ref_tuples(), self.clamps)

    def spec(self) -> LatchSpec:
        return LatchSpec(self.phase, dict(self.value_sites), self._ref_tuples(), self.clamps)

    @classmethod
    def from_spec(cls, spec: LatchSpec) -> Latch:
        return cls(
            spec.phase, dict(spec.sites), tuple(RefTerm(*r) for r in spec.refs), spec.clamps
        )

    def _ref_tuples(self) -> tuple[tuple[str, str, float], ...]:
        return tuple((r.name, r.digest, r.scale) for r in self.refs)


@dataclass
class _Entry:
    latch: Latch
    nbytes: int
    last_used: float  # wall time, display only


DigestLookup = Callable[[str], "str | None"]
"""Current digest of a named vector, or None when it no longer exists."""


class LatchController:
    """LRU map conversation id -> :class:`Latch` under a count cap and a byte cap.

    Both caps hold after every public method returns. Only :meth:`store` and
    :meth:`use` touch recency; :meth:`delete` and :meth:`list` do not.
    """

    def __init__(
        self,
        max_count: int,
        max_bytes: int,
        epoch: str,
        *,
        wall_clock: Callable[[], float] = time.time,
        warning: RateLimitedWarning | None = None,
    ) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.epoch = epoch
        self._wall = wall_clock
        self._warning = warning or RateLimitedWarning(logger=log)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self._bytes = 0
        self.evictions = 0
        self.refusals = 0
        self.bridges = 0
        self.latches_stored = 0

    # -- operations ------------------------------------------------------------

    def store(self, conversation_id: str, latch: Latch) -> LatchState:
        """Keep ``latch`` for the conversation, replacing any earlier one.

        A latch that can never fit (bytes over the byte cap, or a count cap of 0) is
        refused, and the conversation's earlier latch is removed too: the client asked
        to replace it, and keeping the old steering would silently apply what the
        client just replaced.
        """
        nbytes = latch.nbytes
        existed = self._remove(conversation_id)
        if nbytes > self.max_bytes or self.max_count < 1:
            self.refusals += 1
            self._warning.warn(
                "latch refused: %d bytes exceeds the engine cap of %d bytes (count cap %d)",
                nbytes,
                self.max_bytes,
                self.max_count,
            )
            return "refused_oversize"
        self._entries[conversation_id] = _Entry(latch, nbytes, self._wall())
        self._bytes += nbytes
        self.latches_stored += 1
        self._evict_to_caps(keep=conversation_id)
        return "replaced" if existed else "latched"

    def undo_store(self, conversation_id: str, stored: Latch, before: Latch | None) -> None:
        """Take back the :meth:`store` of ``stored``, whose turn vLLM refused: the
        conversation holds ``before`` again (its earlier latch, or none) and ``stored``
        is not counted as stored. A turn that is refused never changes a conversation's
        steering. If another turn has latched the conversation since, its latch stands."""
        entry = self._entries.get(conversation_id)
        if entry is not None and entry.latch is stored:
            self._remove(conversation_id)
            self.latches_stored -= 1
        elif entry is not None:
            return  # a later turn's latch
        if before is not None:
            self._entries[conversation_id] = _Entry(before, before.nbytes, self._wall())
            self._bytes += before.nbytes
            self._evict_to_caps(keep=conversation_id)

    def use(self, conversation_id: str, digest_of: DigestLookup) -> tuple[LatchState, Latch | None]:
        """The latch that steers a turn without ``steering`` (``bridged``), refreshing its
        recency; ``dropped_stale`` (and removed) if a by-reference term's vector changed
        or was deleted; ``none`` if the conversation has no latch."""
        entry = self._entries.get(conversation_id)
        if entry is None:
            return "none", None
        if any(digest_of(name) != digest for name, digest in entry.latch.named()):
            self._remove(conversation_id)
            return "dropped_stale", None
        self._entries.move_to_end(conversation_id)
        entry.last_used = self._wall()
        self.bridges += 1
        return "bridged", entry.latch

    def delete(self, conversation_id: str) -> bool:
        return self._remove(conversation_id)

    # -- views -----------------------------------------------------------------

    def get(self, conversation_id: str) -> Latch | None:
        entry = self._entries.get(conversation_id)
        return entry.latch if entry else None

    def list(self, prefix: str = "") -> builtins.list[dict[str, Any]]:
        """Latches whose id starts with ``prefix``, least recently used first."""
        return [
            {
                "conversation_id": cid,
                "bytes": e.nbytes,
                "kind": e.latch.kind,
                "digest": e.latch.digest,
                "last_used": e.last_used,
            }
            for cid, e in self._entries.items()
            if cid.startswith(prefix)
        ]

    def order(self) -> builtins.list[str]:
        """Conversation ids, least recently used first (the eviction order)."""
        return list(self._entries)

    @property
    def count(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def status(self) -> dict[str, Any]:
        return {
            "latched_conversations": len(self._entries),
            "latched_bytes": self._bytes,
            "max_latched_conversations": self.max_count,
            "max_latched_bytes": self.max_bytes,
            "evictions": self.evictions,
            "refusals": self.refusals,
            "bridges": self.bridges,
            "latches_stored": self.latches_stored,
            "epoch": self.epoch,
        }

    # -- internals -------------------------------------------------------------

    def _remove(self, conversation_id: str) -> bool:
        entry = self._entries.pop(conversation_id, None)
        if entry is None:
            return False
        self._bytes -= entry.nbytes
        return True

    def _evict_to_caps(self, keep: str) -> None:
        # ``keep`` (the latch just stored) fits alone, so evicting the others
        # oldest-first always terminates with both caps holding.
        while len(self._entries) > self.max_count or self._bytes > self.max_bytes:
            victim = next(iter(self._entries))
            if victim == keep:  # pragma: no cover - excluded by the refusal check
                break
            self._remove(victim)
            self.evictions += 1
