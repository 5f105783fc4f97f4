"""The slot ring: one segment, its semaphores, and typed views of its headers and queues.

``Ring`` is the creator's handle (main process): it creates everything exclusively,
unlinks the names once every worker has attached, and closes its handles on shutdown.
``AttachedRing`` is a worker's handle: it maps by name and never unlinks.
Neither knows what a batch is.
"""

from __future__ import annotations

import dataclasses
import mmap

import numpy as np
import posix_ipc

from . import _shm
from ._layout import N_COUNTERS, N_FIELDS, RingGeometry


@dataclasses.dataclass(frozen=True)
class RingSpec:
    """What a worker needs to attach (picklable, sent once per ring)."""

    geometry: RingGeometry
    segment: str
    ready_sem: str
    task_sems: tuple[str, ...]


class _Views:
    """Typed views of a mapped segment, identical in every process."""

    def __init__(self, geometry: RingGeometry, mm: mmap.mmap) -> None:
        self.geometry = geometry
        self.mm = mm
        self.bytes = np.frombuffer(mm, dtype=np.uint8)
        self.data_offsets = [geometry.data_offset(s) for s in range(geometry.num_slots)]
        self.headers = [
            np.ndarray((N_FIELDS,), np.int64, buffer=mm, offset=geometry.slot_offset(s))
            for s in range(geometry.num_slots)
        ]
        self.queues = [
            np.ndarray((geometry.queue_len,), np.int64, buffer=mm, offset=geometry.queue_offset(w))
            for w in range(geometry.num_workers)
        ]
        self.counters = [
            np.ndarray((N_COUNTERS,), np.int64, buffer=mm, offset=geometry.counters_offset(w))
            for w in range(geometry.num_workers)
        ]


class Ring(_Views):
    """The main process's ring: creates the segment and semaphores, owns their names."""

    def __init__(self, geometry: RingGeometry) -> None:
        _shm.check_free(geometry.total_bytes)
        self._names_linked = True
        self.segment, mm = _shm.create_segment(geometry.total_bytes)
        self.ready: posix_ipc.Semaphore | None = None
        self.tasks: list[posix_ipc.Semaphore] = []
        try:
            self.ready = _shm.create_semaphore()
            self.tasks = [_shm.create_semaphore() for _ in range(geometry.num_workers)]
        except BaseException:
            self._unlink(mm_name=self.segment)
            raise
        super().__init__(geometry, mm)
        self._tails = [0] * geometry.num_workers

    @property
    def spec(self) -> RingSpec:
        assert self.ready is not None
        return RingSpec(self.geometry, self.segment, self.ready.name, tuple(s.name for s in self.tasks))

    def _unlink(self, mm_name: str) -> None:
        _shm.unlink_segment(mm_name)
        for sem in [self.ready, *self.tasks]:
            if sem is not None:
                _shm.unlink_semaphore(sem)

    def unlink(self) -> None:
        """Remove the names; mappings and open handles stay valid. Idempotent."""
        if self._names_linked:
            self._names_linked = False
            self._unlink(self.segment)

    def push_task(self, worker: int, slot: int) -> None:
        """Queue ``slot`` (or STOP_TASK, RESIZE_TASK) for ``worker`` and wake it."""
        q = self.queues[worker]
        q[self._tails[worker] % self.geometry.queue_len] = slot
        self._tails[worker] += 1
        self.tasks[worker].release()

    def renew_queue(self, worker: int) -> None:
        """A fresh task semaphore and an empty queue for ``worker`` (its process died holding
        the old ones). The new semaphore is unlinked at once: its replacement inherits it."""
        old = self.tasks[worker]
        self.tasks[worker] = _shm.create_semaphore()
        _shm.unlink_semaphore(self.tasks[worker])
        if self._names_linked:  # a ring still being attached to (it grew): its names go now
            _shm.unlink_semaphore(old)
        old.close()
        self.queues[worker][:] = 0
        self._tails[worker] = 0

    def close(self) -> None:
        """Unlink the names and close the semaphore handles (the mapping lives on while
        batches still view it)."""
        self.unlink()
        for sem in [self.ready, *self.tasks]:
            if sem is not None:
                sem.close()
        self.ready = None
        self.tasks = []


class AttachedRing(_Views):
    """A worker's view of the ring: attached by name at start-up, or inherited (fork) by a
    worker that replaces a dead one."""

    def __init__(self, geometry: RingGeometry, mm: mmap.mmap, ready: posix_ipc.Semaphore,
                 task: posix_ipc.Semaphore, worker_id: int) -> None:
        super().__init__(geometry, mm)
        self.ready = ready
        self.task = task
        self.queue = self.queues[worker_id]
        self._head = 0

    @classmethod
    def by_name(cls, spec: RingSpec, worker_id: int) -> AttachedRing:
        mm = _shm.attach_segment(spec.segment, spec.geometry.total_bytes)
        return cls(spec.geometry, mm, posix_ipc.Semaphore(spec.ready_sem),
                   posix_ipc.Semaphore(spec.task_sems[worker_id]), worker_id)

    @classmethod
    def inherited(cls, ring: Ring, worker_id: int) -> AttachedRing:
        assert ring.ready is not None
        return cls(ring.geometry, ring.mm, ring.ready, ring.tasks[worker_id], worker_id)

    def close(self) -> None:
        """Close this process's semaphore handles (the mapping goes with the last view)."""
        self.ready.close()
        self.task.close()

    def next_task(self, timeout: float) -> int | None:
        """The next slot queued for this worker (or STOP_TASK, RESIZE_TASK), None on timeout."""
        try:
            self.task.acquire(timeout)
        except posix_ipc.BusyError:
            return None
        slot = int(self.queue[self._head % self.geometry.queue_len])
        self._head += 1
        return slot
