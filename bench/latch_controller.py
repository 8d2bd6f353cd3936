"""Latch controller throughput at its caps: store (with LRU eviction), bridge
(use), and delete, on the API-server process's critical path.

    .venv/bin/python bench/latch_controller.py [--hidden 4096] [--ops 200000]

Prints operations per second and microseconds per operation, median of 5 runs,
and the controller's byte accounting against the real memory of the vectors held.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from steergate.engine.latch import Latch, LatchController, RefTerm


def run(hidden: int, ops: int, max_count: int, max_bytes: int) -> dict[str, float]:
    ctl = LatchController(max_count, max_bytes, epoch="bench")
    vec = np.ones(hidden, np.float32)
    value = Latch(phase="all", value_sites={("post_block", 3): vec})
    ref = Latch(phase="all", refs=(RefTerm("t~calm", "d" * 64, 4.0),))
    digest_of = {"t~calm": "d" * 64}.get
    ids = [f"t~conv-{i}" for i in range(ops)]

    t0 = time.perf_counter()
    for i, cid in enumerate(ids):  # fresh ids: every store past the cap evicts
        ctl.store(cid, value if i % 2 else ref)
    t1 = time.perf_counter()
    live = ctl.order()
    for i in range(ops):
        ctl.use(live[i % len(live)], digest_of)
    t2 = time.perf_counter()
    for cid in live:
        ctl.delete(cid)
    t3 = time.perf_counter()
    assert ctl.count <= max_count and ctl.nbytes <= max_bytes
    return {
        "store_us": (t1 - t0) / ops * 1e6,
        "use_us": (t2 - t1) / ops * 1e6,
        "delete_us": (t3 - t2) / max(1, len(live)) * 1e6,
        "evictions": float(ctl.evictions),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ops", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    max_count, max_bytes = 1024, 256 * 1024 * 1024
    runs = [run(args.hidden, args.ops, max_count, max_bytes) for _ in range(args.repeats)]
    print(f"hidden={args.hidden} ops={args.ops} caps={max_count} latches / {max_bytes >> 20} MiB")
    for key in ("store_us", "use_us", "delete_us"):
        med = statistics.median(r[key] for r in runs)
        rate = 1e6 / med
        print(f"{key[:-3]:>7}: {med:6.2f} us/op  ({rate:,.0f} ops/s), median of {args.repeats}")
    print(f"evictions per run: {int(runs[0]['evictions'])}")
    print(f"bytes per by-value latch: {4 * args.hidden} (one float32 vector), by-ref: 0")


if __name__ == "__main__":
    main()
