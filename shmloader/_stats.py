"""Telemetry: what the loader did, and whether the training loop waits for it.

``Counters`` is the loader's running tally (updated on every batch, cheaply);
``LoaderStats`` is the frozen snapshot ``DataLoader.stats()`` returns.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from shmloader.main.scheduler import Scheduler, SlotState
from shmloader.wire.layout import Counter


class Counters:
    """Mutable tallies kept across the loader's iterators (epochs)."""

    __slots__ = ("batches", "bytes", "wait_s", "blocked_s", "waits", "compute_s", "copies", "worker_restarts",
                 "overflow_batches", "ring_growths", "_last_return")

    def __init__(self) -> None:
        self.batches = 0
        self.bytes = 0
        self.wait_s = 0.0
        self.blocked_s = 0.0  # the part of wait_s spent blocked (semaphore, event loop, pipes)
        self.waits = 0  # the blocked waits it took (main.depth: how long one is)
        self.compute_s = 0.0
        self.copies = 0
        self.worker_restarts = 0
        self.overflow_batches = 0
        self.ring_growths = 0
        self._last_return: float | None = None

    def requested(self, now: float | None = None) -> float:
        """The consumer asks for a batch (at ``now``, or now): the time since the last one was
        its own work."""
        if now is None:
            now = time.perf_counter()
        if self._last_return is not None:
            self.compute_s += now - self._last_return
        return now

    def returned(self, asked: float) -> None:
        """A batch (or the end of the epoch) was handed back after waiting since ``asked``."""
        now = time.perf_counter()
        self.wait_s += now - asked
        self._last_return = now

    def epoch_ended(self) -> None:
        self._last_return = None  # time between epochs is not the loop's compute


@dataclasses.dataclass(frozen=True)
class RingOccupancy:
    """Where the ring's slots are right now."""

    slots: int
    """Slots in the ring: ``num_workers * prefetch_factor + 1`` unless ``memory_budget`` lowered
    it. When the depth adapts: torch's default (2) until it first grows, then the deepest it may
    grow to."""
    slot_bytes: int
    """Bytes of one slot's data region."""
    free: int
    """Slots waiting for a task."""
    in_flight: int
    """Slots a worker is filling (or has filled, not yet collected)."""
    ready: int
    """Slots holding a finished batch the consumer has not taken yet (or copying to the device)."""
    held: int
    """Slots whose batch the consumer still holds (views not yet dropped)."""


@dataclasses.dataclass(frozen=True)
class LoaderStats:
    """A snapshot of ``DataLoader.stats()``. Times are seconds of wall-clock time."""

    batches: int
    """Batches delivered to the consumer since the loader was created."""
    bytes: int
    """Bytes of tensor and array data in those batches."""
    wait_s: float
    """Time the consumer spent inside ``next()`` / ``__anext__`` waiting for batches."""
    compute_s: float
    """Time between receiving a batch and asking for the next: the consumer's own work."""
    copies: int
    """Batches delivered as copies: the consumer held every slot its workers could spare (a loop
    that keeps every batch: batches under a MiB are copied while it does), or memory_budget
    left no room but what the consumer held."""
    worker_restarts: int
    """Workers replaced after dying."""
    overflow_batches: int
    """Batches that did not fit a ring slot and came through overflow shared memory (still zero-copy)."""
    ring_growths: int
    """Times the ring was made again: with larger slots after oversized batches (``ring.slot_bytes``
    is the current size), or with more of them when an adaptive depth first grew past torch's."""
    worker_busy: tuple[float, ...]
    """Per worker, the fraction of time since it started that it spent producing batches."""
    ring: RingOccupancy | None
    """Slot occupancy of the current ring, or None before the first batch / without workers."""
    blocked_s: float = 0.0
    """The part of ``wait_s`` spent blocked, waiting for workers (or a device copy); the rest
    is the loader's own per-batch work in the consumer's process."""
    depth: int = 0
    """Batches in flight per worker now (torch's ``prefetch_factor``): the one given, or, without
    it, the depth that adapts (torch's default 2, deeper for small batches while the loop waits
    on idle workers, each wait a scheduler's: beside CPU-bound neighbours)."""
    depth_why: str = ""
    """Why ``depth`` is what it is, in one sentence."""

    @property
    def loader_bound(self) -> float:
        """Share of the loop's time spent waiting for data: near 0 means the loader keeps up;
        near 1 means the loop is starved and more workers (or cheaper samples) would help."""
        total = self.wait_s + self.compute_s
        return self.wait_s / total if total > 0 else 0.0

    @property
    def advice(self) -> str:
        """What ``loader_bound`` and ``worker_busy`` say together, in one sentence: the loader
        keeps up (at most 10% of the loop's time waiting); or the loop waits and the workers
        are busy (80% or more on average: add workers or make samples cheaper); or the loop
        waits while the workers idle (the ring is too shallow: raise prefetch_factor); or the
        time in ``next()`` is mostly the loader's own work, not blocking (tiny batches)."""
        bound = self.loader_bound
        if bound <= 0.1:
            return f"loader-bound {bound:.0%}: the loader keeps up; more workers would not help"
        if self.wait_s > 0 and self.blocked_s < 0.5 * self.wait_s and self.batches:
            per_batch = (self.wait_s - self.blocked_s) / self.batches * 1e6
            return (f"loader-bound {bound:.0%}, mostly the loader's own work in your process "
                    f"({per_batch:.0f} µs a batch): batches this cheap are transport-bound; "
                    "larger batches spread that cost")
        if not self.worker_busy:
            return f"loader-bound {bound:.0%}: the loop waits for data; more workers or cheaper samples would help"
        busy = sum(self.worker_busy) / len(self.worker_busy)
        if busy >= 0.8:
            return (f"loader-bound {bound:.0%}, workers {busy:.0%} busy: the workers are the bottleneck; "
                    "add workers or make samples cheaper")
        return (f"loader-bound {bound:.0%}, workers only {busy:.0%} busy: the ring is too shallow for the "
                "loop's pace; raise prefetch_factor (or leave it out: the depth then adapts beside CPU-bound "
                "neighbours)")


def occupancy(sched: Scheduler, slot_bytes: int, held: int, copying: int) -> RingOccupancy:
    """Where the ring's slots are: ``held`` by the user, ``copying`` to a device (ready)."""
    in_flight = sched.count(SlotState.IN_FLIGHT) + sched.count(SlotState.WAITING)
    ready = sched.n_ready + copying
    return RingOccupancy(slots=sched.num_slots, slot_bytes=slot_bytes, free=sched.num_slots - held - in_flight - ready,
                         in_flight=in_flight, ready=ready, held=held)


def worker_busy(counters: list[Any]) -> tuple[float, ...]:
    """Each worker's share of its time spent producing batches, from its counters in the ring."""
    now = time.monotonic_ns()
    busy = []
    for c in counters:
        started, spent = int(c[Counter.STARTED_NS]), int(c[Counter.BUSY_NS])
        busy.append(min(1.0, spent / (now - started)) if started and now > started else 0.0)
    return tuple(busy)
