"""What the offline-vLLM benchmarks share: the steergate plugin loaded in this process,
a model (a generated Llama in a temporary folder, or ``--model``), one ``vllm.LLM`` on
it, and a batch of distinct token prompts."""

from __future__ import annotations

import os
import tempfile
from typing import Any


def offline_llm(
    model: str | None, hidden: int, layers: int, batch: int, dtype: str = "auto"
) -> tuple[Any, tempfile.TemporaryDirectory[str]]:
    """(``vllm.LLM`` with the plugin loaded, the temporary folder to clean up)."""
    os.environ["VLLM_PLUGINS"] = "steergate"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from steergate.engine.tiny_model import generate

    tmp = tempfile.TemporaryDirectory(prefix="sg-bench-")
    path = model or str(generate(
        tmp.name, hidden_size=hidden, num_layers=layers, num_heads=hidden // 64,
        num_kv_heads=max(1, hidden // 256), intermediate_size=hidden * 11 // 4, seed=0,
    ))
    from vllm import LLM

    llm = LLM(model=path, dtype=dtype, seed=0, max_num_seqs=max(16, batch),
              enable_prefix_caching=False)
    return llm, tmp


def shape(llm: Any) -> tuple[int, int]:
    """(hidden size, decoder layers) of the served model."""
    cfg = llm.llm_engine.vllm_config.model_config
    return cfg.get_hidden_size(), cfg.get_num_layers(llm.llm_engine.vllm_config.parallel_config)


def token_prompts(batch: int, prompt_tokens: int) -> list[Any]:
    from vllm.inputs import TokensPrompt

    return [
        TokensPrompt(prompt_token_ids=[10 + (i * 7 + j) % 500 for j in range(prompt_tokens)])
        for i in range(batch)
    ]
