"""The engine's fused CUDA kernels, compiled ahead of time for NVIDIA GPUs on any machine.

No GPU is needed: Triton compiles a kernel for a named target (``GPUTarget("cuda", 90,
32)``) down to a cubin with the ``ptxas`` its wheel carries, as its own AOT tool
(``triton/tools/compile.py``) does. What is compiled is what the engine would launch:
each launch of ``steergate/engine/worker/fused.py`` is made with real tensors and a
recording kernel, and its arguments, constexprs and ``num_warps`` are turned into the
signature Triton's JIT would specialise (pointer dtypes, 32/64-bit integers, the
divisible-by-16 hint). Triton's interpreter (the CPU tests of the arithmetic) accepts
code the compiler rejects; this shows the compiler takes every launch shape.

Printed per kernel, dtype, row width and target: registers per thread, stack bytes per
thread (register spills: 0 means the row fits in registers) and the cubin's size, read
from the cubin with the ``cuobjdump`` Triton's wheel carries.

    python bench/cuda_kernels.py                  # about 20 s on 2 CPU cores
    python bench/cuda_kernels.py --arch 90 --widths 4096,8192
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from steergate.engine.worker import fused

# torch dtype -> Triton's pointer element type, as its JIT names them.
TRITON_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
}
ARCHS = (80, 89, 90, 100)  # Ampere, Ada, Hopper, Blackwell
WIDTHS = (576, 2048, 4096, 5120, 8192, 16384)  # SmolLM2, ..., Llama-3-8B, 13B, 70B, 405B
CLAMPS = 4  # the engine's default clamp cap per point


@dataclass
class Launch:
    """One launch as the engine would make it: the kernel, its grid and arguments."""

    fn: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


class _Recorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kw)`` records the call."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.launches: list[Launch] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def record(*args: Any, **kwargs: Any) -> None:
            self.launches.append(Launch(self.fn, tuple(grid), args, kwargs))

        return record


def _tensors(
    width: int, dtype: torch.dtype, index_dtype: torch.dtype, tokens: int = 4, slots: int = 5
) -> dict[str, torch.Tensor]:
    return {
        "hidden": torch.zeros(tokens, width, dtype=dtype),
        "residual": torch.zeros(tokens, width, dtype=dtype),
        "table": torch.zeros(slots, width, dtype=dtype),
        "dirs": torch.zeros(slots, CLAMPS, width),
        "bounds": torch.zeros(slots, CLAMPS, 3),
        "index": torch.zeros(tokens + 2, dtype=index_dtype),
    }


def launches(
    kernel: str, width: int, dtype: torch.dtype, index_dtype: torch.dtype = torch.int64
) -> list[Launch]:
    """The launches ``fused`` makes for one kind of point.

    ``kernel``: ``add`` (``gather_add``), ``clamp`` / ``clamp+residual`` (``clamp``,
    the stream in one tensor or two), ``add+clamp`` / ``add+clamp+residual``
    (``steer_and_clamp``: a point with an add table and clamp tables)."""
    t = _tensors(width, dtype, index_dtype)
    residual = t["residual"] if kernel.endswith("+residual") else None
    if kernel == "add":
        rec = _Recorder(fused.build_kernel())
        assert fused.supports(t["hidden"], t["table"], t["index"])
        fused.gather_add(t["hidden"], t["table"], t["index"], kernel=rec)
    elif kernel.startswith("clamp"):
        rec = _Recorder(fused.build_clamp_kernel())
        assert fused.clamp_supports(t["hidden"], residual, t["dirs"], t["bounds"], t["index"])
        fused.clamp(t["hidden"], residual, t["dirs"], t["bounds"], t["index"], kernel=rec)
    elif kernel.startswith("add+clamp"):
        rec = _Recorder(fused.build_clamp_kernel())
        assert fused.point_supports(
            t["hidden"], residual, t["table"], t["dirs"], t["bounds"], t["index"]
        )
        fused.steer_and_clamp(
            t["hidden"], residual, t["table"], t["dirs"], t["bounds"], t["index"], kernel=rec
        )
    else:
        raise ValueError(f"unknown kernel {kernel!r}")
    return rec.launches


KERNELS = ("add", "clamp", "clamp+residual", "add+clamp", "add+clamp+residual")


def _specialise(value: Any) -> tuple[str, bool]:
    """(Triton type, divisible by 16) for one runtime argument, as the JIT sees it."""
    if isinstance(value, torch.Tensor):
        return "*" + TRITON_TYPES[value.dtype], value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return "u1", False  # never specialised
    if isinstance(value, int):
        kind = "i32" if -(2**31) <= value < 2**31 else "i64"
        return kind, value % 16 == 0
    raise TypeError(f"no Triton type for {type(value).__name__}")


def compile_launch(launch: Launch, arch: int) -> Any:
    """Compile ``launch`` for ``sm_<arch>`` (no GPU needed); returns Triton's kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(launch.fn.arg_names)
    kwargs = dict(launch.kwargs)
    num_warps = kwargs.pop("num_warps", 4)
    runtime = names[: len(launch.args)]
    if set(names) != set(runtime) | set(kwargs):
        raise TypeError(f"launch does not bind every parameter of {launch.fn.__name__}: {names}")
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, (name, value) in enumerate(zip(runtime, launch.args, strict=True)):
        kind, divisible = _specialise(value)
        if kind in ("i32", "i64") and value == 1:  # the JIT specialises 1 as a constant
            signature[name], constexprs[name] = "constexpr", 1
            continue
        signature[name] = kind
        if divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name, value in kwargs.items():
        signature[name], constexprs[name] = "constexpr", value
    src = ASTSource(fn=launch.fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


@dataclass(frozen=True)
class Resources:
    registers: int  # per thread
    stack: int  # bytes per thread: register spills (and local arrays)
    local: int
    shared: int  # bytes per program
    cubin: int  # bytes


def resources(compiled: Any) -> Resources:
    """Read the kernel's resource usage from its cubin with Triton's ``cuobjdump``."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    cubin = compiled.asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [tool, "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if found is None:
        raise RuntimeError(f"no resource line in cuobjdump's output: {out!r}")
    reg, stack, shared, local = (int(g) for g in found.groups())
    return Resources(reg, stack, local, shared, len(cubin))


def measure(
    kernel: str, dtype: torch.dtype, width: int, arch: int, index_dtype: torch.dtype = torch.int64
) -> dict[str, Any]:
    """Compile one launch for ``sm_<arch>``; what the cubin uses and what it was built as."""
    (launch,) = launches(kernel, width, dtype, index_dtype)
    compiled = compile_launch(launch, arch)
    ptx = compiled.asm["ptx"]
    return {
        "kernel": kernel,
        "dtype": TRITON_TYPES[dtype],
        "index": TRITON_TYPES[index_dtype],
        "width": width,
        "arch": arch,
        "warps": launch.kwargs.get("num_warps", 4),  # what the launcher asked for
        "compiled_warps": compiled.metadata.num_warps,
        "entry": f".entry {launch.fn.__name__}(" in ptx,
        "target": f".target sm_{arch}" in ptx,
        **asdict(resources(compiled)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default=",".join(map(str, ARCHS)), help="sm numbers")
    parser.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    parser.add_argument(
        "--kernels", default="add,add+clamp+residual,clamp+residual", help="or 'all'"
    )
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument(
        "--index", default="i64", help="the index's dtype: i64 (the tables') or i32"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per launch")
    args = parser.parse_args(argv)
    import triton

    archs = [int(a) for a in args.arch.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    by_name = {v: k for k, v in TRITON_TYPES.items()}
    dtypes = [by_name[d] for d in args.dtypes.split(",")]
    index_dtype = by_name[args.index]
    kernels = KERNELS if args.kernels == "all" else tuple(args.kernels.split(","))
    if not args.json:
        print(f"triton {triton.__version__}, torch {torch.__version__}; no GPU used")
        print("registers / stack bytes per thread (stack > 0: spills), per kernel launch shape\n")
        print("| kernel | dtype | width | warps | " + " | ".join(f"sm_{a}" for a in archs) + " |")
        print("|" + "---|" * (4 + len(archs)))
    t0 = time.perf_counter()
    for kernel in kernels:
        for dtype in dtypes:
            for width in widths:
                found = [measure(kernel, dtype, width, arch, index_dtype) for arch in archs]
                if args.json:
                    for record in found:
                        print(json.dumps(record), flush=True)
                    continue
                cells = " | ".join(f"{r['registers']} / {r['stack']}" for r in found)
                print(
                    f"| {kernel} | {TRITON_TYPES[dtype]} | {width} | {found[0]['warps']} | "
                    f"{cells} |"
                )
    if not args.json:
        print(f"\ncompiled in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
