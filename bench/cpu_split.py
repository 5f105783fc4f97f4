"""Where the CPUs go per batch: user and system time and context switches of the main
process and of the workers, for limit_probe's bare ring and for shmloader, on limit_probe's
workloads (2 workers, prefetch 2, persistent).

Per row: batches/s, then per batch the main process's user and system µs, its voluntary
(slept) and involuntary (preempted) context switches, and the same summed over the workers.
Read from /proc (clock ticks: a run of several epochs is needed for the µs to mean much).
shmloader rows end with the main process's time outside its waits per batch: each epoch's
wall time less the loader's blocked time (``stats().blocked_s``), the median over the epochs;
with ``--place apart`` no worker shares its CPU, so this is its own work.

Experiments (shmloader rows only):
  --extra-us N    add N µs of busy work to every next() (does the main process set the pace?)
  --yields N      the main process's yield bound (the iterator's YieldWait.most; 0: sleep at once)
  --sched-batch   run the workers under SCHED_BATCH (no wake-up preemption of the main process)

Bare ring rows only:
  --bare-extra-us N  add N µs of busy work to every batch the bare ring's consumer yields
                     (how much main-process CPU per batch the ceiling can afford)

--perf adds to every row the main process's and the workers' CPU µs and context switches per
batch from ``perf stat -e task-clock`` (exact, where /proc counts 10 ms ticks).

Placement (both rows; needs two CPUs): --place apart pins the main process alone on CPU 0
and both workers on CPU 1; --place shared pins the main process and worker 0 on CPU 0 and
worker 1 on CPU 1. These are the two ways the scheduler can lay three busy processes on two
vCPUs; --place free (the default) leaves it to the scheduler.

Usage: python bench/cpu_split.py tiny,tokens [--which bare|shml|both] [--epochs 5]
       [--place free|apart|shared] [--perf] [...]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "shared" / "bench"))
import limit_probe as lp  # noqa: E402

import shmloader  # noqa: E402
from placement import place  # noqa: E402
from shmloader import _consume, _worker  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def sample(pid: int) -> tuple[float, ...]:
    """(voluntary switches, involuntary switches, user s, system s) of ``pid``."""
    vol = inv = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                vol = int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                inv = int(line.split()[1])
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return vol, inv, int(fields[11]) / TICK, int(fields[12]) / TICK


class TaskClock:
    """``perf stat -e task-clock`` on ``pids`` from now until ``stop()``: CPU time to the
    nanosecond and context switches, where /proc counts clock ticks."""

    def __init__(self, pids: list[int]) -> None:
        self.perf = subprocess.Popen(["perf", "stat", "-x,", "-e", "task-clock,context-switches", "-p",
                                      ",".join(map(str, pids))], stderr=subprocess.PIPE, text=True)
        time.sleep(0.3)  # perf attaches before the measured epochs begin

    def stop(self) -> tuple[float, float]:
        """(CPU seconds, context switches) of the processes, summed."""
        self.perf.send_signal(signal.SIGINT)
        counts = {}
        for line in self.perf.communicate()[1].splitlines():
            fields = line.split(",")
            if len(fields) > 2 and fields[0].replace(".", "", 1).isdigit():
                counts[fields[2]] = float(fields[0])
        return counts["task-clock"] / 1e3, counts["context-switches"]


def measure(label: str, epoch: Callable[[], Any], pids: list[int], epochs: int, stats: Any = None,
            perf: bool = False) -> None:
    """One row. ``stats``: shmloader's counters, whose ``blocked_s`` gives the main process's
    time outside its waits (the row's last figure: the median over the epochs). ``perf``: the
    row ends with the main process's and the workers' CPU µs per batch as perf's task-clock
    counts them."""
    clocks = [TaskClock([os.getpid()]), TaskClock(pids)] if perf else []
    workers0, main0, began = [sample(p) for p in pids], sample(os.getpid()), time.perf_counter()
    n, outside = 0, []
    for _ in range(epochs):
        blocked, start = stats.blocked_s if stats else 0.0, time.perf_counter()
        k = sum(1 for _ in epoch())
        if stats:
            outside.append((time.perf_counter() - start - (stats.blocked_s - blocked)) / k)
        n += k
    wall = time.perf_counter() - began
    workers1, main1 = [sample(p) for p in pids], sample(os.getpid())
    main = [(b - a) / n for a, b in zip(main0, main1)]
    work = [sum(w1[i] - w0[i] for w0, w1 in zip(workers0, workers1)) / n for i in range(4)]
    print(f"{label}: {n / wall:7.0f} b/s | main usr {main[2] * 1e6:4.1f} sys {main[3] * 1e6:4.1f} µs, "
          f"slept {main[0]:.2f} preempted {main[1]:.2f} | workers usr {work[2] * 1e6:4.1f} sys {work[3] * 1e6:4.1f} µs, "
          f"slept {work[0]:.2f} preempted {work[1]:.2f}"
          + (f" | main outside waits {statistics.median(outside) * 1e6:.2f} µs" if outside else "")
          + "".join(f" | {who} task-clock {cpu / n * 1e6:.2f} µs, {switches / n:.2f} switches"
                    for who, (cpu, switches) in zip(("main", "workers"), (c.stop() for c in clocks))), flush=True)


def busy(epoch: Callable[[], Any], us: float) -> Callable[[], Any]:
    """``epoch`` with ``us`` µs of busy work in the consumer after every batch."""
    if not us:
        return epoch
    clock = time.perf_counter

    def slower() -> Any:
        for batch in epoch():
            until = clock() + us * 1e-6
            while clock() < until:
                pass
            yield batch

    return slower


def experiments(args: argparse.Namespace) -> None:
    if args.extra_us:
        extra, plain_next, clock = args.extra_us * 1e-6, _consume.RingIterator.__next__, time.perf_counter

        def slower_next(self: Any) -> Any:
            until = clock() + extra
            while clock() < until:
                pass
            return plain_next(self)

        _consume.RingIterator.__next__ = slower_next  # type: ignore[method-assign]
    if args.sched_batch:
        plain_init = _worker._init

        def batch_init(cfg: Any) -> Any:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            return plain_init(cfg)

        _worker._init = batch_init  # workers fork after this: they run it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", help="comma-separated: tiny,tokens,image")
    parser.add_argument("--which", choices=["bare", "shml", "both"], default="both")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--extra-us", type=float, default=0.0)
    parser.add_argument("--yields", type=int)
    parser.add_argument("--sched-batch", action="store_true")
    parser.add_argument("--bare-extra-us", type=float, default=0.0)
    parser.add_argument("--place", choices=["free", "apart", "shared"], default="free")
    parser.add_argument("--perf", action="store_true", help="also perf's task-clock per batch (needs perf)")
    args = parser.parse_args()
    experiments(args)
    for name in args.workloads.split(","):
        shape, dtype, bs, n = lp.WORK[name]
        ds = lp.Tagged(shape, dtype, n * bs)
        if args.which in ("both", "bare"):
            ring = lp.Ring(ds, bs, shape, dtype)
            for _ in ring.epoch():
                pass
            place(args.place, ring.pids)
            measure(f"{name} bare ring", busy(ring.epoch, args.bare_extra_us), ring.pids, args.epochs, perf=args.perf)
            place("free", ring.pids)
            ring.close()
        if args.which in ("both", "shml"):
            loader = shmloader.DataLoader(ds, batch_size=bs, num_workers=2, prefetch_factor=2, persistent_workers=True)
            it = iter(loader)
            if args.yields is not None:
                it.yields.most = it.yields.bound = args.yields
                it.yields.least = min(it.yields.least, args.yields)
            for _ in it:
                pass
            pids = [p.pid for p in it._pool.procs]
            place(args.place, pids)
            measure(f"{name} shmloader", lambda: iter(loader), pids, args.epochs, loader._shm_counters, args.perf)
            place("free", pids)
            it._shutdown_workers()


if __name__ == "__main__":
    main()
