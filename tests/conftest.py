from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import (
    CLUSTER,
    REAL_ENGINE_ARGS,
    REAL_ENGINE_ENV,
    EngineProcess,
    RedisProcess,
    real_model_dir,
    tiny_model_dir,
)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisProcess]:
    """A real redis-server on a free loopback port, for the whole session; with
    ``STEERGATE_TEST_REDIS=cluster``, a 3-primary, 3-replica Redis Cluster instead."""
    if CLUSTER:
        from tests.cluster_harness import RedisClusterProcess

        cluster = RedisClusterProcess().start()
        yield cluster  # type: ignore[misc]
        cluster.close()
        return
    server = RedisProcess().start()
    yield server
    server.stop()


@pytest.fixture()
def redis_url(redis_server: RedisProcess) -> str:
    """A clean database for each test (restarted if a test stopped it)."""
    if redis_server.proc is None:
        redis_server.start()
    redis_server.flush()
    return redis_server.url


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return tiny_model_dir()


@pytest.fixture(scope="session")
def engine(tiny_model: Path) -> Iterator[EngineProcess]:
    """The real vLLM CPU engine with default caps and default compile mode, shared
    by every test that does not need its own caps. ``--dtype float32``: vLLM's
    ``auto`` serves float32 checkpoints as bfloat16 on x86 CPUs, which would make
    the 1e-3 comparison with a float32 ``transformers`` reference meaningless."""
    proc = EngineProcess(tiny_model, extra_args=["--dtype", "float32"]).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def real_model() -> Path:
    """The converted SmolLM2-135M-Instruct folder (fetched/converted once per cache)."""
    return real_model_dir()


@pytest.fixture(scope="session")
def real_engine(real_model: Path) -> Iterator[EngineProcess]:
    """ONE vLLM CPU engine serving SmolLM2-135M-Instruct at ``--dtype float32``,
    shared by every test in the session that needs the real model (its start costs
    minutes on a loaded machine; mark such tests ``engine``). Tests must not change
    its caps or restart it; a test needing other engine settings starts its own."""
    proc = EngineProcess(
        real_model, env=dict(REAL_ENGINE_ENV), extra_args=list(REAL_ENGINE_ARGS)
    ).start(timeout=900.0)
    yield proc
    proc.stop()
