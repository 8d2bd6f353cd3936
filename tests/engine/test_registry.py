"""The engine's vector registry (``steergate/engine/registry.py``) is a bounded cache:
count and byte caps, least recently used evicted. It had no cap: a caller could make an
engine hold vectors without bound, while every other engine cache is bounded and Redis
keeps what the gateway reinstalls on demand."""

from __future__ import annotations

import numpy as np

from steergate.engine.registry import VectorRegistry

H = 8  # 32 bytes a layer


def _vec(value: float, layers: int = 1) -> dict[int, np.ndarray]:
    return {layer: np.full(H, value, np.float32) for layer in range(layers)}


def test_the_count_cap_evicts_the_least_recently_used() -> None:
    reg = VectorRegistry(max_count=2)
    reg.put("a", "post_block", _vec(1))
    reg.put("b", "post_block", _vec(2))
    assert reg.get("a") is not None  # a is used: b is now the oldest
    reg.put("c", "post_block", _vec(3))
    assert [v.name for v in reg.list()] == ["a", "c"]
    assert reg.status()["vector_evictions"] == 1 and reg.status()["vectors"] == 2


def test_the_byte_cap_counts_replacements_and_deletes_exactly() -> None:
    reg = VectorRegistry(max_bytes=4 * 32)
    reg.put("a", "post_block", _vec(1, layers=2))  # 64 bytes
    reg.put("b", "post_block", _vec(2, layers=2))  # 128
    assert reg.nbytes == 128 and reg.evictions == 0
    reg.put("a", "post_block", _vec(1, layers=1))  # replaced smaller: 96
    assert reg.nbytes == 96
    reg.put("c", "post_block", _vec(3, layers=2))  # 160 > 128: b (oldest) goes
    assert [v.name for v in reg.list()] == ["a", "c"] and reg.nbytes == 96
    assert reg.delete("a") and reg.nbytes == 64
    assert reg.nbytes == sum(v.nbytes for v in reg.list())


def test_a_vector_larger_than_the_cap_is_kept_alone() -> None:
    reg = VectorRegistry(max_bytes=32)
    reg.put("small", "post_block", _vec(1))
    reg.put("big", "post_block", _vec(2, layers=3))
    assert [v.name for v in reg.list()] == ["big"]
    assert reg.digest_of("big") is not None
