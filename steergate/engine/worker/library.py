"""steergate's custom ops, registered with torch's dispatcher directly (no vLLM imports).

The ops run at every point of the stream in every forward, steered or not (CUDA graphs
and compiled graphs cannot skip a call), so what a call costs before its body runs is
paid by every tenant's every step. ``torch.library.custom_op`` wraps each call in its
own Python machinery (autograd and ``ADInplaceOrView`` kernels, argument checks): about
20 µs per call in inference mode on the 2-core CPUs here, 30 µs outside it. A
``torch.library.Library`` definition whose CPU and CUDA kernels are the Python function
itself costs about 4 µs (``bench/steering_overhead.py --micro-only`` prints both; docs/
benchmarks.md). vLLM registers its own ops this way (``direct_register_custom_op``) for
the same reason.

To torch.compile the two are the same thing: an op with a schema and a fake
implementation, which Dynamo records as an opaque call and whose ``Tensor(a!)``
argument functionalisation keeps as a mutation, in order. There is no autograd kernel:
the engine runs in inference mode and nothing differentiates through steering.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

NAMESPACE = "steergate"
# FRAGMENT, not DEF: each op module adds its own definitions to the namespace.
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


def define(name: str, schema: str, kernel: Callable[..., Any], fake: Callable[..., Any]) -> str:
    """Define ``steergate::name`` with ``schema`` (its arguments and result, e.g.
    ``"(Tensor(a!) hidden, Tensor table, Tensor index) -> ()"``), run ``kernel`` for CPU
    and CUDA tensors and ``fake`` under tracing; returns the qualified name."""
    _LIB.define(name + schema)
    for key in ("CPU", "CUDA"):
        _LIB.impl(name, kernel, key)
    qualified = f"{NAMESPACE}::{name}"
    torch.library.register_fake(qualified, fake, lib=_LIB)
    return qualified
