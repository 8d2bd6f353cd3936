"""Tag vLLM's compile caches with a steergate factor.

vLLM keys its AOT compile cache on the vLLM config, its env vars and (optionally)
Inductor's own factors. None of those see that a plugin wrapped the decoder
layers, so without a tag a graph compiled *without* the steering op (plain vLLM,
same model and config) could be loaded and silently never steer. The factor holds
the op's name and a hash of this package's source, so a changed wrapper also gets
a fresh graph.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

_PATCHED = "_steergate_patched"


@functools.cache
def steergate_factor() -> str:
    from steergate.shared.settings import EngineSettings

    h = hashlib.sha256(b"steergate::steer/v1")
    # The clamp cap decides whether the wrappers call the clamp op at all (0: never)
    # and the shapes of its tables, so graphs compiled under another cap must not load.
    h.update(f"|clamps:{EngineSettings().max_clamps_per_site}|".encode())
    # So does the body a graph compiled on CUDA traces at each site: the value op.py
    # acts on, so the tag cannot disagree with the graph.
    from steergate.engine.worker import op

    h.update(f"|cuda-body:{op.CUDA_COMPILED_BODY}|".encode())
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return "steergate:" + h.hexdigest()[:16]


def install() -> None:
    from vllm.compilation import caching

    original = caching.aot_compile_hash_factors
    if getattr(original, _PATCHED, False):
        return
    caching.aot_compile_hash_factors = _tagged(original)


def _tagged(original: Callable[..., list[str]]) -> Callable[..., list[str]]:
    @functools.wraps(original)
    def aot_compile_hash_factors(vllm_config: Any) -> list[str]:
        return [*original(vllm_config), steergate_factor()]

    setattr(aot_compile_hash_factors, _PATCHED, True)
    return aot_compile_hash_factors
