"""Persistent steering tables and the per-token slot index (no vLLM imports).

Layout
------
* one table per point of the residual stream: ``[num_slots, hidden]``; row 0 is
  always zero. ``post_block`` l and ``pre_attn`` l+1 are the same point (the
  ``hidden_states`` layer l returns is what layer l+1 receives), so when both layers
  are on this rank they share one table: ``tables[("pre_attn", l + 1)] is
  tables[("post_block", l)]`` and a slot's row there is the *sum* of the two
  vectors (summed in float32, rounded once). That leaves two op sites per layer plus
  the first layer's ``pre_attn`` (the op is launch-bound on GPU, see
  docs/steering-op.md). ``tables`` still answers every (hook, layer) site;
* one int64 index ``[max_num_batched_tokens]``: token t of the current step reads
  row ``index[t]`` of every table (0 = unsteered, also for padding tokens).

A *slot* holds one effective steering configuration (a payload digest) across all
sites. Requests with equal digests share a slot (refcounted); the rows are zeroed
and the slot returned when the last request using it finishes.

Slot sizing: ``max_num_seqs + 1`` slots. A step's batch holds at most
``max_num_seqs`` requests, hence at most that many distinct configurations, so
there is always a slot for every configuration in the batch. Requests that are not
in the batch (preempted, waiting to resume) keep their slot while slots are free;
if a new configuration finds none free, a slot whose configuration has no request
in the current batch is reclaimed and its owners are re-slotted (rows rewritten)
when they are scheduled again. Nothing is ever refused or silently dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from steergate.engine.payload import Payload
from steergate.engine.worker import op
from steergate.engine.worker.clamp import ClampTable
from steergate.shared.clamp import DEFAULT_MAX_CLAMPS_PER_SITE
from steergate.shared.positions import window

HOOKS: tuple[str, ...] = ("pre_attn", "post_attn", "post_block")
Site = tuple[str, int]


@dataclass
class _Slot:
    digest: str
    sites: tuple[Site, ...]  # owner sites whose row this slot wrote
    refs: int = 0
    clamp_sites: tuple[Site, ...] = ()  # owner sites whose clamp entries this slot wrote


@dataclass
class StepRequest:
    """What the index fill needs to know about one request in the step's batch."""

    req_id: str
    start: int  # first token of this request in the flattened batch
    end: int  # one past its last token
    first_pos: int  # position of its first scheduled token (num_computed_tokens)
    num_prompt_tokens: int


@dataclass
class SteeringTables:
    hidden_size: int
    layers: Sequence[int]
    num_slots: int
    max_tokens: int
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    #: Clamp entries per point (engine setting); 0: no clamp tables at all.
    max_clamps: int = DEFAULT_MAX_CLAMPS_PER_SITE
    tables: dict[Site, torch.Tensor] = field(init=False)
    clamps: dict[Site, ClampTable | None] = field(init=False)
    index: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        dev = torch.device(self.device)
        present = set(self.layers)
        # Every site -> the site whose table it uses (itself unless merged).
        self._owner: dict[Site, Site] = {}
        for layer in self.layers:
            for hook in HOOKS:
                merged = hook == "pre_attn" and layer - 1 in present
                self._owner[(hook, layer)] = ("post_block", layer - 1) if merged else (hook, layer)
        owned = {
            site: torch.zeros(self.num_slots, self.hidden_size, dtype=self.dtype, device=dev)
            for site in set(self._owner.values())
        }
        self.tables = {site: owned[owner] for site, owner in self._owner.items()}
        # Clamp tables follow the same points (a merged point applies the adds of
        # both names, then the clamps of both in request order: docs/steering-op.md).
        owned_clamps = {
            site: ClampTable(self.num_slots, self.max_clamps, self.hidden_size, dev)
            if self.max_clamps > 0 else None
            for site in owned
        }
        self.clamps = {site: owned_clamps[owner] for site, owner in self._owner.items()}
        self.index = torch.zeros(self.max_tokens, dtype=torch.int64, device=dev)
        # The index is filled on the host; on an accelerator a pinned staging copy
        # is copied over before the forward (non-blocking, like vLLM's own buffers).
        if dev.type == "cpu":
            self._host = self.index
        else:
            self._host = torch.zeros(self.max_tokens, dtype=torch.int64, pin_memory=True)
        self._host_np = self._host.numpy()
        # The staging buffer is reused every step. With async scheduling the host may
        # prepare step k+1 before the GPU has run step k's copy out of it, so the next
        # fill waits for that copy (vLLM's V1 runner already serialises its input
        # preparation this way; the V2 runner does not, it rotates buffers instead).
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None
        self._filled_hi = 0  # index[:_filled_hi] may be non-zero
        self._free: list[int] = list(range(self.num_slots - 1, 0, -1))
        self._slots: dict[int, _Slot] = {}
        self._by_digest: dict[str, int] = {}
        self._refs: dict[str, int] = {}  # live requests per digest (slot or not)
        self._payloads: dict[str, Payload] = {}  # req_id -> payload, steered requests only
        self._site_users: dict[Site, int] = dict.fromkeys(owned, 0)  # keyed by owner

    # ---- request lifetime -------------------------------------------------

    def add_request(self, req_id: str, payload: Payload) -> None:
        """Register a steered request (idempotent). Its slot is taken lazily, at
        its first step in a batch."""
        if req_id in self._payloads:
            return
        self._payloads[req_id] = payload
        self._refs[payload.digest] = self._refs.get(payload.digest, 0) + 1

    def remove_request(self, req_id: str) -> None:
        payload = self._payloads.pop(req_id, None)
        if payload is None:
            return
        left = self._refs[payload.digest] - 1
        if left:
            self._refs[payload.digest] = left
            return
        del self._refs[payload.digest]
        slot = self._by_digest.get(payload.digest)
        if slot is not None:
            self._release(slot)

    def is_steered(self, req_id: str) -> bool:
        return req_id in self._payloads

    @property
    def num_steered_requests(self) -> int:
        return len(self._payloads)

    @property
    def index_dirty(self) -> bool:
        """Whether the index still points tokens of the previous step at slots."""
        return self._filled_hi > 0

    @property
    def slots_in_use(self) -> int:
        return len(self._slots)

    def shares_table_with_previous_layer(self, layer: int) -> bool:
        """Whether ``pre_attn`` of ``layer`` is served by ``post_block`` of the layer
        before (so the wrapper calls the op there only)."""
        return self._owner[("pre_attn", layer)] != ("pre_attn", layer)

    # ---- per step ---------------------------------------------------------

    def fill(self, batch: Iterable[StepRequest], num_tokens: int) -> None:
        """Point every token of this step at its request's slot (or row 0), by phase.

        A token at position p is a prompt token iff p < num_prompt_tokens; phase
        ``prefill`` steers prompt tokens, ``decode`` the others, ``all`` both, and a
        ``steering.tokens`` selection the positions it names (steergate/shared/positions.py).
        Positions come from num_computed_tokens, so chunked prefill, prefix-cache hits
        and recomputation after preemption select the same positions."""
        steered = [r for r in batch if r.req_id in self._payloads]
        if not steered and self._filled_hi == 0:
            return  # fast path: nothing steered now or in the previous step
        if self._copied is not None:
            self._copied.synchronize()
        idx = self._host_np
        idx[: self._filled_hi] = 0
        in_batch = {self._payloads[r.req_id].digest for r in steered}
        hi = 0
        for r in steered:
            payload = self._payloads[r.req_id]
            slot = self._slot_for(payload, in_batch)
            # Position p of this request is token start + (p - first_pos); the
            # selection is two position intervals (steergate/shared/positions.py).
            shift = r.start - r.first_pos
            for lo_p, hi_p in window(payload.phase).spans(r.num_prompt_tokens):
                lo = max(r.start, lo_p + shift)
                up = r.end if hi_p is None else min(r.end, hi_p + shift)
                if up > lo:
                    idx[lo:up] = slot
                    hi = max(hi, up)
        copy_hi = max(hi, self._filled_hi)
        self._filled_hi = hi
        if self._host is not self.index and copy_hi:
            self.index[:copy_hi].copy_(self._host[:copy_hi], non_blocking=True)
            if self._copied is not None:
                self._copied.record()
        del num_tokens  # the index beyond the filled range is always zero

    # ---- slots ------------------------------------------------------------

    def _slot_for(self, payload: Payload, in_batch: set[str]) -> int:
        slot = self._by_digest.get(payload.digest)
        if slot is not None:
            return slot
        if not self._free:
            self._reclaim(in_batch)
        slot = self._free.pop()
        # Sites outside this rank's tables belong to another pipeline stage (the
        # API server has already checked every layer against the whole model).
        # Merged sites (post_block l + pre_attn l+1) are summed in float32 first and
        # rounded once, so one vector alone lands in the table exactly as before.
        rows: dict[Site, np.ndarray] = {}
        for site, vec in payload.sites.items():
            owner = self._owner.get(site)
            if owner is None:
                continue
            vec = np.asarray(vec, dtype=np.float32)
            rows[owner] = rows[owner] + vec if owner in rows else vec
        entries: dict[Site, list[tuple[np.ndarray, tuple[float, float, float]]]] = {}
        for c in payload.clamps:  # in the order they apply
            owner = self._owner.get(c.site)
            if owner is not None:
                entries.setdefault(owner, []).append((c.direction, c.bounds.floats()))
        self._slots[slot] = _Slot(payload.digest, tuple(rows), clamp_sites=tuple(entries))
        self._by_digest[payload.digest] = slot
        for owner, vec in rows.items():
            row = torch.as_tensor(np.ascontiguousarray(vec))
            self.tables[owner][slot].copy_(row.to(self.dtype))
            self._use_site(owner, +1)
        for owner, items in entries.items():
            table = self.clamps[owner]
            if table is None:
                raise RuntimeError("steergate: a clamp reached an engine without clamp tables")
            table.write(slot, items)
        return slot

    def _reclaim(self, in_batch: set[str]) -> None:
        for slot, info in self._slots.items():
            if info.digest not in in_batch:
                self._release(slot)
                return
        # Unreachable while num_slots > max requests per batch (see module doc).
        raise RuntimeError("steergate: no free steering slot; num_slots is too small")

    def _release(self, slot: int) -> None:
        info = self._slots.pop(slot)
        del self._by_digest[info.digest]
        for site in info.sites:
            self.tables[site][slot].zero_()
            self._use_site(site, -1)
        for site in info.clamp_sites:
            table = self.clamps[site]
            if table is not None:
                table.clear(slot)
        self._free.append(slot)

    def _use_site(self, site: Site, delta: int) -> None:
        before = self._site_users[site]
        after = before + delta
        self._site_users[site] = after
        if (before == 0) != (after == 0):
            op.mark_live(self.tables[site], after > 0)
