"""What the one-frame steady case of a sync ``next()`` saves: ``RingIterator.__next__`` as it
is, against the same iterator taking the general path (``_next_data``, then
``_count_yield``: what ``__next__`` did before 82c5ea8), alternated every four calls in the
same epochs so both see the same machine.

limit_probe's workloads (2 workers, prefetch 2, persistent). As in ``bench/ready_next.py``,
the loop pauses 1.5 ms before each group of four calls so that their batches are ready; each
call is timed on its own. Prints the 25th percentile and median, µs, for each path.

Usage: python bench/steady_ab.py [tiny|tokens] [--epochs 6]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "shared" / "bench"))
import limit_probe as lp  # noqa: E402

import shmloader  # noqa: E402
from shmloader._consume import RingIterator  # noqa: E402

BATCHES = 1200


def general_next(self: RingIterator) -> Any:
    data = self._next_data()
    self._count_yield()
    return data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", nargs="?", default="tiny", choices=["tiny", "tokens"])
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args()
    shape, dtype, bs, _ = lp.WORK[args.workload]
    loader = shmloader.DataLoader(lp.Tagged(shape, dtype, BATCHES * bs), batch_size=bs, num_workers=2,
                                  prefetch_factor=2, persistent_workers=True)
    steady_next = RingIterator.__next__
    took: dict[str, list[int]] = {"general": [], "steady": []}
    try:
        for _ in range(args.epochs):
            it = iter(loader)
            calls = 0
            try:
                while True:
                    path = "steady" if (calls // 4) % 2 else "general"
                    RingIterator.__next__ = steady_next if path == "steady" else general_next  # type: ignore[method-assign]
                    time.sleep(0.0015)
                    for _ in range(4):
                        t = time.perf_counter_ns()
                        batch = next(it)
                        took[path].append(time.perf_counter_ns() - t)
                        del batch
                    calls += 4
            except StopIteration:
                pass
    finally:
        RingIterator.__next__ = steady_next  # type: ignore[method-assign]
        del loader
    for path, ns in took.items():
        ns.sort()
        print(f"{args.workload} {path}: p25 {ns[len(ns) // 4] / 1e3:.2f} µs, median {ns[len(ns) // 2] / 1e3:.2f} µs "
              f"({len(ns)} calls)")


if __name__ == "__main__":
    main()
