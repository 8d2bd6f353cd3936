"""One-launch gather-add for the steering op on CUDA: ``hidden[t] += table[index[t]]``.

Why: inside a CUDA graph the cost of the op is launches, not bytes. The torch body
(``index_select`` then ``add_``) is two kernels per site; this is one, and a token
whose slot is 0 (unsteered, or padding) returns before touching ``hidden`` or the
table. The arithmetic is the torch op's exactly: the row is cast to ``hidden``'s dtype,
then both are added in float32 and rounded once to ``hidden``'s dtype, which is what
torch's ``add_`` does for float16/bfloat16 (and a plain float32 add for float32).

Triton is imported lazily: CPU-only installs never load it, and a test can build the
kernel under ``TRITON_INTERPRET=1`` (the interpreter is chosen when the kernel is
defined, so :func:`build_kernel` defines a fresh one on each call).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# Columns per program. 1024 fp16/bf16 elements per program keeps a 4096-wide row to
# four programs (more parallelism for a single decode token) with 4 warps each.
BLOCK = 1024
NUM_WARPS = 4
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def build_kernel() -> Any:
    """Define the Triton kernel (a new object per call; see the module doc)."""
    import triton
    import triton.language as tl

    @triton.jit
    def steer_gather_add(
        hidden_ptr,
        table_ptr,
        index_ptr,
        hidden_stride,
        table_stride,
        width,
        BLOCK: tl.constexpr,
    ):
        token = tl.program_id(0)
        slot = tl.load(index_ptr + token)
        if slot == 0:
            return  # unsteered token or padding: row 0 is zero, nothing to add
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        h_ptrs = hidden_ptr + token.to(tl.int64) * hidden_stride + cols
        h = tl.load(h_ptrs, mask=mask)
        row = tl.load(table_ptr + slot * table_stride + cols, mask=mask)
        total = h.to(tl.float32) + row.to(h.dtype).to(tl.float32)
        tl.store(h_ptrs, total.to(h.dtype), mask=mask)

    return steer_gather_add


@functools.cache
def _kernel() -> Any:
    return build_kernel()


@functools.cache
def available() -> bool:
    """Whether Triton can be imported here (vLLM's CUDA stack ships it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def supports(hidden: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> bool:
    """Layouts the kernel handles; anything else takes the torch path."""
    return (
        hidden.dim() == 2
        and table.dim() == 2
        and hidden.dtype in DTYPES
        and table.dtype in DTYPES
        and index.dtype in (torch.int64, torch.int32)
        and hidden.shape[1] == table.shape[1]
        and hidden.stride(1) == 1
        and table.stride(1) == 1
        and index.is_contiguous()
        and hidden.shape[0] <= index.shape[0]
    )


def gather_add(
    hidden: torch.Tensor, table: torch.Tensor, index: torch.Tensor, kernel: Any = None
) -> None:
    """``hidden[t] += table[index[t]]`` for t < hidden.shape[0], in place, one launch."""
    n, width = hidden.shape
    if n == 0:
        return
    grid = (n, -(-width // BLOCK))
    (kernel or _kernel())[grid](
        hidden,
        table,
        index,
        hidden.stride(0),
        table.stride(0),
        width,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )


# ---- directional clamps: one launch per point ------------------------------------
#
# ``engine.worker.clamp.torch_clamp`` in one program per token row: the row (plus the
# residual, where the stream is carried in two tensors) in float32, the slot's K
# clamps in order, the change written into ``hidden``. A token at slot 0 returns at
# once (row 0 holds only unused entries, which change nothing), so a step without
# clamps costs one launch per point, not the eager body's ~5K + 4 kernels. The dot
# products are Triton's block reductions, so the result equals the torch body to
# float32 rounding (not bit for bit: the summation order differs).
#
# A point that has both an add table and clamp tables (the default: 4 clamps per
# point) runs both in this one launch (``HAS_ADD``): the row is added first and
# rounded to ``hidden``'s dtype exactly as :func:`gather_add` does, then clamped, so
# the result is bit for bit that of the two launches in sequence, at half the
# launches. Inside a CUDA graph the launches are the cost (docs/benchmarks.md).

CLAMP_MAX_WIDTH = 16384  # one program holds a whole row


def build_clamp_kernel() -> Any:
    """Define the Triton clamp kernel (a new object per call, as :func:`build_kernel`)."""
    import triton
    import triton.language as tl

    @triton.jit
    def steer_clamp(
        hidden_ptr,
        residual_ptr,
        table_ptr,
        dirs_ptr,
        bounds_ptr,
        index_ptr,
        hidden_stride,
        residual_stride,
        table_stride,
        width,
        K: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        HAS_ADD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        token = tl.program_id(0)
        slot = tl.load(index_ptr + token).to(tl.int64)
        if slot == 0:
            return  # unsteered token or padding: nothing to clamp
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        h_ptrs = hidden_ptr + token.to(tl.int64) * hidden_stride + cols
        h_raw = tl.load(h_ptrs, mask=mask, other=0.0)
        if HAS_ADD:  # the point's add first, rounded once to hidden's dtype (gather_add)
            row = tl.load(table_ptr + slot * table_stride + cols, mask=mask, other=0.0)
            h_raw = (h_raw.to(tl.float32) + row.to(h_raw.dtype).to(tl.float32)).to(h_raw.dtype)
        stream = h_raw.to(tl.float32)
        if HAS_RESIDUAL:
            r_ptrs = residual_ptr + token.to(tl.int64) * residual_stride + cols
            stream = stream + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        x = stream
        for k in tl.static_range(K):
            d = tl.load(dirs_ptr + (slot * K + k) * width + cols, mask=mask, other=0.0)
            c = tl.sum(x * d, axis=0)
            lo = tl.load(bounds_ptr + (slot * K + k) * 3)
            hi = tl.load(bounds_ptr + (slot * K + k) * 3 + 1)
            strength = tl.load(bounds_ptr + (slot * K + k) * 3 + 2)
            x = x + (strength * (tl.minimum(tl.maximum(c, lo), hi) - c)) * d
        # torch: hidden.add_((x - stream).to(hidden.dtype)), summed in float32, rounded once
        change = (x - stream).to(h_raw.dtype).to(tl.float32)
        tl.store(h_ptrs, (h_raw.to(tl.float32) + change).to(h_raw.dtype), mask=mask)

    return steer_clamp


@functools.cache
def _clamp_kernel() -> Any:
    return build_clamp_kernel()


def clamp_supports(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    dirs: torch.Tensor,
    bounds: torch.Tensor,
    index: torch.Tensor,
) -> bool:
    """Layouts the clamp kernel handles; anything else takes the torch body."""
    return (
        hidden.dim() == 2
        and hidden.dtype in DTYPES
        and hidden.stride(1) == 1
        and 0 < hidden.shape[1] <= CLAMP_MAX_WIDTH
        and (
            residual is None
            or (
                residual.shape == hidden.shape
                and residual.stride(1) == 1
                and residual.dtype in DTYPES
            )
        )
        and dirs.dim() == 3
        and dirs.dtype == torch.float32
        and dirs.is_contiguous()
        and dirs.shape[2] == hidden.shape[1]
        and bounds.dtype == torch.float32
        and bounds.is_contiguous()
        and tuple(bounds.shape) == (dirs.shape[0], dirs.shape[1], 3)
        and index.dtype in (torch.int64, torch.int32)
        and index.is_contiguous()
        and hidden.shape[0] <= index.shape[0]
    )


def clamp(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    dirs: torch.Tensor,
    bounds: torch.Tensor,
    index: torch.Tensor,
    kernel: Any = None,
) -> None:
    """``torch_clamp`` in one launch: K clamps per token at its slot, in place."""
    _launch_clamp(hidden, residual, None, dirs, bounds, index, kernel)


def steer_and_clamp(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    table: torch.Tensor,
    dirs: torch.Tensor,
    bounds: torch.Tensor,
    index: torch.Tensor,
    kernel: Any = None,
) -> None:
    """:func:`gather_add` then :func:`clamp` at one point, in one launch, in place."""
    if dirs.shape[1] == 0:
        gather_add(hidden, table, index)  # no clamp entries (never built: cap 0 has no tables)
        return
    _launch_clamp(hidden, residual, table, dirs, bounds, index, kernel)


def point_supports(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    table: torch.Tensor,
    dirs: torch.Tensor,
    bounds: torch.Tensor,
    index: torch.Tensor,
) -> bool:
    """Layouts :func:`steer_and_clamp` handles: those both kernels take."""
    return supports(hidden, table, index) and clamp_supports(
        hidden, residual, dirs, bounds, index
    )


def _launch_clamp(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    table: torch.Tensor | None,
    dirs: torch.Tensor,
    bounds: torch.Tensor,
    index: torch.Tensor,
    kernel: Any,
) -> None:
    n, width = hidden.shape
    if n == 0 or dirs.shape[1] == 0:
        return
    block = 1 << (width - 1).bit_length()
    (kernel or _clamp_kernel())[(n,)](
        hidden,
        hidden if residual is None else residual,
        hidden if table is None else table,
        dirs,
        bounds,
        index,
        hidden.stride(0),
        0 if residual is None else residual.stride(0),
        0 if table is None else table.stride(0),
        width,
        K=dirs.shape[1],
        HAS_RESIDUAL=residual is not None,
        HAS_ADD=table is not None,
        BLOCK=block,
        num_warps=8 if block >= 4096 else 4,
    )
