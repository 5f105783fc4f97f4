"""How a sync ``next()`` waits, against the bare ring: shipped, and sleeping at once.

limit_probe's bare ring and shmloader loaders over the same dataset (2 workers, prefetch 2,
persistent), alternated epoch by epoch in one process, each round starting with another:
- ``ring``: limit_probe's ``Ring`` (its main process sleeps on the ready semaphore at once);
- ``shipped``: ``shmloader.DataLoader`` as it is (``sched_yield`` and look again, a bounded
  number of times, then sleep: ``RingIterator._yield_for_ready``);
- ``sleep``: the same loader whose iterator skips the yields and sleeps at once;
- ``yieldsN``: the shipped policy with N as its most yields (``yields0`` is ``sleep``).

Per variant: the median batches/s and the median of each round's ratio to the first variant;
then, per batch, the wall time, the workers' CPU (user + system from ``/proc``, of the two
workers' wall time) and the main process's CPU (``thread_time``); for the shmloader variants
the workers' own time producing a batch (their BUSY_NS counter) and waiting for the next task
(``take_task``, timed as in ``bench/handoff.py``).

Usage: python bench/wait_policy.py image [tokens ...] [--rounds 12] [--variants ring,shipped,sleep]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import handoff  # noqa: E402
from handoff import lp  # noqa: E402

import shmloader  # noqa: E402
from shmloader import _ring  # noqa: E402
from shmloader._bench.measure import cpu_seconds  # noqa: E402
from shmloader._layout import Counter  # noqa: E402


def _loader(ds: Any, kw: dict[str, Any], which: int, variant: str) -> Any:
    handoff._LOADER[0] = which  # the forked workers' rows of the task-wait accumulator
    loader = shmloader.DataLoader(ds, num_workers=2, prefetch_factor=2, persistent_workers=True, **kw)
    for _ in loader:  # the warm-up epoch forks the workers and sizes the ring
        pass
    _ = None  # the last batch would hold its slot
    if variant != "shipped":
        most = 0 if variant == "sleep" else int(variant.removeprefix("yields"))
        waits = loader._iterator.yields  # the iterator's YieldWait, as shipped but for its bounds
        waits.most = waits.bound = most
        waits.least = min(waits.least, most)
    return loader


def run(name: str, rounds: int, variants: list[str]) -> None:
    ds, kw = handoff.dataset(name)
    loaders = {v: _loader(ds, kw, i, v) for i, v in enumerate(x for x in variants if x != "ring")}
    ring = None
    if "ring" in variants:
        shape, dtype, bs, _n = lp.WORK[name]
        ring = lp.Ring(ds, bs, shape, dtype)
        for _ in ring.epoch():
            pass
    pids = {v: ring.pids if v == "ring" else [p.pid for p in loaders[v]._iterator._pool.procs] for v in variants}
    before = {v: [(int(c[Counter.BUSY_NS]), int(c[Counter.BATCHES])) for c in loaders[v]._iterator._ring.counters]
              for v in loaders}
    handoff._ACC[:] = 0
    rates: dict[str, list[float]] = {v: [] for v in variants}
    wall, workers, main = dict.fromkeys(variants, 0.0), dict.fromkeys(variants, 0.0), dict.fromkeys(variants, 0.0)
    batches = dict.fromkeys(variants, 0)
    try:
        for r in range(rounds):
            for v in variants[r % len(variants):] + variants[: r % len(variants)]:
                cpu0, main0 = cpu_seconds(pids[v]), time.thread_time()
                began, k = time.perf_counter(), 0
                for _ in ring.epoch() if v == "ring" else loaders[v]:  # type: ignore[union-attr]
                    k += 1
                _ = None
                spent = time.perf_counter() - began
                rates[v].append(k / spent)
                wall[v] += spent
                workers[v] += cpu_seconds(pids[v]) - cpu0
                main[v] += time.thread_time() - main0
                batches[v] += k
        base = variants[0]
        for v in variants:
            ratios = [a / b for a, b in zip(rates[v], rates[base])]
            n = batches[v]
            line = (f"{name} {v:8} {statistics.median(rates[v]):8,.0f} b/s, / {base} {statistics.median(ratios):.3f} "
                    f"| µs a batch: wall {wall[v] / n * 1e6:.1f}, workers' CPU {workers[v] / n * 1e6:.1f} "
                    f"(of {2 * wall[v] / n * 1e6:.1f}), main CPU {main[v] / n * 1e6:.1f}")
            if v in loaders:
                counters, which = loaders[v]._iterator._ring.counters, list(loaders).index(v)
                for wid in range(2):
                    made = int(counters[wid][Counter.BATCHES]) - before[v][wid][1]
                    busy = (int(counters[wid][Counter.BUSY_NS]) - before[v][wid][0]) / 1e3 / made
                    wait = handoff._ACC[16 * which + 4 * wid] / 1e3 / made
                    line += f"; w{wid} produce {busy:.0f}, task wait {wait:.0f}"
            print(line, flush=True)
        print(f"{name} per-round ratios to {base}: " + "; ".join(
            f"{v} " + " ".join(f"{a / b:.2f}" for a, b in zip(rates[v], rates[base])) for v in variants[1:]), flush=True)
    finally:
        if ring is not None:
            ring.close()
        for loader in loaders.values():
            loader._iterator._shutdown_workers()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workloads", nargs="+", choices=list(lp.WORK))
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--variants", default="ring,shipped,sleep")
    args = ap.parse_args()
    _ring.AttachedRing.take_task = handoff._timed(_ring.AttachedRing.take_task, 0)  # type: ignore[method-assign]
    for name in args.workloads:
        run(name, args.rounds, args.variants.split(","))


if __name__ == "__main__":
    main()
