"""Steering under vLLM's Ray executor: tensor parallel 2, each rank a Ray actor.

What vLLM CPU 0.32 does with the stock backend. ``--distributed-executor-backend ray``
starts a local Ray instance in the engine core and then refuses:
``ValueError: current platform cpu does not support ray.``, raised by
``vllm/v1/executor/ray_utils.py:initialize_ray_cluster``. The Ray executors place
one worker per placement-group bundle of ``current_platform.ray_device_key`` ("GPU"
on CUDA/ROCm/XPU) and read each actor's device ids from
``ray.get_runtime_context().get_accelerator_ids()[ray_device_key]``; ``CpuPlatform``
declares no key (``""``), and no environment variable or flag sets one. Both the
V2 executor (the default) and the V1 one (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``)
go through that check. :func:`test_stock_ray_backend_is_refused_by_vllm_cpu` keeps
that fact under test: when a vLLM upgrade accepts Ray on CPU it fails, and the shim
below can go.

What is proved anyway:

* :func:`test_plugin_loads_in_a_plain_ray_worker`: a real local Ray runtime; in a
  fresh Ray worker process (no shim there), ``vllm.plugins.load_general_plugins()``
  finds steergate's entry point and ``register()`` takes effect: the
  ``steergate::steer`` op exists and steers, the model runners are patched and the
  compile cache is tagged.
* The whole engine under vLLM's own ``RayExecutorV2``, tensor parallel 2, each rank
  a ``RayWorkerProc`` actor in a Ray placement group. :class:`CpuRayExecutor` (passed
  as ``--distributed-executor-backend tests.engine.test_ray_executor.CpuRayExecutor``;
  vLLM accepts an Executor's import path there) supplies only what CPU lacks: the
  device key ``"CPU"`` (bundles ``{"CPU": 1}``), each actor's id (its rank, since Ray
  reports no accelerator ids for CPUs), and no extra actor resources (the bundle
  reserves the CPU). Everything else is vLLM's Ray code path: actors, placement group,
  gloo all-reduce, and the plugin loaded by vLLM's ``WorkerWrapperBase.init_worker``
  in each actor. Steered and unsteered logprobs match the float32 ``transformers``
  reference within 1e-3 and a latch set on turn 1 bridges to turn 2.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.ray]

ray = pytest.importorskip(
    "ray", reason="the ray package is not installed (pip install -e '.[ray]')"
)

from vllm.v1.executor.ray_executor_v2 import RayExecutorV2  # noqa: E402

from tests.engine.hf_reference import (  # noqa: E402
    check_latch_bridges_as_explicit_steering,
    check_steered_request_matches_reference,
)
from tests.harness import ROOT, EngineProcess  # noqa: E402

STOCK_REFUSAL = "ValueError: current platform cpu does not support ray."


# Both ranks are Ray actors on this host: bind their OpenMP threads to CPUs 0 and 1
# (vLLM CPU's default "auto" wants one NUMA node per rank; see test_tensor_parallel).
_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    "RAY_USAGE_STATS_ENABLED": "0",
    # Ray workers import this module (worker_process_setup_hook) from the checkout.
    "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
}


# --- the CPU shim for vLLM's Ray executor (runs in the engine core and in the actors) --


def _node_and_rank(self: Any) -> tuple[str, list[int]]:
    """``RayWorkerProc.get_node_and_physical_gpu_ids`` for CPU: Ray reports no
    accelerator ids for CPUs, so each actor's "device" is its rank."""
    return ray.get_runtime_context().get_node_id(), [int(self._init_kwargs["rank"])]


def teach_vllm_cpu_ray() -> None:
    """Give ``CpuPlatform`` a Ray device key, and Ray worker actors a device id."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.executor import ray_executor_v2

    CpuPlatform.ray_device_key = "CPU"
    ray_executor_v2.RayWorkerProc.get_node_and_physical_gpu_ids = _node_and_rank


class CpuRayExecutor(RayExecutorV2):
    """vLLM's ``RayExecutorV2`` with the CPU gaps filled (see the module docstring)."""

    def _init_executor(self) -> None:
        teach_vllm_cpu_ray()
        super()._init_executor()

    def _build_runtime_env(self) -> dict:
        env = super()._build_runtime_env()
        env["worker_process_setup_hook"] = f"{__name__}.teach_vllm_cpu_ray"
        return env

    @staticmethod
    def _get_actor_resource_kwargs() -> dict[str, Any]:
        # The placement-group bundle already reserves the CPU; Ray refuses "CPU" in
        # ``resources`` ("Use the 'num_cpus' ... keyword").
        return {}


# --- 1. the stock backend ------------------------------------------------------------


def test_stock_ray_backend_is_refused_by_vllm_cpu(tiny_model: Path) -> None:
    proc = EngineProcess(
        tiny_model,
        env=_ENV,
        extra_args=[
            "--dtype", "float32", "--tensor-parallel-size", "2",
            "--distributed-executor-backend", "ray",
        ],
    )
    try:
        proc.start(timeout=300)
    except RuntimeError:
        log = proc.log_tail(10**9)
    else:
        proc.stop()
        pytest.fail(
            "vLLM CPU now starts with --distributed-executor-backend ray: drop "
            "CpuRayExecutor and run the steering checks below on the stock backend"
        )
    assert "Started a local Ray instance" in log  # Ray itself comes up in the engine core
    assert STOCK_REFUSAL in log, log[-4000:]
    assert "in initialize_ray_cluster" in log


# --- 2. the plugin in a plain Ray worker ------------------------------------------------


def _register_in_worker() -> dict[str, Any]:
    """Runs in a Ray worker process: the state before and after vLLM loads plugins."""
    import sys

    import torch

    before = {
        "plugin_imported": "steergate.engine.plugin" in sys.modules,
        "has_op": hasattr(torch.ops.steergate, "steer"),
    }
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm.compilation import caching
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from steergate.engine import plugin as engine_plugin
    from steergate.engine.worker import op

    # The op itself, through the dispatcher: hidden += table[index].
    table = torch.zeros(3, 4)
    table[1] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    table[2] = torch.tensor([-1.0, 0.5, 0.0, 2.0])
    op.mark_live(table, True)
    hidden = torch.ones(3, 4)
    torch.ops.steergate.steer(hidden, table, torch.tensor([2, 0, 1, 1]))
    return {
        "pid": os.getpid(),
        "before": before,
        "done": engine_plugin._done,
        "cpu_runner_patched": bool(CPUModelRunner.__dict__.get("_steergate_patched")),
        "gpu_runner_patched": bool(GPUModelRunner.__dict__.get("_steergate_patched")),
        "compile_tagged": bool(
            getattr(caching.aot_compile_hash_factors, "_steergate_patched", False)
        ),
        "steered": hidden.tolist(),
    }


@pytest.fixture
def ray_runtime() -> Iterator[None]:
    ray.init(
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        # The task below is pickled by reference: the worker imports this module.
        runtime_env={"env_vars": {"PYTHONPATH": _ENV["PYTHONPATH"]}},
    )
    try:
        yield
    finally:
        ray.shutdown()


def test_plugin_loads_in_a_plain_ray_worker(ray_runtime: None) -> None:
    got = ray.get(ray.remote(_register_in_worker).remote(), timeout=300)
    assert got["pid"] != os.getpid()  # a separate Ray worker process
    assert got["before"] == {"plugin_imported": False, "has_op": False}
    assert got["done"] is True
    assert got["cpu_runner_patched"] and got["gpu_runner_patched"]
    assert got["compile_tagged"]
    assert got["steered"] == [[0.0, 1.5, 1.0, 3.0], [1.0] * 4, [2.0, 3.0, 4.0, 5.0]]


# --- 3. the engine under vLLM's Ray executor, TP 2 -----------------------------------


@pytest.fixture(scope="module")
def ray_engine(tiny_model: Path) -> Iterator[EngineProcess]:
    proc = EngineProcess(
        tiny_model,
        env=_ENV,
        extra_args=[
            "--dtype", "float32", "--tensor-parallel-size", "2",
            "--distributed-executor-backend", f"{__name__}.{CpuRayExecutor.__name__}",
        ],
    ).start()
    try:
        yield proc
    finally:
        shm = _shm_of_ray_processes(proc)
        proc.stop()
        for path in shm:  # gone with a clean shutdown; left by a killed actor
            path.unlink(missing_ok=True)


def _shm_of_ray_processes(engine: EngineProcess) -> set[Path]:
    """The ``/dev/shm`` files the engine core and its Ray actors map. The engine
    core's shutdown ``ray.kill``s the actors, so their message queues and vLLM CPU's
    TP shared-memory buffers are never unlinked (a vLLM leak, not a steergate one)."""
    log = engine.log_tail(10**9)
    pids = set(re.findall(r"\((?:RayWorkerProc|EngineCore) pid=(\d+)\)", log))
    found: set[Path] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                found.add(Path(fields[5].removesuffix(" (deleted)")))
    return found


def test_engine_runs_two_ranks_as_ray_actors_with_the_plugin(ray_engine: EngineProcess) -> None:
    log = ray_engine.log_tail(10**9)
    assert "Started a local Ray instance" in log
    assert "tensor_parallel_size=2" in log
    actor_lines = [ln for ln in log.splitlines() if "(RayWorkerProc pid=" in ln]
    for rank in (0, 1):
        assert any(f"world_size=2 rank={rank} " in ln for ln in actor_lines), rank
    # register() ran and wrapped the layers in both actors (two distinct processes).
    steering = {
        ln.split("(RayWorkerProc pid=", 1)[1].split(")", 1)[0]
        for ln in actor_lines
        if "steergate: steering LlamaForCausalLM (fused-residual convention): 4 layers x 3 hooks"
        in ln
    }
    assert len(steering) == 2, actor_lines[-20:]


def test_steered_request_under_ray_matches_reference(
    ray_engine: EngineProcess, tiny_model: Path
) -> None:
    check_steered_request_matches_reference(ray_engine, tiny_model)


def test_latch_bridges_under_ray(ray_engine: EngineProcess, tiny_model: Path) -> None:
    check_latch_bridges_as_explicit_steering(ray_engine, tiny_model, "ray-conv")
