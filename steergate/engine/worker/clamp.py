"""The ``steergate::clamp`` custom op and its per-slot tables (no vLLM imports).

At one point of the residual stream, token t at slot ``i = index[t]`` applies the
slot's K clamps one after the other (steergate/shared/clamp.py has the definition)::

    h = hidden[t] (+ residual[t])            # the stream, in float32
    for k in 0..K-1:
        c = h · dir[i, k]
        h += strength[i, k] · (clip(c, lo[i, k], hi[i, k]) − c) · dir[i, k]
    hidden[t] += h − h_before

Unused entries have a zero direction, bounds (−inf, +inf) and strength 0, so they
change nothing: every token runs the same K steps whatever the requests hold (no
branch on request contents; CUDA graphs record one body). Row 0 (unsteered tokens,
padding) is all unused entries.

vLLM's Llama layers carry the stream as ``hidden + residual`` (steergate/engine/worker/layers.py),
so the op reads both and writes the change into ``hidden`` only, which the next fused
add+norm sums into the stream exactly as it does the additive steering.

On CPU nothing is recorded, so the body skips a table no live slot uses (the same
liveness set as the add, :func:`engine.worker.op.mark_live`). On CUDA the op is one
Triton launch per point (:func:`engine.worker.fused.clamp`) whose programs for tokens
at slot 0 return at once; the eager torch body is ~5K + 4 kernels at every point,
which inside a CUDA graph cost about half the step (docs/benchmarks.md).

A point with both an add table and clamp tables calls ``steergate::steer_and_clamp``:
the add's body then the clamps', one op, and on CUDA one launch
(:func:`engine.worker.fused.steer_and_clamp`) instead of two.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from steergate.engine.worker import fused, library, op

OP_NAME = "steergate::clamp"
STEER_AND_CLAMP = "steergate::steer_and_clamp"
Floats = tuple[float, float, float]  # lo, hi, strength


def clamp(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    dirs: torch.Tensor,
    bounds: torch.Tensor,
    index: torch.Tensor,
) -> None:
    if hidden.device.type == "cpu":
        if dirs.data_ptr() not in op._LIVE_TABLES:
            return
    elif (
        hidden.is_cuda
        and fused.available()
        and fused.clamp_supports(hidden, residual, dirs, bounds, index)
    ):
        fused.clamp(hidden, residual, dirs, bounds, index)
        return
    torch_clamp(hidden, residual, dirs, bounds, index)


def torch_clamp(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    dirs: torch.Tensor,
    bounds: torch.Tensor,
    index: torch.Tensor,
) -> None:
    """The body: ``dirs [slots, K, H]`` float32, ``bounds [slots, K, 3]`` (lo, hi,
    strength) float32, ``index [>= n]`` int64."""
    n = hidden.shape[0]
    idx = index[:n]
    d = dirs.index_select(0, idx)  # [n, K, H]
    b = bounds.index_select(0, idx)  # [n, K, 3]
    stream = hidden.to(torch.float32)
    if residual is not None:
        stream = stream + residual.to(torch.float32)
    # K sequential steps on [n, H] (clamp k sees what clamps 0..k-1 left). Measured on
    # the 2-core CPU machines against a Gram-matrix form with batched matmuls: this is
    # the faster one (the matmuls lose to thread contention), and it is the definition.
    h = stream
    for k in range(d.shape[1]):
        dk = d[:, k]
        c = (h * dk).sum(-1)
        delta = b[:, k, 2] * (torch.clamp(c, b[:, k, 0], b[:, k, 1]) - c)
        h = h + delta[:, None] * dk
    hidden.add_((h - stream).to(hidden.dtype))


def _clamp_fake(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    dirs: torch.Tensor,
    bounds: torch.Tensor,
    index: torch.Tensor,
) -> None:
    return None


def steer_and_clamp(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    table: torch.Tensor,
    dirs: torch.Tensor,
    bounds: torch.Tensor,
    index: torch.Tensor,
) -> None:
    """``steergate::steer`` then ``steergate::clamp`` at one point, as one op."""
    if hidden.device.type == "cpu":
        if table.data_ptr() in op._LIVE_TABLES:
            op.torch_steer(hidden, table, index)
        if dirs.data_ptr() in op._LIVE_TABLES:
            torch_clamp(hidden, residual, dirs, bounds, index)
        return
    if (
        hidden.is_cuda
        and fused.available()
        and fused.point_supports(hidden, residual, table, dirs, bounds, index)
    ):
        fused.steer_and_clamp(hidden, residual, table, dirs, bounds, index)
        return
    op.torch_steer(hidden, table, index)
    torch_clamp(hidden, residual, dirs, bounds, index)


def _steer_and_clamp_fake(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    table: torch.Tensor,
    dirs: torch.Tensor,
    bounds: torch.Tensor,
    index: torch.Tensor,
) -> None:
    return None


library.define(
    "clamp",
    "(Tensor(a!) hidden, Tensor? residual, Tensor dirs, Tensor bounds, Tensor index) -> ()",
    clamp,
    _clamp_fake,
)
library.define(
    "steer_and_clamp",
    "(Tensor(a!) hidden, Tensor? residual, Tensor table, Tensor dirs, Tensor bounds, "
    "Tensor index) -> ()",
    steer_and_clamp,
    _steer_and_clamp_fake,
)


def apply(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    table: ClampTable | None,
    index: torch.Tensor,
    add: torch.Tensor | None = None,
) -> None:
    """One point of the stream: its add (``add``, when given) then its clamps
    (``table``, when given), in place on ``hidden``; ``residual`` completes the stream
    where it is carried in two tensors. One op, whichever of the two exist."""
    if table is None:
        if add is not None:
            op.apply(hidden, add, index)
        return
    # With STEERGATE_CUDA_COMPILED_STEER=inductor, a graph compiled on CUDA traces the
    # bodies for Inductor to schedule with their neighbours (op.traced_body).
    if op.traced_body(hidden):
        if add is not None:
            op.torch_steer(hidden, add, index)
        torch_clamp(hidden, residual, table.dirs, table.bounds, index)
    elif add is None:
        torch.ops.steergate.clamp(hidden, residual, table.dirs, table.bounds, index)
    else:
        torch.ops.steergate.steer_and_clamp(
            hidden, residual, add, table.dirs, table.bounds, index
        )


class ClampTable:
    """K clamp entries per slot at one point of the stream."""

    def __init__(self, num_slots: int, k: int, hidden: int, device: torch.device) -> None:
        self.k = k
        self.dirs = torch.zeros(num_slots, k, hidden, dtype=torch.float32, device=device)
        self.bounds = torch.zeros(num_slots, k, 3, dtype=torch.float32, device=device)
        self.bounds[:, :, 0] = -math.inf
        self.bounds[:, :, 1] = math.inf
        self.users = 0  # slots with at least one entry here

    def write(self, slot: int, entries: list[tuple[np.ndarray, Floats]]) -> None:
        if len(entries) > self.k:  # the API server checked the cap; a mismatch is a bug
            raise RuntimeError(
                f"steergate: {len(entries)} clamps at one point; the cap is {self.k}"
            )
        for k, (direction, floats) in enumerate(entries):
            self.dirs[slot, k].copy_(torch.as_tensor(np.ascontiguousarray(direction)))
            self.bounds[slot, k].copy_(torch.tensor(floats, dtype=torch.float32))
        self._use(+1)

    def clear(self, slot: int) -> None:
        self.dirs[slot].zero_()
        self.bounds[slot, :, 0] = -math.inf
        self.bounds[slot, :, 1] = math.inf
        self.bounds[slot, :, 2] = 0.0
        self._use(-1)

    def _use(self, delta: int) -> None:
        before = self.users
        self.users += delta
        if (before == 0) != (self.users == 0):
            op.mark_live(self.dirs, self.users > 0)
