"""Measuring one loader on one workload: rate, first batch, CPU per batch, peak memory.

CPU and memory are summed over this process and all its descendants (the loader's
workers, whatever started them), read from /proc. Memory is the tree's PSS (proportional
set size) without its shared-memory part, plus the growth of the system's shared memory
(``Shmem`` in /proc/meminfo) since the measurement began. PSS alone would miss shared
memory that exists but that no process has touched through a mapping: torch's loader
creates a segment per batch in a worker, which unmaps it once sent, and a consumer that
does not read the batch never faults it in, so its batches in flight were invisible to
PSS (measured: 18 MB of PSS for 92 MB of segments on the image workload).
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import os
import random
import resource
import statistics
import threading
import time
from typing import Any, Callable

import torch

from shmloader import _torch_private as torch_private

from .neighbours import RUNNING

_TICK = os.sysconf("SC_CLK_TCK")


def _tree(root: int) -> list[int]:
    """``root`` and its live descendants, less the bench's neighbours (``--neighbours``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in RUNNING:
            continue
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


@dataclasses.dataclass
class Usage:
    """Time on CPU (every thread's, live or exited, ns-precise), user and system ticks, and
    context switches (voluntary and not, of the live threads) of some processes. Ticks are 10
    ms: alone they would round a short run's workers to nothing, so they only split the time
    on CPU into user and system."""

    on_cpu: float = 0.0
    user_ticks: int = 0
    system_ticks: int = 0
    switches: int = 0

    def __sub__(self, other: Usage) -> Usage:
        return Usage(self.on_cpu - other.on_cpu, self.user_ticks - other.user_ticks,
                     self.system_ticks - other.system_ticks, self.switches - other.switches)

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.on_cpu + other.on_cpu, self.user_ticks + other.user_ticks,
                     self.system_ticks + other.system_ticks, self.switches + other.switches)

    @property
    def user(self) -> float:
        ticks = self.user_ticks + self.system_ticks
        return self.on_cpu * (self.user_ticks / ticks if ticks > 0 else 1.0)

    @property
    def system(self) -> float:
        return self.on_cpu - self.user


_LIBC = ctypes.CDLL(None, use_errno=True)


def _process_cpu(pid: int) -> float | None:
    """Seconds on CPU of every thread ``pid`` ever had (its process CPU-time clock), or None."""
    clock = ctypes.c_int()
    if _LIBC.clock_getcpuclockid(pid, ctypes.byref(clock)) != 0:
        return None
    try:
        return time.clock_gettime_ns(clock.value) / 1e9
    except OSError:
        return None  # gone meanwhile


def usage(pids: list[int]) -> Usage:
    """``pids``' CPU time and context switches so far (the process CPU-time clock,
    ``/proc/PID/stat`` and each thread's ``status``); a process gone meanwhile counts nothing."""
    return sum(_each(pids).values(), Usage())


def _each(pids: list[int]) -> dict[int, Usage]:
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            switches = 0
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/status") as f:
                    switches += sum(int(line.split()[1]) for line in f if "ctxt_switches:" in line)
        except (OSError, IndexError, ValueError):
            continue
        on_cpu = _process_cpu(pid)
        if on_cpu is not None:
            out[pid] = Usage(on_cpu, int(fields[11]), int(fields[12]), switches)
    return out


def _reaped() -> Usage:
    """What the children this process reaped used, theirs and their own reaped children's."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return Usage(r.ru_utime + r.ru_stime, round(r.ru_utime * _TICK), round(r.ru_stime * _TICK),
                 r.ru_nvcsw + r.ru_nivcsw)


class TreeUsage:
    """The CPU of this process and of its descendants (the loader's workers, threads included)
    from now until ``stop()``, whichever of them exit meanwhile or start (a loader that
    restarts its workers each epoch): the live ones' own clocks, and what the exited ones
    used, once reaped. This process's includes the memory sampler's thread (``PeakMemory``:
    about 1% of a CPU, the same for every loader)."""

    def __init__(self) -> None:
        self.main = os.getpid()
        self._start = self._read()

    def _read(self) -> tuple[Usage, dict[int, Usage], Usage]:
        workers = _each([pid for pid in _tree(self.main) if pid != self.main])
        r = resource.getrusage(resource.RUSAGE_SELF)  # (every thread's, exited ones' too)
        main = Usage(time.process_time(), round(r.ru_utime * _TICK), round(r.ru_stime * _TICK),
                     r.ru_nvcsw + r.ru_nivcsw)
        return main, workers, _reaped()

    def stop(self) -> tuple[Usage, Usage]:
        """(main process, workers) used since the start."""
        main0, live0, reaped0 = self._start
        main1, live1, reaped1 = self._read()
        workers = reaped1 - reaped0
        for pid, used in live1.items():
            workers = workers + (used - live0.get(pid, Usage()))
        for pid, used in live0.items():
            if pid not in live1:  # exited: its whole life is in what was reaped; its past is not ours
                workers = workers - used
        return main1 - main0, workers


def pss_bytes(pids: list[int], shared: bool = True) -> int:
    """PSS of ``pids``; without ``shared``, less the part that maps shared memory."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                    elif line.startswith("Pss_Shmem:") and not shared:
                        total -= int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def shmem_bytes() -> int:
    """Shared memory in use on the system (tmpfs and shm pages, mapped or not)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakMemory:
    """Samples the memory of the process tree in a thread: its PSS without shared memory, plus
    the shared memory created since this object was.

    The two parts are read at different rates. Shared memory (one line of /proc/meminfo) is
    where a loader's batches in flight live and changes batch by batch: read every
    ``interval`` seconds. PSS (smaps_rollup, which walks every process's page tables under
    its mmap lock) changes slowly and costs 7.5 ms of CPU per read of a loader's tree on a
    2-vCPU machine: read every ``pss_interval`` seconds, and whenever ``sample`` is called
    (``measure`` calls it once the loader's workers run and again before they stop, so a
    run shorter than ``pss_interval`` is measured too). Read every 50 ms, PSS took 15% of a
    CPU and stalled the workers' page faults: the memmap workload lost about 12% of its rate."""

    def __init__(self, interval: float = 0.05, pss_interval: float = 1.0) -> None:
        self._shmem0 = shmem_bytes()
        self._lock = threading.Lock()
        self._pss = 0
        self.peak = 0
        # The tree's PSS with its shared pages, as a user's psutil or smem reads it: shared
        # memory counts only where a process of the tree has touched it (torch's batches that
        # the loop kept and never read live in /dev/shm and in no process's PSS).
        self.tree_peak = 0
        self.sample()
        self._interval = interval
        self._every = max(1, round(pss_interval / interval))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self, pss: bool = True) -> None:
        """Read the shared memory (and the tree's PSS) now; keep the peak of their sum."""
        with self._lock:
            if pss:
                tree = _tree(os.getpid())
                self._pss = pss_bytes(tree, shared=False)
                self.tree_peak = max(self.tree_peak, pss_bytes(tree))
            self.peak = max(self.peak, self._pss + max(0, shmem_bytes() - self._shmem0))

    def _run(self) -> None:
        ticks = 0
        while not self._stop.wait(self._interval):
            ticks += 1
            self.sample(pss=ticks % self._every == 0)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.peak


def read(batch: Any) -> None:
    """Touch every page of a batch's tensors, as a training step that reads them does (a byte a
    page: nothing allocated, whatever the dtype)."""
    if isinstance(batch, torch.Tensor):
        if batch.is_contiguous() and batch.numel():
            int(batch.reshape(-1).view(torch.uint8)[::4096].sum())
        else:
            batch.sum()
    elif isinstance(batch, dict):
        for v in batch.values():
            read(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            read(v)


def batch_bytes(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    if isinstance(batch, dict):
        return sum(batch_bytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(batch_bytes(v) for v in batch)
    return 0


@dataclasses.dataclass
class Result:
    workload: str
    loader: str
    batches_per_s: float  # median of repeats
    batches_per_s_min: float
    batches_per_s_max: float
    gb_per_s: float
    first_batch_s: float
    cpu_ms_per_batch: float
    peak_mb: float  # peak memory of the process tree while the loader ran (see the module docstring)
    loader_mb: float  # that peak minus this process's PSS before the loader existed
    batch_bytes: int
    ratio_to_torch: float | None = None
    ring_mb: float | None = None  # shmloader: the ring's size
    loader_bound: float | None = None  # shmloader: stats().loader_bound
    advice: str | None = None  # shmloader: stats().advice (loader_bound and worker_busy read together)
    within_budget: bool | None = None
    skipped: str | None = None
    overflow_share: float | None = None  # shmloader, epoch workloads: overflow batches after epoch 1 / batches
    ring_growths: int | None = None
    slot_bytes: int | None = None
    rounds: int = 1  # runs merged into this result (shmloader bench --rounds)
    round_rates: list[float] | None = None  # with --rounds: each round's median batches/s, in round order
    ratio_to_ceiling: float | None = None  # with --ceiling: the median of each round's ratio to the bare ring's
    cpu_us: CpuSplit | None = None  # CPU µs and context switches per batch, main process and workers
    next_us: list[float] | None = None  # a next() call's 50th, 90th and 99th percentile, µs
    neighbours: int = 0  # with --neighbours: CPU-bound processes running beside the loader
    ratio_to_alone: float | None = None  # with --neighbours: the median of each round's ratio to its own rate alone


@dataclasses.dataclass
class CpuSplit:
    """Per batch: CPU µs (user, system) of the main process and of the workers together, and
    their context switches (voluntary and not)."""

    main_user: float
    main_system: float
    workers_user: float
    workers_system: float
    main_switches: float
    workers_switches: float


@dataclasses.dataclass
class MemoryResult:
    workload: str
    loader: str
    persistent_workers: bool
    peak_mb: float  # the median over rounds of the peak above the baseline (``peak_memory``)
    round_mb: list[float]  # each round's, in round order
    ratio_to_torch: float | None  # the median of each round's ratio to torch's peak (None without torch)
    tree_pss_mb: float = 0.0  # the median over rounds of the tree's PSS peak (shared pages included)
    tree_ratio_to_torch: float | None = None  # the median of each round's ratio to torch's


def peak_memory(make: Callable[[], Any], epochs: int, hold: bool) -> tuple[float, float]:
    """MiB of the peaks, above the baseline just before the loader existed, while ``epochs``
    epochs run: of the process tree's private PSS plus the system's shared-memory growth (what
    the machine gave), and of the tree's PSS with its shared pages (what psutil or smem would
    say). The loop is a user's: it reads each batch, and ``batch`` stays bound from one epoch's
    end into the next's start; with ``hold`` (a replay buffer) every batch is kept and a random
    kept one is read instead. The tree's PSS is read every 10 batches as well as by the sampling thread, so a
    short run's workers count."""
    gc.collect()
    tree = _tree(os.getpid())
    baseline, tree_baseline = pss_bytes(tree, shared=False), pss_bytes(tree)
    memory = PeakMemory(interval=0.01, pss_interval=0.5)
    loader = make()
    kept = []
    batch = None
    replay = random.Random(0)
    for _ in range(epochs):
        for i, batch in enumerate(loader):
            if hold:  # a replay buffer: it keeps the batch, and trains on a random kept one
                kept.append(batch)
                read(kept[replay.randrange(len(kept))])
            else:  # a training step reads its batch
                read(batch)
            memory.sample(pss=i % 10 == 0)
        memory.sample()
    peak = memory.stop()
    del kept, batch
    _close(loader)
    return (peak - baseline) / 2**20, (memory.tree_peak - tree_baseline) / 2**20


def measure(
    workload: str,
    loader_name: str,
    make: Callable[[], Any],
    batches: int,
    repeats: int,
    step_s: float = 0.0,
    epochs: bool = False,
    hold: bool = False,
    settle_s: float = 0.0,
    least_s: float = 0.0,
) -> Result:
    """Time ``repeats`` runs of ``batches`` batches of one loader: one epoch holds them all,
    or with ``epochs`` each run is one epoch (after a first, unmeasured one). With ``hold``
    the loop keeps every batch of a run until the run ends. Without ``epochs``, the loader may
    first run ``settle_s`` seconds untimed (its depth adapts, the scheduler places its
    processes), and each run lasts ``least_s`` seconds at least, in whole runs of ``batches``
    (the dataset must hold them: ``--neighbours`` makes it long enough)."""
    gc.collect()  # the last loader's garbage goes before this one's baseline, as in peak_memory
    baseline = pss_bytes([os.getpid()], shared=False)
    memory = PeakMemory()
    start = time.perf_counter()
    loader = make()
    it = iter(loader)
    first = next(it)
    first_s = time.perf_counter() - start
    memory.sample()  # the workers run: their PSS counts even if the run is short
    nbytes = batch_bytes(first)
    del first
    if epochs:  # the rest of the first epoch: the warm-up the ring adapts in
        for _ in it:
            pass
    else:
        settled = time.perf_counter() + settle_s
        while time.perf_counter() < settled:
            next(it)
    overflow_before = loader.stats().overflow_batches if hasattr(loader, "stats") else 0
    cpu_use = TreeUsage()
    rates, waits = [], []
    clock = time.perf_counter
    n = 0
    for _ in range(repeats):
        if epochs:
            it = iter(loader)
        kept = []
        t = clock()
        done = 0
        while not done or (not epochs and clock() - t < least_s):
            for _ in range(batches):
                asked = clock()
                batch = next(it)
                waits.append(clock() - asked)
                if step_s:
                    _spin(step_s)
                if hold:
                    kept.append(batch)
                del batch
            done += batches
        rates.append(done / (clock() - t))
        n += done
        del kept
    main_use, workers_use = cpu_use.stop()
    cpu = (main_use.on_cpu + workers_use.on_cpu) / n
    waits.sort()
    memory.sample()  # before the loader stops
    stats = loader.stats() if hasattr(loader, "stats") else None
    ring = getattr(it, "ring", None)  # a ring iterator's (None when it has none)
    del it
    peak = memory.stop()
    _close(loader)
    med = statistics.median(rates)
    return Result(
        workload=workload,
        loader=loader_name,
        batches_per_s=med,
        batches_per_s_min=min(rates),
        batches_per_s_max=max(rates),
        gb_per_s=med * nbytes / 1e9,
        first_batch_s=first_s,
        cpu_ms_per_batch=cpu * 1e3,
        peak_mb=peak / 2**20,
        loader_mb=(peak - baseline) / 2**20,
        batch_bytes=nbytes,
        ring_mb=None if ring is None else ring.geometry.total_bytes / 2**20,
        loader_bound=None if stats is None else stats.loader_bound,
        advice=None if stats is None else stats.advice,
        overflow_share=(None if stats is None or not epochs
                        else (stats.overflow_batches - overflow_before) / n),
        ring_growths=None if stats is None else stats.ring_growths,
        slot_bytes=None if ring is None else ring.geometry.data_bytes,
        cpu_us=CpuSplit(1e6 * main_use.user / n, 1e6 * main_use.system / n, 1e6 * workers_use.user / n,
                        1e6 * workers_use.system / n, main_use.switches / n, workers_use.switches / n),
        next_us=[1e6 * waits[min(len(waits) - 1, int(q * len(waits)))] for q in (0.5, 0.9, 0.99)],
    )


def _spin(seconds: float) -> None:
    """A stand-in for a training step that keeps the CPU busy, as real compute would."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _close(loader: Any) -> None:
    if hasattr(loader, "close"):  # the bare ring
        loader.close()
    torch_private.shutdown_workers(torch_private.kept_iterator(loader))
