"""Activation capture in the worker: the ``steergate::capture`` op and its step plan.

The decoder-layer wrappers (``layers.py``) call :func:`read` at each site right
after that site's steering, with the stream's parts: ``pre_attn`` l reads
``hidden + residual`` entering layer l (``hidden`` alone before layer 0),
``post_attn`` l the residual layer l returns (the stream after attention's residual
add, post_attn steering included), ``post_block`` l ``hidden + residual`` it returns.

Like ``steergate::steer`` the op is opaque to torch.compile, so compiled graphs call
its body on every forward; the body consults a plan the host filled for this step
(which flattened rows belong to which capturing request, positions already
de-duplicated) and copies those rows out. A step without capture finds an empty plan
and returns at once. The forward never branches on request contents: the plan is
host state, like the steering index. Under CUDA graphs the body would run only when
a graph is recorded, so the API server refuses capture on such an engine (501
``not_implemented``; see docs/steering-op.md) and the wrappers leave the op out of its
graphs (:data:`_CALLED`).

Only tensor-parallel rank 0 of each pipeline stage plans and writes (the stream is
replicated across TP ranks after each all-reduce).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from steergate.engine import capture_io
from steergate.engine.capture_io import CapturePayload
from steergate.engine.worker import library

OP_NAME = "steergate::capture"
HOOK_IDS = {"pre_attn": 0, "post_attn": 1, "post_block": 2}
_HOOKS = {v: k for k, v in HOOK_IDS.items()}

logger = logging.getLogger("vllm.steergate.capture")

Site = tuple[str, int]


def site_id(hook: str, layer: int) -> int:
    return layer * 3 + HOOK_IDS[hook]


@dataclass
class _Req:
    payload: CapturePayload
    sites: tuple[Site, ...]  # those on this rank's layers
    path: Path
    header: dict[str, Any]
    next_pos: int = 0  # positions below were captured already (preemption recomputes them)


@dataclass
class _Segment:
    req_id: str
    lo: int  # flattened rows [lo, hi) of this step
    hi: int
    first_pos: int


@dataclass
class CaptureState:
    """Per worker process (one runner). ``writer``: TP rank 0 of its stage."""

    layers: frozenset[int]
    hidden: int
    writer: bool
    rank: int = 0
    directory: Path = field(default_factory=capture_io.capture_dir)
    reqs: dict[str, _Req] = field(default_factory=dict)
    plan: list[_Segment] = field(default_factory=list)
    # this step's captured arrays: req_id -> site -> array (reduced within the step)
    out: dict[str, dict[Site, np.ndarray]] = field(default_factory=dict)

    def add_request(self, req_id: str, payload: CapturePayload) -> None:
        if not self.writer or req_id in self.reqs:
            return
        sites = tuple(s for s in payload.sites if s[1] in self.layers)
        if not sites:
            return
        capture_io.ensure_dir(self.directory)
        path = self.directory / capture_io.file_name(payload.cid, req_id, self.rank)
        header = {"req_id": req_id, "sites": [list(s) for s in sites], "hidden": self.hidden,
                  "reduce": payload.reduce}
        self.reqs[req_id] = _Req(payload, sites, path, header)

    def remove_request(self, req_id: str) -> None:
        self.reqs.pop(req_id, None)

    def plan_step(self, batch: list[tuple[str, int, int, int, int]]) -> None:
        """``batch``: (req_id, start row, end row, first position, prompt length) of
        each request in this step. Keeps, per capturing request, the rows whose
        positions match its ``tokens`` and were not captured before."""
        self.plan = []
        self.out = {}
        if not self.reqs:
            return
        for req_id, start, end, first_pos, prompt_len in batch:
            req = self.reqs.get(req_id)
            if req is None:
                continue
            lo_pos, hi_pos = max(first_pos, req.next_pos), first_pos + (end - start)
            if req.payload.tokens == "prompt":
                hi_pos = min(hi_pos, prompt_len)
            elif req.payload.tokens == "generated":
                lo_pos = max(lo_pos, prompt_len)
            if hi_pos > lo_pos:
                self.plan.append(
                    _Segment(req_id, start + lo_pos - first_pos, start + hi_pos - first_pos, lo_pos)
                )
            req.next_pos = max(req.next_pos, first_pos + (end - start))

    def read(self, sid: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        site = (_HOOKS[sid % 3], sid // 3)
        for seg in self.plan:
            req = self.reqs[seg.req_id]
            if site not in req.sites:
                continue
            rows = hidden[seg.lo : seg.hi]
            if residual is not None:
                rows = rows + residual[seg.lo : seg.hi]
            self.out.setdefault(seg.req_id, {})[site] = _reduce_step(rows, req.payload.reduce)

    def flush(self) -> None:
        """After the forward: append this step's record to each request's file."""
        if not self.plan:
            return
        for seg in self.plan:
            req = self.reqs.get(seg.req_id)
            got = self.out.get(seg.req_id, {})
            if req is None or len(got) != len(req.sites):
                continue
            capture_io.append_step(
                req.path, req.header, seg.first_pos, seg.hi - seg.lo, (got[s] for s in req.sites)
            )
        self.plan = []
        self.out = {}


def _reduce_step(rows: torch.Tensor, reduce: str) -> np.ndarray:
    if reduce == "mean":
        return rows.to(torch.float64).sum(dim=0).cpu().numpy().astype("<f8")
    if reduce == "last":
        return rows[-1].to(torch.float32).cpu().numpy().astype("<f4")
    return rows.to(torch.float32).cpu().numpy().astype("<f4")


#: The state of this process's runner (one per worker process), read by the op body.
_STATE: CaptureState | None = None


def install_state(state: CaptureState | None) -> None:
    global _STATE
    _STATE = state


def state() -> CaptureState | None:
    return _STATE


def capture(hidden: torch.Tensor, residual: torch.Tensor | None, site: int) -> None:
    # ``hidden`` is declared mutated (it is not) so that the compiled graph keeps
    # this call, and keeps it before the in-place ops that follow on the stream.
    st = _STATE
    if st is None or not st.plan:
        return
    st.read(site, hidden, residual)


def _capture_fake(hidden: torch.Tensor, residual: torch.Tensor | None, site: int) -> None:
    return None


library.define("capture", "(Tensor(a!) hidden, Tensor? residual, int site) -> ()", capture,
               _capture_fake)


#: Whether the layer wrappers call the op at all. False on an engine that cannot capture
#: (:func:`engine.capture_io.refusal`: it replays CUDA graphs), so its compiled graphs
#: hold no capture calls: each is a declared mutation of the stream, across which
#: Inductor does not fuse (docs/steering-op.md). Set at start-up, before the model is
#: traced; read when a graph is traced, never per request.
_CALLED = True


def call_op(on: bool) -> None:
    global _CALLED
    _CALLED = on


def read(hidden: torch.Tensor, residual: torch.Tensor | None, hook: str, layer: int) -> None:
    """Called by the layer wrappers after each site's steering."""
    if _CALLED:
        torch.ops.steergate.capture(hidden, residual, site_id(hook, layer))


def new_state(layers: Any, hidden: int) -> CaptureState:
    """This worker's capture state: it writes iff it is TP rank 0 of its stage."""
    tp_rank, pp_rank = 0, 0
    try:
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        tp_rank = int(get_tensor_model_parallel_rank())
        pp_rank = int(get_pp_group().rank_in_group)
    except (ImportError, AssertionError, AttributeError):  # no distributed state (tests)
        pass
    return CaptureState(frozenset(int(x) for x in layers), int(hidden), tp_rank == 0, pp_rank)


def payload_of(params: Any, req_id: str) -> CapturePayload | None:
    extra = getattr(params, "extra_args", None) or {}
    text = extra.get(capture_io.XARGS_KEY)
    if not text:
        return None
    try:
        return capture_io.decode_payload(text)
    except (ValueError, KeyError, TypeError) as exc:
        logger.error("steergate: request %s has an unreadable capture payload (%s)", req_id, exc)
        return None


def register(params: Any, req_id: str) -> None:
    st = _STATE
    if st is not None:
        payload = payload_of(params, req_id)
        if payload is not None:
            st.add_request(req_id, payload)


def unregister(req_id: str) -> None:
    if _STATE is not None:
        _STATE.remove_request(req_id)


_BYPASS = "_steergate_capture_bypass"


def bypass_problems() -> list[str]:
    """What :func:`install_prefix_cache_bypass` relies on in vLLM."""
    from vllm.v1.request import Request

    if not callable(getattr(Request, "get_skip_reading_prefix_cache", None)):
        return ["vllm.v1.request.Request has no get_skip_reading_prefix_cache"]
    return []


def install_prefix_cache_bypass() -> None:
    """Capture requests never read the prefix cache (engine core side): a cached
    position is never computed, so its rows could not be captured. vLLM itself does
    this for ``prompt_logprobs``; a capture request's own blocks are still written to
    the cache (the KV does not depend on capture), so others may reuse them."""
    from vllm.v1.request import Request

    if Request.__dict__.get(_BYPASS):
        return
    original = Request.get_skip_reading_prefix_cache

    def get_skip_reading_prefix_cache(self: Any) -> bool:
        extra = getattr(self.sampling_params, "extra_args", None) or {}
        return bool(extra.get(capture_io.XARGS_KEY)) or original(self)

    setattr(Request, "get_skip_reading_prefix_cache", get_skip_reading_prefix_cache)  # noqa: B010
    setattr(Request, _BYPASS, True)
