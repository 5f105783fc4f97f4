"""What a sync ``next()`` costs the main process when its batch is already there: the loader's
own work per batch in a training loop whose step is longer than a batch takes to make.

limit_probe's workloads (2 workers, prefetch 2, persistent). Before each group of four
``next()`` calls the loop pauses 1.5 ms, so the workers fill every slot; each call is then
timed on its own. Prints, per run, the 25th percentile and the median in µs, for the bare
ring of limit_probe and for shmloader. (The pause is the benchmark's setting, not a
synchronisation: a call that finds its batch missing waits, and shows as a slow one.)

Usage: python bench/ready_next.py [tiny|tokens] [--runs 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "shared" / "bench"))
import limit_probe as lp  # noqa: E402

import shmloader  # noqa: E402

BATCHES = 1200


def timed(make: Callable[[], Iterator[Any]]) -> tuple[float, float]:
    """(p25, median) µs of the ``next()`` calls of one epoch."""
    it = make()
    took = []
    try:
        while True:
            time.sleep(0.0015)
            for _ in range(4):
                t = time.perf_counter_ns()
                batch = next(it)
                took.append(time.perf_counter_ns() - t)
                del batch
    except StopIteration:
        pass
    took.sort()
    return took[len(took) // 4] / 1e3, took[len(took) // 2] / 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", nargs="?", default="tokens", choices=["tiny", "tokens"])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    shape, dtype, bs, _ = lp.WORK[args.workload]
    ds = lp.Tagged(shape, dtype, BATCHES * bs)
    ring = lp.Ring(ds, bs, shape, dtype)
    loader = shmloader.DataLoader(ds, batch_size=bs, num_workers=2, prefetch_factor=2, persistent_workers=True)
    try:
        for name, make in (("bare ring", ring.epoch), ("shmloader", lambda: iter(loader))):
            runs = [timed(make) for _ in range(args.runs)]
            print(f"{args.workload} {name}: " + ", ".join(f"{p25:.2f} / {med:.2f}" for p25, med in runs)
                  + " µs (p25 / median per run)")
    finally:
        ring.close()


if __name__ == "__main__":
    main()
