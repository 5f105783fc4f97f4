"""What a real workload's dataset costs on its own, per batch, in one process: the floor under
any loader's CPU per batch on that workload (``shmloader bench``'s memmap or jpeg).

Each round times ``batches`` batches of ``[ds[i] for i in batch]`` plus torch's default
collate (process CPU time) twice: with the other CPUs idle, then with a process spinning on
CPU 1 (this one is pinned to CPU 0), as a second worker would. The two columns show how much
of a loader's ratio to torch the machine's state decides: on a 2-vCPU guest both the
dataset's cost and what a busy neighbour adds to it move from round to round.

Usage: python bench/dataset_cost.py [memmap|jpeg] [--rounds 4] [--batches 300]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from typing import Any

import torch
from torch.utils.data import default_collate

from shmloader._bench.workloads import CACHE, WORKLOADS


def _per_batch_ms(ds: Any, bs: int, batches: int, first: int) -> float:
    began = time.process_time()
    for b in range(first, first + batches):
        default_collate([ds[i] for i in range(b * bs, b * bs + bs)])
    return (time.process_time() - began) / batches * 1e3


def _spin(stop: Any) -> None:
    os.sched_setaffinity(0, {1})
    while not stop.is_set():
        sum(range(1000))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", nargs="?", default="memmap", choices=["memmap", "jpeg"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batches", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {0})
    w = WORKLOADS[args.workload]
    n = args.batches * w.batch_size * (2 * args.rounds + 1)
    ds = w.make(CACHE, False, None, n)
    _per_batch_ms(ds, w.batch_size, args.batches, 0)  # warm: imports, the file's pages
    ctx = mp.get_context("fork")
    for r in range(args.rounds):
        alone = _per_batch_ms(ds, w.batch_size, args.batches, (2 * r + 1) * args.batches)
        stop = ctx.Event()
        spinner = ctx.Process(target=_spin, args=(stop,))
        spinner.start()
        try:
            busy = _per_batch_ms(ds, w.batch_size, args.batches, (2 * r + 2) * args.batches)
        finally:
            stop.set()
            spinner.join()
        print(f"{args.workload} round {r + 1}: {alone:.3f} ms a batch alone, {busy:.3f} with CPU 1 busy", flush=True)


if __name__ == "__main__":
    main()
