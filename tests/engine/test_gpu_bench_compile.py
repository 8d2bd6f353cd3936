"""The GPU bench compiles its step as vLLM compiles a model
(bench/steering_overhead_gpu.py ``compile_like_vllm``): one dynamic graph per model,
traced at the largest token count, guards dropped. Its figures at 1 token mean what
they say only if a 1-token call runs that graph (no size-1 specialisation) and each
variant runs its own graph (without guards, models sharing a forward could share one).
Checked here on CPU with Inductor's C++ backend."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn

BENCH = Path(__file__).resolve().parents[2] / "bench" / "steering_overhead_gpu.py"


def _bench():
    spec = importlib.util.spec_from_file_location("steering_overhead_gpu", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Step(nn.Module):
    def __init__(self, seed: int, width: int = 32):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(width, width, generator=gen), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x + torch.nn.functional.linear(x, self.w)
        return torch.nn.functional.rms_norm(s, (s.shape[-1],)) * 2 + s


def test_one_graph_per_model_serves_every_token_count_including_one() -> None:
    from torch._dynamo.utils import counters

    bench = _bench()
    torch._dynamo.reset()
    counters.clear()
    a, b = _Step(1), _Step(2)
    example = torch.randn(8, 32)
    ca = bench.compile_like_vllm(a, example)
    cb = bench.compile_like_vllm(b, example)
    assert counters["stats"]["unique_graphs"] == 2
    for n in (8, 5, 2, 1):
        x = torch.randn(n, 32)
        with torch.no_grad():
            want_a, want_b = a(x), b(x)
        torch.testing.assert_close(ca(x), want_a)
        torch.testing.assert_close(cb(x), want_b)  # b's own graph, not a's
        assert not torch.allclose(want_a, want_b)
    # Sizes 5, 2 and 1 ran the graphs traced at 8 tokens: nothing recompiled.
    assert counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()
