"""Seeded sampling on vLLM's CPU runner, which crashed the engine (a vLLM bug).

A request still in its prefill at the end of a step (a chunked prefill) is sampled with
the others, and its token thrown away. vLLM then winds that request's own generator
(``seed`` set) back with ``gen.set_offset(gen.get_offset() - 4)`` in
``GPUModelRunner._bookkeeping_sync``, so that its tokens do not depend on how its
prompt was chunked. Only a CUDA generator has an offset: on the CPU runner, which
inherits that code, it raises ``RuntimeError: CPU Generator does not use offset`` and
the engine core dies, for every tenant (found from outside: a few concurrent seeded
requests with longer prompts, or any sampled ``steering.compare``, whose halves share a
seed the engine draws).

The same rewind, done the CPU's way: before sampling, the state of each such request's
CPU generator is kept (``get_state``, 5 KB for a seeded request mid-prefill); after
sampling it is put back, so the discarded draw never happened; and during
``_bookkeeping_sync`` those generators are out of the runner's map, so vLLM's offset
call skips them. A seeded request then samples the same tokens however its prompt was
chunked, as on CUDA. Installed on ``CPUModelRunner`` only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

_PATCHED = "_steergate_cpu_seeds"


def install(cpu_runner: type) -> None:
    """Wrap ``_sample`` and ``_bookkeeping_sync`` of the CPU runner class (idempotent)."""
    if cpu_runner.__dict__.get(_PATCHED):
        return
    setattr(cpu_runner, "_sample", _rewinding(cpu_runner._sample))  # noqa: B010
    setattr(cpu_runner, "_bookkeeping_sync", _without_rewound(cpu_runner._bookkeeping_sync))  # noqa: B010
    setattr(cpu_runner, _PATCHED, True)


def _discarded(runner: Any) -> dict[int, Any]:
    """index -> CPU generator, of the requests whose sampled token this step discards."""
    batch = runner.input_batch
    mask = runner.discard_request_mask.np[: batch.num_reqs]
    gens = {}
    for i in np.nonzero(mask)[0]:
        gen = batch.generators.get(int(i))
        if gen is not None and gen.device.type == "cpu":
            gens[int(i)] = gen
    return gens


def _rewinding(sample: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(sample)
    def sample_and_rewind(self: Any, *args: Any, **kwargs: Any) -> Any:
        gens = _discarded(self)
        if not gens:
            return sample(self, *args, **kwargs)
        kept = {i: gen.get_state() for i, gen in gens.items()}
        try:
            return sample(self, *args, **kwargs)
        finally:
            for i, gen in gens.items():
                gen.set_state(kept[i])

    return sample_and_rewind


def _without_rewound(bookkeeping: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(bookkeeping)
    def bookkeeping_without_offsets(self: Any, *args: Any, **kwargs: Any) -> Any:
        gens = _discarded(self)
        generators = self.input_batch.generators
        for i in gens:
            del generators[i]  # rewound already: vLLM's offset call must not see them
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(gens)

    return bookkeeping_without_offsets
