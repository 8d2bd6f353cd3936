"""Fixtures for the engine tests that compare against a float32 reference."""

from __future__ import annotations

import pytest

from tests.harness import EngineProcess


@pytest.fixture(scope="session")
def f32_engine(engine: EngineProcess) -> EngineProcess:
    """The shared session engine, which already serves the tiny model in float32
    (see ``tests/conftest.py``); named for what the reference tests rely on."""
    return engine
