"""A user's job beside CPU-bound neighbours: a fresh DataLoader (torch's defaults, 2 workers)
per run, started after the neighbours, every batch's contents checked, as a training process
on a shared node meets it. Alternated per round: torch, shmloader (no prefetch_factor given: its
depth adapts), shmloader with ``prefetch_factor=2`` given (torch's depth: the code before the
adaptive depth), and shmloader with its yields untimed as well (``YieldWait.CONTENDED_NS`` out of
reach: the code before issue 52's first fix).

    python bench/neighbours_job.py --neighbours 0,1,2 --rounds 3 --batches 1500

``shmloader bench --neighbours`` measures one long-lived iterator after a warm-up; this measures
what a job sees from its first batch, where the placement of its processes beside the
neighbours is whatever the scheduler made it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.utils.data as tud

import shmloader
from shmloader._bench.neighbours import counts, neighbours
from shmloader.wire.ring import YieldWait

WORKLOADS = {"tiny": ((16,), torch.float32, 32), "tokens": ((512,), torch.int64, 64)}


class Numbered(tud.Dataset):  # type: ignore[type-arg]
    """Sample i: a tensor of the workload's shape filled with i % 256 (256 made once)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.items = [torch.full(shape, i, dtype=dtype) for i in range(256)]

    def __len__(self) -> int:
        return 10**8

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.items[i % 256]


def rate(variant: str, workload: str, batches: int) -> float:
    shape, dtype, batch_size = WORKLOADS[workload]
    dataset = Numbered(shape, dtype)
    make: Any = tud.DataLoader if variant == "torch" else shmloader.DataLoader
    untimed = variant == "shmloader, depth 2, yields untimed"
    depth = {"prefetch_factor": 2} if "depth 2" in variant else {}
    saved = YieldWait.CONTENDED_NS
    if untimed:
        YieldWait.CONTENDED_NS = 10**18  # (workers fork after this: they inherit it)
    try:
        it = iter(make(dataset, batch_size=batch_size, num_workers=2, **depth))
        began = time.perf_counter()
        for k in range(batches):
            batch = next(it)
            first = k * batch_size
            last = dataset.items[(first + batch_size - 1) % 256]
            if int(batch[0].flatten()[0]) != first % 256 or not torch.equal(batch[-1], last):
                raise AssertionError(f"{variant}: batch {k} is not the dataset's")
        took = time.perf_counter() - began
        del it, batch
    finally:
        YieldWait.CONTENDED_NS = saved
    return batches / took


def main() -> None:
    if torch.multiprocessing.get_start_method() != "fork":  # (spawned workers would keep the timed yields)
        raise SystemExit("neighbours_job.py compares yields timed and untimed through workers forked from this process")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--neighbours", default="1,2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", type=int, default=1500)
    p.add_argument("--workloads", default="tiny,tokens")
    args = p.parse_args()
    variants = ["torch", "shmloader", "shmloader, depth 2", "shmloader, depth 2, yields untimed"]
    got: dict[tuple[str, int, str], list[float]] = {}
    for r in range(args.rounds):
        for workload in args.workloads.split(","):
            for n in counts(args.neighbours):
                for variant in variants[r % 4:] + variants[: r % 4]:
                    with neighbours(n):
                        got.setdefault((workload, n, variant), []).append(rate(variant, workload, args.batches))
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} | bench/neighbours_job.py --neighbours {args.neighbours} "
          f"--rounds {args.rounds} --batches {args.batches}; batches/s from the first batch, median (each round); "
          "vs torch: the median of each round's ratio to torch beside as many")
    print("| workload | neighbours | loader | batches/s (median; each round) | vs torch |")
    print("|---|---|---|---|---|")
    for (workload, n, variant), rates in got.items():
        base = got[(workload, n, "torch")]
        ratio = statistics.median(x / b for x, b in zip(rates, base))
        each = ", ".join(f"{x:,.0f}" for x in rates)
        print(f"| {workload} | {n} | {variant} | {statistics.median(rates):,.0f} ({each}) | {ratio:.1f}x |")


if __name__ == "__main__":
    main()
