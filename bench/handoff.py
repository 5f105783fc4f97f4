"""How long a finished batch waits for the main process, and what a worker does meanwhile.

Two loaders over the same dataset, alternated epoch by epoch in one process (2 workers,
prefetch 2, persistent): ``yield`` as shipped, where a worker whose batch took longer than
``shmloader._worker.LONG_BATCH_NS`` gives its CPU away once after publishing it, and
``no-yield``, the same with that threshold out of reach (set before its workers fork). For
each it prints batches/s, and per batch and worker: the time spent producing it, the time
waiting for its next task (``take_task``, less waits over IDLE_NS: those between epochs;
a task that came at once still takes a few µs)
and the publish. A worker waits for a task when the main process is late to take the batch
before: with every CPU running a worker, a main process that yields its CPU waits in a run
queue until a worker lets it run.

Workloads: limit_probe's (``tiny``, ``tokens``, ``image``: ready tensors) and the bench's
(``memmap``, ``varlen``, ``jpeg``).

Usage: python bench/handoff.py image [memmap ...] [--rounds 12]
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "shared" / "bench"))
import limit_probe as lp  # noqa: E402

import shmloader  # noqa: E402
from shmloader import _ring, _worker  # noqa: E402
from shmloader._bench.workloads import CACHE, WORKLOADS  # noqa: E402
from shmloader._layout import Counter  # noqa: E402

# Per worker id (0, 1) and loader (0, 1): task-wait ns, publish ns. Shared with the workers
# (an anonymous shared mapping made before they fork).
_ACC = np.frombuffer(mmap.mmap(-1, 4096), np.int64)
_LOADER = [0]  # which loader the next fork belongs to (inherited by its workers)


def _slot(field: int) -> int:
    info = torch.utils.data.get_worker_info()
    assert info is not None
    return 16 * _LOADER[0] + 4 * info.id + field


IDLE_NS = 20_000_000  # a longer wait for a task is the gap between this loader's epochs: not counted


def _timed(fn: Any, field: int) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.monotonic_ns()
        result = fn(*args, **kwargs)
        spent = time.monotonic_ns() - began
        if spent < IDLE_NS:
            _ACC[_slot(field)] += spent
        return result
    return timed


def dataset(name: str) -> tuple[Any, dict[str, Any]]:
    if name in lp.WORK:
        shape, dtype, bs, n = lp.WORK[name]
        return lp.Tagged(shape, dtype, n * bs), {"batch_size": bs}
    w = WORKLOADS[name]
    ds = w.make(CACHE, False, None, 300 * w.batch_size)
    kw: dict[str, Any] = {"batch_size": w.batch_size, "shuffle": True}
    if w.collate_fn is not None:
        kw["collate_fn"] = w.collate_fn
    return ds, kw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workloads", nargs="+", choices=[*lp.WORK, "memmap", "varlen", "jpeg"])
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    _ring.AttachedRing.take_task = _timed(_ring.AttachedRing.take_task, 0)  # type: ignore[method-assign]
    _worker._publish = _timed(_worker._publish, 1)
    shipped = _worker.LONG_BATCH_NS
    for name in args.workloads:
        ds, kw = dataset(name)
        loaders = []
        for which, threshold in enumerate((shipped, 1 << 62)):
            _LOADER[0], _worker.LONG_BATCH_NS = which, threshold
            loader = shmloader.DataLoader(ds, num_workers=2, prefetch_factor=2, persistent_workers=True, **kw)
            for _ in loader:  # the warm-up epoch forks the workers
                pass
            _ = None
            loaders.append(loader)
        _worker.LONG_BATCH_NS = shipped
        rates: list[list[float]] = [[], []]
        _ACC[:] = 0
        before = [[(int(c[Counter.BUSY_NS]), int(c[Counter.BATCHES])) for c in ld._iterator._ring.counters]
                  for ld in loaders]
        for r in range(args.rounds):
            for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                began, k = time.perf_counter(), 0
                for _ in loaders[which]:
                    k += 1
                rates[which].append(k / (time.perf_counter() - began))
                _ = None  # the last batch would hold its slot into the loader's next epoch
        for which, label in enumerate(("yield", "no-yield")):
            counters = loaders[which]._iterator._ring.counters
            parts = []
            for wid in range(2):
                busy = int(counters[wid][Counter.BUSY_NS]) - before[which][wid][0]
                n = int(counters[wid][Counter.BATCHES]) - before[which][wid][1]
                wait, publish = (_ACC[16 * which + 4 * wid + f] / 1e3 / n for f in (0, 1))
                parts.append(f"w{wid} produce {busy / 1e3 / n:.0f}, task wait {wait:.0f}, publish {publish:.1f}")
            print(f"{name} {label:8} {statistics.median(rates[which]):8,.0f} b/s | µs a batch: " + "; ".join(parts))
        ratios = [a / b for a, b in zip(*rates)]
        print(f"{name} yield / no-yield, epoch by epoch: median {statistics.median(ratios):.3f} "
              f"({' '.join(f'{x:.2f}' for x in ratios)})", flush=True)
        del loaders


if __name__ == "__main__":
    main()
