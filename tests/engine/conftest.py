"""Fixtures for the engine tests that compare against a float32 reference.

vLLM's ``--dtype auto`` serves float32 checkpoints in bfloat16 on x86 CPUs, which
is right for real models but makes a 1e-3 logprob comparison with a float32
``transformers`` reference meaningless. These tests therefore run the tiny model
with ``--dtype float32`` (otherwise the same as the shared ``engine`` fixture:
default compile mode, prefix caching on), one engine for the whole session.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import EngineProcess


@pytest.fixture(scope="session")
def f32_engine(tiny_model: Path) -> Iterator[EngineProcess]:
    proc = EngineProcess(tiny_model, extra_args=["--dtype", "float32"]).start()
    yield proc
    proc.stop()
