"""The dataset's index once, not once per worker: ``shmloader.share()`` against a plain list.

A dataset whose ``__getitem__`` reads a pseudo-random entry of an N-entry list of dicts
(path, label, size) and returns a small tensor. 4 workers (fork), persistent, 3 epochs, for:
torch's DataLoader over the plain list, shmloader's over the plain list, shmloader's over
``share(list)``. Printed per run: throughput, the peak PSS of the whole process tree (shared
pages divided among the processes that map them), and each worker's USS growth from the
first batch to the end, and the dirty part of it (what a worker copied). Also the main process's PSS with the plain list built (the target:
the tree with ``share()`` at most 1.3x that), and random ``__getitem__`` on the list itself.

Usage: python bench/share_index.py [--n 2000000] [--epochs 3] [--workers 4]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import threading
import time
from typing import Any

import torch
from torch.utils.data import Dataset

import shmloader
from shmloader._bench.measure import _tree, pss_bytes


class Index(Dataset):  # type: ignore[type-arg]
    def __init__(self, entries: Any, n: int) -> None:
        self.entries, self.n = entries, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        e = self.entries[(i * 2654435761) % self.n]  # a pseudo-random entry
        return torch.tensor([e["label"], e["size"], len(e["path"])])


class Synthetic:
    """The entries made on demand: no index held anywhere (the workers' own baseline)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"path": f"/data/class{i % 1000:04d}/img{i:08d}.jpg", "label": i % 1000, "size": 1000 + i % 5000}


def uss(pid: int) -> tuple[int, int]:
    """(USS, its dirty part). USS also counts pages of the shared file that only this process
    has mapped so far (Private_Clean): they are the shared file's pages, not copies. Copies
    (copy-on-read of Python objects) are dirty."""
    clean = dirty = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Clean:"):
                clean = int(line.split()[1]) * 1024
            elif line.startswith("Private_Dirty:"):
                dirty = int(line.split()[1]) * 1024
    return clean + dirty, dirty


class Peak:
    """Peak PSS of this process's tree, sampled every 0.1 s."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, pss_bytes(_tree(os.getpid())))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run(name: str, loader: Any, epochs: int) -> None:
    gc.collect()
    peak = Peak()
    it = iter(loader)
    next(it)
    workers = _tree(os.getpid())[1:]
    first = {w: uss(w) for w in workers if os.path.exists(f"/proc/{w}")}
    began, batches = time.perf_counter(), 1
    for _ in it:
        batches += 1
    for _ in range(epochs - 1):
        for _ in loader:
            batches += 1
    elapsed = time.perf_counter() - began
    growth = [(uss(w)[0] - u[0], uss(w)[1] - u[1]) for w, u in first.items() if os.path.exists(f"/proc/{w}")]
    tree = peak.stop()
    print(f"| {name} | {batches / elapsed:,.0f} | {tree / 2**20:,.0f} | "
          f"{', '.join(f'{g / 2**20:,.0f}' for g, _ in growth)} | "
          f"{', '.join(f'{d / 2**20:,.0f}' for _, d in growth)} |", flush=True)
    if loader._iterator is not None:
        loader._iterator._shutdown_workers()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2_000_000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--rows", default="baseline,generator,torch,shmloader,share", help="which runs, comma-separated")
    a = p.parse_args()
    rows = a.rows.split(",")
    kw: dict[str, Any] = dict(batch_size=a.batch_size, num_workers=a.workers, persistent_workers=True,
                              multiprocessing_context="fork")
    print("| loader / index | batches/s | tree peak PSS MB | worker USS growth MB | of which dirty (copied) MB |")
    print("|---|---|---|---|---|")
    if "baseline" in rows:  # before any index exists in this process
        run("shmloader / no index (entries made on demand)", shmloader.DataLoader(Index(Synthetic(a.n), a.n), **kw),
            a.epochs)
    if "generator" in rows:  # still no list of Python objects in this process
        made = Synthetic(a.n)
        streamed = shmloader.share(made[i] for i in range(a.n))
        run("shmloader / share(generator)", shmloader.DataLoader(Index(streamed, a.n), **kw), a.epochs)
        del streamed
    entries = [Synthetic(a.n)[i] for i in range(a.n)]
    gc.collect()
    main_pss = pss_bytes([os.getpid()])
    began = time.perf_counter()
    shared = shmloader.share(entries)
    share_s = time.perf_counter() - began
    print(f"{a.n:,} entries; main process PSS with the plain list {main_pss / 2**20:,.0f} MB; "
          f"share() took {share_s:.1f} s")

    rng = random.Random(0)
    picks = [rng.randrange(a.n) for _ in range(200_000)]
    for name, seq in (("plain list", entries), ("share()", shared)):
        began = time.perf_counter()
        for j in picks:
            e = seq[j]
            e["label"]
        print(f"random __getitem__ + one field, {name}: {1e9 * (time.perf_counter() - began) / len(picks):,.0f} ns")

    if "torch" in rows:
        run("torch / plain list", torch.utils.data.DataLoader(Index(entries, a.n), **kw), a.epochs)
    if "shmloader" in rows:
        run("shmloader / plain list", shmloader.DataLoader(Index(entries, a.n), **kw), a.epochs)
    del entries
    gc.collect()
    if "share" in rows:
        run("shmloader / share() (the plain list built, shared, dropped)",
            shmloader.DataLoader(Index(shared, a.n), **kw), a.epochs)


if __name__ == "__main__":
    main()
