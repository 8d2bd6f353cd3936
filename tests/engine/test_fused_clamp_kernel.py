"""The fused CUDA clamp kernel's arithmetic, checked on CPU with Triton's interpreter
against the torch body (steergate/engine/worker/clamp.py ``torch_clamp``): equal to float32
rounding (its dot products sum in another order), rows at slot 0 untouched bit for bit.

The kernel runs in a child process: Triton's interpreter only interprets the language's
own jitted helpers (``tl.sum``) when Triton is first imported with ``TRITON_INTERPRET=1``,
and in a long test session something (Inductor) has usually imported it already.

The same kernel with the point's add folded in (``fused.steer_and_clamp``, one launch
where the add and the clamps were two) equals the add kernel followed by the clamp
kernel bit for bit, and the torch bodies in that order to float32 rounding."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from steergate.engine.worker import clamp as clamp_op
from steergate.engine.worker import fused, op

ROOT = Path(__file__).resolve().parents[2]
CASES = [
    (dtype, width, with_residual)
    for dtype in ("float32", "float16")
    for width in (64, 577, 1000)
    for with_residual in (False, True)
]
NUM_SLOTS, K, TOKENS = 6, 4, 7
# Row 0, the last slot, a repeated slot; the index is longer than the step.
INDEX = [0, NUM_SLOTS - 1, 3, 0, 3, 1, 2, 5, 0]


def case(dtype: str, width: int, with_residual: bool):
    """The inputs of one case, the same in this process and in the child."""
    gen = torch.Generator().manual_seed(width + with_residual)
    table = clamp_op.ClampTable(NUM_SLOTS, K, width, torch.device("cpu"))
    # an ablation, a two-sided half-strength clamp, one-sided bounds each way
    kinds = [(0.0, 0.0, 1.0), (-0.3, 0.4, 0.5), (-math.inf, -0.2, 1.0), (0.1, math.inf, 0.8)]
    for slot in range(1, NUM_SLOTS):
        dirs = torch.randn(K, width, generator=gen)
        table.dirs[slot] = dirs / dirs.norm(dim=-1, keepdim=True)
        for j in range(K):
            table.bounds[slot, j] = torch.tensor(kinds[(slot + j) % len(kinds)])
        if slot % 3 == 0:  # a slot using fewer than K entries
            table.dirs[slot, -1] = 0
            table.bounds[slot, -1] = torch.tensor([-math.inf, math.inf, 0.0])
    dt = getattr(torch, dtype)
    hidden = (torch.randn(TOKENS, width, generator=gen) * 2).to(dt)
    residual = torch.randn(TOKENS, width, generator=gen).to(dt) if with_residual else None
    return table, hidden, residual, torch.tensor(INDEX)


def add_table(dtype: str, width: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + width)
    table = torch.randn(NUM_SLOTS, width, generator=gen).to(getattr(torch, dtype))
    table[0] = 0  # row 0 is always zero in the real tables
    return table


def ablation_case():
    gen = torch.Generator().manual_seed(7)
    width = 300
    table = clamp_op.ClampTable(2, 1, width, torch.device("cpu"))
    d = torch.randn(width, generator=gen)
    table.dirs[1, 0] = d / d.norm()
    table.bounds[1, 0] = torch.tensor([0.0, 0.0, 1.0])
    hidden, residual = torch.randn(3, width, generator=gen), torch.randn(3, width, generator=gen)
    return table, hidden, residual, torch.tensor([1, 1, 1])


_CHILD = """
import sys, torch
from steergate.engine.worker import fused
from tests.engine.test_fused_clamp_kernel import CASES, ablation_case, add_table, case
kernel = fused.build_clamp_kernel()
add_kernel = fused.build_kernel()
out = {}
for key in CASES:
    table, hidden, residual, index = case(*key)
    add = add_table(key[0], key[1])
    merged, sequence = hidden.clone(), hidden.clone()
    assert fused.clamp_supports(hidden, residual, table.dirs, table.bounds, index)
    assert fused.point_supports(hidden, residual, add, table.dirs, table.bounds, index)
    fused.clamp(hidden, residual, table.dirs, table.bounds, index, kernel=kernel)
    out[key] = hidden
    fused.steer_and_clamp(merged, residual, add, table.dirs, table.bounds, index, kernel=kernel)
    fused.gather_add(sequence, add, index, kernel=add_kernel)
    fused.clamp(sequence, residual, table.dirs, table.bounds, index, kernel=kernel)
    out[("merged",) + key] = merged
    out[("sequence",) + key] = sequence
table, hidden, residual, index = ablation_case()
fused.clamp(hidden, residual, table.dirs, table.bounds, index, kernel=kernel)
out["ablation"] = hidden
torch.save(out, sys.argv[1])
"""


@pytest.fixture(scope="module")
def kernel_out(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("clamp-kernel") / "out.pt"
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(path)


@pytest.mark.parametrize(
    "key", CASES, ids=[f"{d}-{w}-{'res' if r else 'nores'}" for d, w, r in CASES]
)
def test_clamp_kernel_equals_the_torch_body(kernel_out, key) -> None:
    table, hidden, residual, index = case(*key)
    expected = hidden.clone()
    clamp_op.torch_clamp(expected, residual, table.dirs, table.bounds, index)
    got = kernel_out[key]
    assert torch.equal(got[0], hidden[0]) and torch.equal(got[3], hidden[3])  # slot 0
    assert not torch.equal(got[1], hidden[1])  # the clamps changed a steered row
    tol = 1e-5 if key[0] == "float32" else 2e-3
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "key", CASES, ids=[f"{d}-{w}-{'res' if r else 'nores'}" for d, w, r in CASES]
)
def test_add_and_clamps_in_one_launch_equal_the_two_launches_bit_for_bit(kernel_out, key):
    table, hidden, residual, index = case(*key)
    merged, sequence = kernel_out[("merged",) + key], kernel_out[("sequence",) + key]
    assert torch.equal(merged.view(torch.uint8), sequence.view(torch.uint8))
    assert torch.equal(merged[0], hidden[0]) and torch.equal(merged[3], hidden[3])  # slot 0
    # and the torch bodies in the same order, to float32 rounding
    add = add_table(*key[:2])
    expected = hidden.clone()
    op.torch_steer(expected, add, index)
    clamp_op.torch_clamp(expected, residual, table.dirs, table.bounds, index)
    assert not torch.equal(merged[1], kernel_out[key][1])  # the add is in it
    tol = 1e-5 if key[0] == "float32" else 2e-3
    torch.testing.assert_close(merged.float(), expected.float(), rtol=tol, atol=tol)


def test_ablation_by_the_kernel_leaves_the_component_zero(kernel_out) -> None:
    table, _, residual, _ = ablation_case()
    component = ((kernel_out["ablation"] + residual) @ table.dirs[1, 0]).abs().max().item()
    assert component < 1e-5


def test_layouts_the_clamp_kernel_cannot_take_fall_back_to_torch() -> None:
    table = clamp_op.ClampTable(3, 2, 8, torch.device("cpu"))
    index = torch.zeros(4, dtype=torch.int64)
    ok = torch.zeros(4, 8)
    assert fused.clamp_supports(ok, None, table.dirs, table.bounds, index)
    assert not fused.clamp_supports(torch.zeros(8, 4).t(), None, table.dirs, table.bounds, index)
    assert not fused.clamp_supports(torch.zeros(5, 8), None, table.dirs, table.bounds, index)
    assert not fused.clamp_supports(ok, torch.zeros(4, 7), table.dirs, table.bounds, index)
    assert not fused.clamp_supports(ok.double(), None, table.dirs, table.bounds, index)
