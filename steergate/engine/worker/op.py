"""The ``steergate::steer`` custom op: ``hidden += table[index[:n]]`` in place.
(Registered with the dispatcher by :mod:`engine.worker.library`.)

Why a custom op: torch.compile (Dynamo + Inductor) treats it as opaque, so the
compiled graph calls it on every forward with the *current* contents of the
persistent table and index tensors, instead of constant-folding or specialising
on them. Its schema's ``Tensor(a!) hidden`` tells the functionalisation pass the add
is in place, so the compiled graph keeps the mutation and its ordering.

On CUDA the body is recorded into CUDA graphs, so it must not branch on Python
state: it always runs (row 0 of every table is zero, so unsteered tokens add 0).
There it is one fused Triton launch (:mod:`engine.worker.fused`) whose programs for
tokens at slot 0 return at once; the torch gather + add pair is two launches, and
inside a graph launches are what the op costs. Without Triton, or for a layout the
kernel does not take, CUDA uses the torch body, which gives the same bits.
On CPU nothing is recorded, so the body may skip a table no live slot writes; that
check is a set lookup, far cheaper than the gather it avoids.
"""

from __future__ import annotations

import os
import weakref

import torch

from steergate.engine.worker import fused, library

OP_NAME = "steergate::steer"

# data_ptr() of every table that currently holds at least one non-zero row, keyed
# by address because compiled graphs may hand the op another tensor object over the
# same storage. Written by SteeringTables in the same process; read by the CPU fast
# path. The weak reference drops an entry when its table is freed, so a later
# tensor at a reused address is never mistaken for a live table.
_LIVE_TABLES: dict[int, weakref.ref[torch.Tensor]] = {}


def mark_live(table: torch.Tensor, live: bool) -> None:
    ptr = table.data_ptr()
    if live:
        _LIVE_TABLES[ptr] = weakref.ref(table, lambda _ref: _LIVE_TABLES.pop(ptr, None))
    else:
        _LIVE_TABLES.pop(ptr, None)


def steer(hidden: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> None:
    if hidden.device.type == "cpu":
        if table.data_ptr() not in _LIVE_TABLES:
            return
    elif hidden.is_cuda and fused.available() and fused.supports(hidden, table, index):
        fused.gather_add(hidden, table, index)
        return
    torch_steer(hidden, table, index)


def torch_steer(hidden: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> None:
    """The reference body (CPU, and CUDA without Triton): gather, cast, add."""
    n = hidden.shape[0]
    hidden.add_(table.index_select(0, index[:n]).to(hidden.dtype))


def _steer_fake(hidden: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> None:
    return None


library.define("steer", "(Tensor(a!) hidden, Tensor table, Tensor index) -> ()", steer,
               _steer_fake)


#: What a graph compiled on CUDA gets at each site (``STEERGATE_CUDA_COMPILED_STEER``,
#: validated with the engine settings, steergate/shared/settings.py): ``"kernel"`` (default) keeps
#: the opaque custom op, one fused Triton launch per site; ``"inductor"`` traces the
#: torch body into the graph for Inductor to schedule with its neighbours. Measured on
#: an H200 (docs/benchmarks.md): the kernel is cheaper for 1-token decode steps, Inductor
#: for 16 tokens and more. Read when a graph is traced (Dynamo guards on it), never per
#: request; part of the compile-cache tag (compile_tag.py). Eager CUDA and CPU always
#: call the custom op: eager has nothing to fuse with, and the CPU op skips dead tables.
CUDA_COMPILED_BODY = os.environ.get("STEERGATE_CUDA_COMPILED_STEER", "kernel")


def traced_body(hidden: torch.Tensor) -> bool:
    """Whether a site on ``hidden`` runs its torch body traced into the graph being
    compiled (CUDA, ``CUDA_COMPILED_BODY == "inductor"``) rather than the custom op;
    the add and the clamp decide alike."""
    return hidden.is_cuda and CUDA_COMPILED_BODY == "inductor" and torch.compiler.is_compiling()


def apply(hidden: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Add each token's row in place and return ``hidden`` so callers can chain it.

    Under torch.compile on CUDA with ``CUDA_COMPILED_BODY == "inductor"`` this is the
    torch body itself, traced into the graph: the tables are graph inputs, so a compiled
    graph and its CUDA-graph replays read their current contents (checked on the GPU by
    bench/steering_overhead_gpu.py --compiled, on CPU by tests/engine/test_steering_op.py).
    Otherwise the custom op, which compiled graphs call opaquely.
    The choice depends on the device and on whether a graph is being traced, both fixed
    for a captured graph: never on request contents."""
    if traced_body(hidden):
        torch_steer(hidden, table, index)
    else:
        torch.ops.steergate.steer(hidden, table, index)
    return hidden
