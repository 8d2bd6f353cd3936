"""The fused CUDA gather-add kernel's arithmetic, checked on CPU with Triton's
interpreter against the torch op, bit for bit (bfloat16 is checked on CUDA by
bench/steering_overhead_gpu.py: the interpreter's bfloat16 is not faithful)."""

from __future__ import annotations

import pytest
import torch

from steergate.engine.worker import fused, op


@pytest.fixture(scope="module")
def interpreted_kernel():
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")  # read when the kernel is defined
    try:
        yield fused.build_kernel()
    finally:
        mp.undo()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("width", [577, 1000, 1024, 2100])
def test_kernel_equals_the_torch_op_bit_for_bit(interpreted_kernel, dtype, width) -> None:
    gen = torch.Generator().manual_seed(width)
    num_slots, tokens = 9, 7
    table = torch.randn(num_slots, width, generator=gen).to(dtype)
    table[0] = 0  # row 0 is always zero in the real tables
    hidden = (torch.randn(tokens, width, generator=gen) * 3).to(dtype)
    # Row 0, the last slot, a repeated slot; the index is longer than the step.
    index = torch.tensor([0, num_slots - 1, 3, 0, 3, 1, num_slots - 1, 5, 2, 0])
    expected = hidden.clone()
    op.torch_steer(expected, table, index)
    got = hidden.clone()
    fused.gather_add(got, table, index, kernel=interpreted_kernel)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(got[0], hidden[0]) and torch.equal(got[3], hidden[3])  # slot 0: untouched
    assert not torch.equal(got[1], hidden[1])


def test_kernel_leaves_rows_past_the_step_and_strided_rows_alone(interpreted_kernel) -> None:
    """hidden may be a row-strided view (a slice of a wider buffer); only its own
    elements change."""
    table = torch.zeros(3, 5)
    table[2] = torch.arange(5, dtype=torch.float32) + 1
    buf = torch.zeros(4, 8)
    hidden = buf[:2, :5]
    assert fused.supports(hidden, table, torch.tensor([2, 2, 2, 2]))
    fused.gather_add(hidden, table, torch.tensor([2, 2, 2, 2]), kernel=interpreted_kernel)
    assert torch.equal(buf[:2, :5], table[2].expand(2, 5))
    assert not buf[:, 5:].any() and not buf[2:].any()


def test_layouts_the_kernel_cannot_take_fall_back_to_torch() -> None:
    table = torch.zeros(3, 8)
    index = torch.zeros(4, dtype=torch.int64)
    assert fused.supports(torch.zeros(4, 8), table, index)
    assert not fused.supports(torch.zeros(8, 4).t(), table, index)  # column-strided
    assert not fused.supports(torch.zeros(5, 8), table, index)  # more tokens than the index
    assert not fused.supports(torch.zeros(4, 8, dtype=torch.float64), table, index)
