"""Where a batch's time goes: µs per batch for each step of the path, main process and workers.

Each step is a function of the product; this script wraps it with a ``perf_counter_ns``
accumulator (in the workers too: they are forked after the wrapping), runs a persistent
loader over ready tensors (the bench's ready-tensor workloads: 2 workers, prefetch 2) and prints, per
step, the time inside it per batch and how often it ran. The time a wrapper adds is measured
on an empty function and subtracted once per call, so the nested rows are close to what the
unwrapped code spends; the CPU time of the whole process (``thread_time`` in the main
process, ``/proc`` in the workers) is printed unwrapped, from a second, plain run.

With ``--pin`` the main process runs alone on CPU 0 and the workers share CPU 1, so no worker
preempts the main process: its rows are then its own work, not the wake-ups it causes.

The real workloads of ``shmloader bench`` (memmap, varlen, jpeg, ...) run too, with their own
dataset and collate: their rows then say what the loader adds to the dataset's own work (the
``produce`` row less ``fetch samples``, and the copies a collate_fn's tensors take into the slot).

Usage: python bench/path_profile.py [tiny|tokens|image|memmap|varlen|...] [--batches N] [--pin]
"""

from __future__ import annotations

import argparse
import collections
import os
import pickle
import tempfile
import time
from typing import Any

import torch
from torch.utils.data import Dataset

import shmloader
from shmloader import _native, _stats
from shmloader._bench.measure import usage
from shmloader._bench.workloads import CACHE, WORKLOADS
from shmloader.main import delivery as _delivery
from shmloader.main import iterator as _consume
from shmloader.main import scheduler as _slots
from shmloader.main import wait as _wait
from shmloader.wire import ring as _ring
from shmloader.worker import collate as _collate
from shmloader.worker import loop as _worker
from shmloader.worker import produce as _produce

WORK = {"tiny": ((16,), torch.float32, 32), "tokens": ((512,), torch.int64, 64),
        "image": ((3, 224, 224), torch.uint8, 128)}

# (owner, attribute, label): the main process's steps, then the workers'.
MAIN_STEPS = [
    (_consume.RingIterator, "__next__", "next(): the whole call"),
    (_consume.RingIterator, "_round", "a round: the per-batch pass (never waits)"),
    (_slots.Scheduler, "step", "step: slots back, results in, tasks out (index, write, post: wakes a worker), "
                               "the batch taken (one native call)"),
    (_native, "lend_lone", "one tensor, or a learnt list, tuple or dict of them: header check, table decode, "
                           "views, lease (one native call)"),
    (_delivery, "read_batch", "other batches: header check, table decode, views"),
    (_consume.RingIterator, "_on_event", "step's events: overflow, piped batches, errors, ends of shards"),
    (_wait.Waiter, "block", "wait: sched_yield and look again, then sleep on the ready semaphore"),
    (_ring.YieldWait, "__call__", "  of which sched_yield and look again"),
    (_consume.RingIterator, "_check", "dead workers and timeout (waitpid)"),
    (_stats.Counters, "requested", "counters (telemetry)"),
    (_stats.Counters, "returned", "counters (telemetry), second half"),
]
WORKER_STEPS = [
    (_ring.AttachedRing, "take_task", "wait for a task and read it (task semaphore, header, index)"),
    (_produce.Producer, "_samples", "fetch samples (__getitem__)"),
    (_collate.SlotWriter, "restack", "a batch like the last at its slot, in one step (stack, skeleton, table)"),
    (_collate, "_stack_into_slot", "the general way: stack into the slot (torch.stack out=)"),
    (_collate.SlotWriter, "finish", "skeleton and leaf table"),
    (_collate.SlotWriter, "leaf_id", "  of which its tensors: found in the slot, or copied there (a collate_fn's)"),
    (_worker.Publisher, "publish", "publish (header, DONE, post; doorbell when async waits)"),
    (_produce.Producer, "produce", "produce: fetch + collate + finish"),
]


class Tagged(Dataset):  # type: ignore[type-arg]
    """limit_probe's dataset: ready tensors, no work in ``__getitem__``."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, n: int) -> None:
        self.n = n
        self.items = list(torch.zeros((256, *shape), dtype=dtype).unbind(0))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.items[i % 256]


Acc = dict[str, list[int]]  # label -> [total ns, calls]


def wrap(owner: Any, name: str, label: str, acc: Acc) -> None:
    inner = getattr(owner, name)
    clock = time.perf_counter_ns
    slot = acc.setdefault(label, [0, 0])

    def timed(*args: Any, **kwargs: Any) -> Any:
        began = clock()
        try:
            return inner(*args, **kwargs)
        finally:
            slot[0] += clock() - began
            slot[1] += 1

    setattr(owner, name, timed)


def wrapper_ns() -> float:
    """What one wrapped call adds, measured on an empty function."""
    class Empty:
        @staticmethod
        def f() -> None:
            return None

    acc: Acc = {}
    wrap(Empty, "f", "empty", acc)
    n = 200_000
    began = time.perf_counter_ns()
    for _ in range(n):
        Empty.f()
    total = time.perf_counter_ns() - began
    return total / n - 60  # the bare call and loop, roughly


def _dataset(name: str, batches: int) -> tuple[Dataset, int, Any]:  # type: ignore[type-arg]
    """(dataset, batch size, collate_fn) for ``batches`` batches of ``name``."""
    if name in WORK:
        shape, dtype, bs = WORK[name]
        return Tagged(shape, dtype, bs * batches), bs, None
    w = WORKLOADS[name]
    return w.make(CACHE, False, None, w.batch_size * batches), w.batch_size, w.collate_fn


def run(name: str, batches: int, profile: bool, pin: bool = False) -> tuple[float, float, float, Acc, list[Acc]]:
    dataset, bs, collate_fn = _dataset(name, batches)
    acc: Acc = {}
    out = tempfile.mkdtemp(prefix="shmloader-path-")
    if profile:
        for owner, attr, label in MAIN_STEPS:
            wrap(owner, attr, label, acc)
        worker_acc: Acc = {}
        for owner, attr, label in WORKER_STEPS:
            wrap(owner, attr, label, worker_acc)
        serve = _worker._serve

        def serve_and_dump(*args: Any, **kwargs: Any) -> None:
            try:
                serve(*args, **kwargs)
            finally:
                with open(os.path.join(out, f"{os.getpid()}.pkl"), "wb") as f:
                    pickle.dump(worker_acc, f)

        _worker._serve = serve_and_dump  # type: ignore[assignment]
    loader = shmloader.DataLoader(dataset, batch_size=bs, num_workers=2, prefetch_factor=2, persistent_workers=True,
                                  multiprocessing_context="fork", collate_fn=collate_fn)
    for _ in loader:  # warm-up epoch: the ring exists, the workers are warm
        pass
    for v in acc.values():
        v[0] = v[1] = 0
    it = loader._iterator
    pids = [p.pid for p in it._life.pool.procs]
    if pin:
        os.sched_setaffinity(0, {0})  # the main process alone on CPU 0, the workers on CPU 1
        for pid in pids:
            os.sched_setaffinity(pid, {1})
    workers_before = usage(pids).on_cpu
    began, cpu = time.perf_counter(), time.thread_time()
    for _ in loader:
        pass
    wall, main_cpu = time.perf_counter() - began, time.thread_time() - cpu
    workers_cpu = usage(pids).on_cpu - workers_before
    it._shutdown_workers()
    if pin:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    del it, loader
    worker_accs = []
    for f in os.listdir(out):
        with open(os.path.join(out, f), "rb") as fh:
            worker_accs.append(pickle.load(fh))
        os.remove(os.path.join(out, f))
    os.rmdir(out)
    return wall, main_cpu, workers_cpu, acc, worker_accs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", nargs="?", default="tiny", choices=sorted(set(WORK) | set(WORKLOADS)))
    parser.add_argument("--batches", type=int, default=6000)
    parser.add_argument("--pin", action="store_true", help="main process alone on CPU 0, workers on CPU 1")
    args = parser.parse_args()
    n = args.batches
    wall, main_cpu, workers_cpu, _, _ = run(args.workload, n, profile=False, pin=args.pin)
    print(f"{args.workload}: {n / wall:,.0f} batches/s; CPU µs per batch: main {1e6 * main_cpu / n:.1f}, "
          f"workers {1e6 * workers_cpu / n:.1f} (unwrapped run)")
    over = wrapper_ns()
    _, _, _, acc, worker_accs = run(args.workload, n, profile=True, pin=args.pin)
    worker_total: Acc = collections.defaultdict(lambda: [0, 0])
    for w in worker_accs:  # both epochs of every worker: scale to per batch below
        for label, (ns, calls) in w.items():
            worker_total[label][0] += ns
            worker_total[label][1] += calls
    rows = [("main", label, acc.get(label, [0, 0]), n) for _, _, label in MAIN_STEPS]
    worker_batches = max(1, worker_total["produce: fetch + collate + finish"][1])
    rows += [("worker", label, worker_total[label], worker_batches) for _, _, label in WORKER_STEPS]
    print(f"(a wrapper adds ~{over:.0f} ns per call; subtracted)")
    print("| process | step | µs per batch | calls per batch |")
    print("|---|---|---|---|")
    for who, label, (ns, calls), per in rows:
        us = max(0.0, (ns - calls * over) / per / 1000)
        print(f"| {who} | {label} | {us:.2f} | {calls / per:.2f} |")


if __name__ == "__main__":
    main()
