"""How close a loader comes to the limit its dataset sets on this machine, and where the rest goes.

The limit is the dataset's own work (the sampler, ``__getitem__``, the collate and the loop's
read of each batch) run in ``num_workers`` processes at once, with no loader between them:
what the CPUs give that work when nothing else runs. Issue 52 estimated it as ``num_workers``
times the one-process rate (the ``dataset`` row); the ``limit`` row measures it. Then torch and
shmloader move the same batches to one loop, in order and with ``in_order=False``; ``bare ring``
(``bench/bare_ring.py``) moves them through shared memory as any such loader must and does
nothing else: the floor of the design on this machine.

Each row is a fresh process, alternated per round. For each loader the CPU a batch cost is
accounted: the main process's, the workers', and the machine's idle CPU time (``/proc/stat``,
which counts any other load as busy).

    python bench/dataset_limit.py --workloads memmap,varlen --rounds 2
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import torch
from bare_ring import BareRing

import shmloader
from shmloader._bench.measure import TreeUsage, read
from shmloader._bench.workloads import CACHE, WORKLOADS

WARM = 200  # batches before the clock starts: workers started, caches and the ring warm
ROWS = ("dataset", "limit", "torch", "bare ring", "shmloader", "shmloader, in_order=False")


def _idle_s() -> float:
    """The machine's idle CPU seconds so far, all CPUs (idle and iowait)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    return (int(fields[3]) + int(fields[4])) / os.sysconf("SC_CLK_TCK")


def _loader(row: str, name: str, batches: int, workers: int) -> Any:
    w = WORKLOADS[name]
    ds = w.make(CACHE, False, None, (WARM + batches) * w.batch_size)
    kw: dict[str, Any] = {"batch_size": w.batch_size, "collate_fn": w.collate_fn}
    if row in ("dataset", "limit"):
        return torch.utils.data.DataLoader(ds, num_workers=0, **kw)
    if row == "torch":
        return torch.utils.data.DataLoader(ds, num_workers=workers, **kw)
    if row == "bare ring":
        return BareRing(ds, w.batch_size, workers, collate_fn=w.collate_fn)
    return shmloader.DataLoader(ds, num_workers=workers, in_order=row == "shmloader", **kw)


def _loop(row: str, name: str, batches: int, workers: int, start: Any, out: Any) -> None:
    """One process's measured loop: WARM batches, then ``batches`` timed, with their CPU."""
    it = iter(_loader(row, name, batches, workers))
    for _ in range(WARM):
        read(next(it))
    if start is not None:
        start.wait()
    usage = TreeUsage()
    idle, began = _idle_s(), time.perf_counter()
    for _ in range(batches):
        read(next(it))
    wall = time.perf_counter() - began
    main, used = usage.stop()
    out.put((batches / wall, main.on_cpu / batches, used.on_cpu / batches, (_idle_s() - idle) / batches))
    del it  # (its workers stop here)


def run(row: str, name: str, batches: int, workers: int) -> tuple[float, float, float, float]:
    """(batches/s, main s a batch, workers s a batch, idle s a batch). ``limit`` sums the rates of
    ``workers`` processes started together, and counts their CPU as workers'; ``dataset``'s is
    all the main process's."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = workers if row == "limit" else 1
    start = ctx.Barrier(procs) if procs > 1 else None
    children = [ctx.Process(target=_loop, args=(row, name, batches, workers, start, out)) for _ in range(procs)]
    for child in children:
        child.start()
    got = [out.get() for _ in children]
    for child in children:
        child.join()
    if row != "limit":
        return got[0]
    # (the machine's idle time over the run, per batch of all of them)
    return sum(g[0] for g in got), 0.0, statistics.mean(g[1] for g in got), statistics.mean(g[3] for g in got) / procs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="memmap,varlen")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batches", type=int, default=3000)
    p.add_argument("--num-workers", type=int, default=2)
    a = p.parse_args()
    for name in a.workloads.split(","):
        got: dict[str, list[tuple[float, float, float, float]]] = {r: [] for r in ROWS}
        for _ in range(a.rounds):
            for row in ROWS:
                got[row].append(run(row, name, a.batches, a.num_workers))
        limit = statistics.median(g[0] for g in got["limit"])
        print(f"\n{name}, {a.num_workers} workers, {a.batches} batches a run, {a.rounds} rounds; µs a batch, medians")
        print("| row | batches/s (each round) | of the limit | main | workers | idle CPU |")
        print("|---|---|---|---|---|---|")
        for row in ROWS:
            runs = got[row]
            rate = statistics.median(g[0] for g in runs)
            if row == "dataset":
                rate *= a.num_workers
                row = f"dataset × {a.num_workers} (issue 52's estimate)"
            each = ", ".join(f"{g[0]:,.0f}" for g in runs)
            main_us, workers_us, idle_us = (statistics.median(g[i] for g in runs) * 1e6 for i in (1, 2, 3))
            print(f"| {row} | {rate:,.0f} ({each}) | {rate / limit:.0%} | {main_us:.0f} | {workers_us:.0f} "
                  f"| {idle_us:.0f} |")


if __name__ == "__main__":
    main()
