"""What the bench's peak-memory sampler costs the loader it measures.

Runs shmloader on the bench's memmap workload (2 workers, prefetch 2, persistent) in fresh
processes, alternated round by round: with no sampler, with the sampler as it was before
2026-12-01 (PSS of the whole tree every 50 ms), and with the current one (shared memory every
50 ms, PSS every second). Prints each round's batches/s and the median of each.

Usage: python bench/sampler_cost.py [--rounds 7] [--batches 1000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

SAMPLERS = ("none", "old", "new")


def one(sampler: str, batches: int) -> float:
    """Batches/s of one fresh shmloader over the memmap workload, under ``sampler``."""
    import shmloader
    from shmloader._bench.measure import PeakMemory
    from shmloader._bench.workloads import CACHE, WORKLOADS

    w = WORKLOADS["memmap"]
    ds = w.make(CACHE, False, None, 32 * (batches + 100))
    memory = {"old": lambda: PeakMemory(0.05, 0.05), "new": lambda: PeakMemory()}.get(sampler, lambda: None)()
    loader = shmloader.DataLoader(ds, batch_size=32, num_workers=2, prefetch_factor=2, persistent_workers=True)
    it = iter(loader)
    for _ in range(5):
        next(it)
    t = time.perf_counter()
    for _ in range(batches):
        next(it)
    rate = batches / (time.perf_counter() - t)
    del it
    if memory is not None:
        memory.stop()
    return rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--batches", type=int, default=1000)
    p.add_argument("--one", choices=SAMPLERS, help=argparse.SUPPRESS)  # a child's single run
    args = p.parse_args()
    if args.one:
        print(one(args.one, args.batches))
        return
    rates: dict[str, list[float]] = {s: [] for s in SAMPLERS}
    for r in range(args.rounds):
        order = SAMPLERS[r % 3:] + SAMPLERS[: r % 3]
        for s in order:
            out = subprocess.run([sys.executable, __file__, "--one", s, "--batches", str(args.batches)],
                                 capture_output=True, text=True, check=True, env=os.environ)
            rates[s].append(float(out.stdout.split()[-1]))
        print(f"round {r + 1}: " + ", ".join(f"{s} {rates[s][-1]:,.0f}" for s in SAMPLERS), flush=True)
    for s in SAMPLERS:
        print(f"{s}: median {statistics.median(rates[s]):,.0f} batches/s ({min(rates[s]):,.0f}-{max(rates[s]):,.0f})")


if __name__ == "__main__":
    main()
