"""How much of limit_probe's ceiling any correct loader can reach: the bare ring run as it
is, then made to do the two things its worker skips and shmloader's cannot.

- ``bare``: limit_probe's ring, unchanged (its worker indexes the dataset's list of ready
  tensors inline: ``items[i % bank]``).
- ``+getitem``: the same ring whose worker calls the dataset, ``dataset[i]``, as torch's
  fetcher and shmloader's do (the probe's ``Tagged.__getitem__`` is one list index, so this is
  the cost of the call itself).
- ``+dtype``: also checks that the samples share one dtype before ``torch.stack(out=)``
  (with ``_native.same_attr``, the check shmloader's worker makes): ``out=`` silently casts,
  where default_collate promotes (README, "A few cases differ").
- ``shmloader``: ``shmloader.DataLoader`` with the probe's settings.

All four in one process, alternated round by round on the same dataset, every 7th batch's
contents checked (limit_probe's ``rate``). Prints each one's batches/s per round and, for the
medians, each as a share of ``bare`` and shmloader as a share of the others.

Usage: python bench/ceiling_split.py [tiny tokens image] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "shared" / "bench"))
import limit_probe as lp  # noqa: E402

import shmloader  # noqa: E402
from shmloader import _native  # noqa: E402


class DatasetRing(lp.Ring):
    """limit_probe's ring whose worker fetches through ``dataset[i]``, and with ``check`` true
    also checks the samples' one dtype; otherwise the probe's worker line for line."""

    check = False

    def _work(self, w: int) -> None:
        mine = [s for s in range(self.S) if s % lp.W == w]
        ds, bs, check = self.ds, self.bs, self.check
        dtype = self.views[0].dtype
        while True:
            self.task[w].acquire()
            for s in mine:
                h = self.hdr[s]
                if h[0] == 1:  # TASK
                    start = int(h[1])
                    if start < 0:
                        os._exit(0)
                    samples = [ds[i] for i in range(start, start + bs)]
                    if check and _native.same_attr(samples, "dtype") is not dtype:
                        os._exit(3)  # the probe's samples share one dtype: never taken
                    torch.stack(samples, out=self.views[s])
                    h[0] = 2  # DONE
                    self.ready.release()


class CheckedRing(DatasetRing):
    check = True


def measure(name: str, rounds: int) -> None:
    shape, dtype, bs, n = lp.WORK[name]
    ds = lp.Tagged(shape, dtype, n * bs)
    rings: dict[str, Any] = {}
    try:
        for label, cls in (("bare", lp.Ring), ("+getitem", DatasetRing), ("+dtype", CheckedRing)):
            rings[label] = cls(ds, bs, shape, dtype)
        loader = shmloader.DataLoader(ds, batch_size=bs, num_workers=lp.W, prefetch_factor=lp.P,
                                      persistent_workers=True)
        for ring in rings.values():
            for _ in ring.epoch():
                pass
        for _ in loader:
            pass
        rates: dict[str, list[float]] = {label: [] for label in (*rings, "shmloader")}
        for _ in range(rounds):
            for label, ring in rings.items():
                rates[label].append(lp.rate(ring.epoch, bs))
            rates["shmloader"].append(lp.rate(lambda: iter(loader), bs))
        del loader
    finally:
        for ring in rings.values():
            ring.close()
    med = {label: statistics.median(r) for label, r in rates.items()}
    for label, r in rates.items():
        runs = ", ".join(f"{x / 1000:.1f}k" for x in r)
        print(f"{name} {label:10s} {runs}: median {med[label]:,.0f} b/s = {med[label] / med['bare']:.0%} of bare")
    print(f"{name} shmloader = {med['shmloader'] / med['+getitem']:.0%} of +getitem, "
          f"{med['shmloader'] / med['+dtype']:.0%} of +dtype", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workloads", nargs="*", default=["tiny", "tokens", "image"])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    for name in args.workloads:
        measure(name, args.rounds)


if __name__ == "__main__":
    main()
