"""The fused CUDA kernels compile for NVIDIA GPUs, on a machine without one.

The kernels' arithmetic is tested in Triton's interpreter (test_fused_kernel.py,
test_fused_clamp_kernel.py), which runs code the compiler may reject, and a device
session is rare. Here each launch the engine makes (``engine.worker.fused``, recorded
with real tensors: arguments, constexprs, ``num_warps``) is compiled ahead of time to a
cubin for Ampere, Hopper and Blackwell by bench/cuda_kernels.py, as Triton's own AOT
tool compiles for a named target, and its resource use is read back from the cubin.

The bench runs in a child process: once Triton has been imported with
``TRITON_INTERPRET=1`` (the interpreter tests do that), its language is patched for
the interpreter and compiling fails in that process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "cuda_kernels.py"
ALL_KERNELS = ("add", "clamp", "clamp+residual", "add+clamp", "add+clamp+residual")


def _compile(tmp_path: Path, *args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, every run
    done = subprocess.run(
        [sys.executable, str(BENCH), "--json", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.fixture(scope="module")
def every_shape(tmp_path_factory) -> list[dict]:
    """Every kernel, fp32/fp16/bf16, 577 columns (a masked tail), for sm_80/90/100."""
    return _compile(
        tmp_path_factory.mktemp("shapes"),
        *("--kernels", "all", "--dtypes", "fp32,fp16,bf16", "--widths", "577"),
        *("--arch", "80,90,100"),
    )


def test_every_launch_shape_compiles_for_every_target(every_shape) -> None:
    built = {(r["kernel"], r["dtype"], r["arch"]) for r in every_shape}
    assert built == {
        (k, d, a) for k in ALL_KERNELS for d in ("fp32", "fp16", "bf16") for a in (80, 90, 100)
    }
    for r in every_shape:
        assert r["entry"] and r["target"], r  # the kernel's entry point, for sm_<arch>
        assert r["cubin"] > 0 and r["registers"] > 0, r
        assert r["compiled_warps"] == r["warps"], r  # what runs is what the launcher asked


def test_an_int32_index_compiles_too(tmp_path) -> None:
    """The tables' index is int64; the kernels also take int32 (fused.supports)."""
    found = _compile(
        tmp_path,
        *("--index", "i32", "--kernels", "add,add+clamp+residual", "--dtypes", "bf16"),
        *("--widths", "4096", "--arch", "90"),
    )
    assert [(r["kernel"], r["index"]) for r in found] == [
        ("add", "i32"),
        ("add+clamp+residual", "i32"),
    ]
    assert all(r["entry"] and r["cubin"] > 0 for r in found)


def test_rows_up_to_8192_wide_fit_in_registers(tmp_path) -> None:
    """No register spills at the widths of Llama-3-8B (4096) and -70B (8192) with the
    launcher's warps: a spill turns every clamp into local-memory traffic. (Rows wider
    than 8192 do spill: docs/benchmarks.md, bench/cuda_kernels.py.)"""
    found = _compile(
        tmp_path,
        *("--kernels", "add,add+clamp+residual,clamp+residual", "--dtypes", "bf16,fp32"),
        *("--widths", "576,4096,5120,8192", "--arch", "80,90"),
    )
    assert len(found) == 3 * 2 * 4 * 2
    spilled = [r for r in found if r["stack"] or r["local"]]
    assert spilled == []
    assert all(0 < r["registers"] <= 255 for r in found)


def test_a_launch_that_leaves_a_parameter_unbound_is_refused() -> None:
    """The signature is built from the recorded call: a launch that does not bind a
    kernel parameter is refused before anything is compiled."""
    spec = importlib.util.spec_from_file_location("bench_cuda_kernels", BENCH)
    assert spec is not None and spec.loader is not None
    ck = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = ck  # dataclasses look their module up
    spec.loader.exec_module(ck)
    (launch,) = ck.launches("add", 64, torch.float32)
    assert "BLOCK" in launch.kwargs
    launch.kwargs.pop("BLOCK")
    with pytest.raises(TypeError, match="does not bind every parameter"):
        ck.compile_launch(launch, 90)
