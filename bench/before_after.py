"""Rates and CPU a batch of a few workloads, for whichever shmloader is imported: run it
alternately against this checkout and a worktree of the code before a change, so that both are
measured in the same minutes. The datasets are defined here (the bench's own workloads may not
exist in the code before).

    git worktree add /tmp/before REV && (cd /tmp/before && python setup.py build_ext --inplace)
    for r in 1 2; do for d in /tmp/before .; do
        PYTHONPATH=$d python bench/before_after.py --batches 6000 pairs tensor-pairs tiny
        PYTHONPATH=$d python bench/before_after.py --batches 2000 memmap varlen
    done; done

Workloads: ``pairs`` (64 x (uint8[3,32,32], a Python int): torchvision's (image, class)),
``tensor-pairs`` (the label a 0-d tensor), and the bench's ``tiny``, ``memmap``, ``varlen``
(``shmloader._bench.workloads``, which both have). 2 workers, torch's defaults otherwise; each
batch read as the bench reads it. Prints, per workload: batches/s, and the main process's and
the workers' CPU µs a batch.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import shmloader
from shmloader._bench.measure import TreeUsage, read
from shmloader._bench.workloads import CACHE, WORKLOADS

WARM = 400  # batches before the clock starts


class Pairs(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int, tensor_labels: bool) -> None:
        self.x = torch.ones(3, 32, 32, dtype=torch.uint8)
        self.labels: list[Any] = [torch.tensor(i) for i in range(10)] if tensor_labels else list(range(10))
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, Any]:
        return self.x, self.labels[i % 10]


def measure(name: str, batches: int) -> str:
    if name in ("pairs", "tensor-pairs"):
        ds: Any = Pairs((WARM + batches) * 64, name == "tensor-pairs")
        batch_size, collate_fn = 64, None
    else:
        w = WORKLOADS[name]
        ds = w.make(CACHE, False, None, (WARM + batches) * w.batch_size)
        batch_size, collate_fn = w.batch_size, w.collate_fn
    it = iter(shmloader.DataLoader(ds, num_workers=2, batch_size=batch_size, collate_fn=collate_fn))
    for _ in range(WARM):
        read(next(it))
    usage, began = TreeUsage(), time.perf_counter()
    for _ in range(batches):
        read(next(it))
    wall = time.perf_counter() - began
    main, workers = usage.stop()
    del it
    return (f"{name} {batches / wall:,.0f} b/s, main {1e6 * main.on_cpu / batches:.0f} µs, "
            f"workers {1e6 * workers.on_cpu / batches:.0f} µs")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=2000, help="measured batches a workload (after %d warm)" % WARM)
    p.add_argument("workloads", nargs="+", help="pairs, tensor-pairs, or a workload of shmloader bench")
    a = p.parse_args()
    print(shmloader.__file__, "|", " | ".join(measure(name, a.batches) for name in a.workloads), flush=True)
