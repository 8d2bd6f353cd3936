"""The fused CUDA kernels compile for NVIDIA GPUs, on a machine without one.

The kernels' arithmetic is tested in Triton's interpreter (test_fused_kernel.py,
test_fused_clamp_kernel.py), which runs code the compiler may reject, and a device
session is rare. Here each launch the engine makes (``engine.worker.fused``, recorded
with real tensors: arguments, constexprs, ``num_warps``) is compiled ahead of time to a
cubin for Ampere, Hopper and Blackwell by bench/cuda_kernels.py, as Triton's own AOT
tool compiles for a named target, and its resource use is read back from the cubin.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "cuda_kernels.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_cuda_kernels", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


ck = _load_bench()
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(scope="module", autouse=True)
def fresh_triton_cache(tmp_path_factory):
    """Compile for real each run, never from a cache another run left."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-cache")))
    try:
        yield
    finally:
        mp.undo()


@pytest.mark.parametrize("arch", [80, 90, 100])
@pytest.mark.parametrize("kernel", ck.KERNELS)
def test_every_launch_shape_compiles_for_the_target(arch, kernel) -> None:
    """577 columns: a masked tail in the add kernel's last block and the clamp row."""
    for dtype in DTYPES:
        (launch,) = ck.launches(kernel, 577, dtype)
        compiled = ck.compile_launch(launch, arch)
        ptx = compiled.asm["ptx"]
        assert f".entry {launch.fn.__name__}(" in ptx
        assert f".target sm_{arch}" in ptx
        assert len(compiled.asm["cubin"]) > 0
        # What runs is what the launcher asked for.
        assert compiled.metadata.num_warps == launch.kwargs["num_warps"]


def test_an_int32_index_compiles_too() -> None:
    """The tables' index is int64; the kernels also take int32 (fused.supports)."""
    for kernel in ("add", "add+clamp+residual"):
        (launch,) = ck.launches(kernel, 4096, torch.bfloat16, index_dtype=torch.int32)
        assert launch.args[-4 if kernel == "add" else 5].dtype == torch.int32
        assert len(ck.compile_launch(launch, 90).asm["cubin"]) > 0


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("kernel", ["add", "add+clamp+residual", "clamp+residual"])
def test_rows_up_to_8192_wide_fit_in_registers(arch, kernel) -> None:
    """No register spills at the widths of Llama-3-8B (4096) and -70B (8192) with the
    launcher's warps: a spill turns every clamp into local-memory traffic. (Rows wider
    than 8192 do spill: docs/benchmarks.md, bench/cuda_kernels.py.)"""
    for dtype in (torch.bfloat16, torch.float32):
        for width in (576, 4096, 5120, 8192):
            (launch,) = ck.launches(kernel, width, dtype)
            used = ck.resources(ck.compile_launch(launch, arch))
            assert (used.stack, used.local) == (0, 0), (kernel, dtype, width, used)
            assert 0 < used.registers <= 255


def test_a_launch_that_leaves_a_parameter_unbound_is_refused() -> None:
    (launch,) = ck.launches("add", 64, torch.float32)
    launch.kwargs.pop("BLOCK")
    with pytest.raises(TypeError, match="does not bind every parameter"):
        ck.compile_launch(launch, 90)
