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
        hidden_ptr, table_ptr, index_ptr, hidden_stride, table_stride, width,
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
        hidden, table, index, hidden.stride(0), table.stride(0), width,
        BLOCK=BLOCK, num_warps=NUM_WARPS,
    )
