"""The slot ring: one segment, the semaphores inside it, and typed views of its headers and queues.

``Ring`` is the creator's handle (main process): it creates the segment exclusively,
initialises its process-shared semaphores (``native/_sync.c``), unlinks the segment's name
at once and keeps the segment's fd. Every worker attaches through that fd: sent over its
connection (``reduction.send_handle``), or inherited by a replacement, under any start
method. So no name outlives the ring's creation, whoever is killed when, and there are no
named semaphores at all. ``AttachedRing`` is a worker's handle.
Neither knows what a batch is.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any

import numpy as np

from shmloader import _native
from shmloader.wire import shm as _shm
from shmloader.wire.layout import AWAIT_ANY, AWAIT_NONE, DONE, N_COUNTERS, N_FIELDS, Field, RingGeometry

# What _native.post_task (and the scheduler's post_index) returns.
POSTED, DOES_NOT_FIT, NOT_INTS = 1, 0, -1


class YieldWait:
    """Before a process sleeps on one of the ring's semaphores, it gives its CPU away
    (``sched_yield``) and looks again, a bounded number of times: a sync ``next()`` for a
    batch (a token of the ready semaphore; it sleeps on the wake semaphore), a worker for its
    next task (its task semaphore). A process
    that shares the CPU runs at once, and one on another CPU need not wake the waiter from a
    sleep: on a VM that wake-up (an IPI to a halted vCPU) costs the waker 5-14 µs, most of a
    small batch's cost. The bound is ``most`` after a token came while yielding and halves
    after each miss, down to ``least``, so a waiter whose peer takes milliseconds barely
    yields (``least`` yields, ~1 µs each on an idle CPU). The yields and looks are one native
    call with the GIL released (``_native.yield_wait_timed``); a hit takes the semaphore's token.

    A CPU shared with a process that never sleeps (a CPU-bound neighbour: another container,
    another rank spinning in CUDA's synchronisation) turns each yield into that process's whole
    time slice, milliseconds: beside two such neighbours on 2 CPUs a loader that yielded fell to
    torch's rate whenever one shared its CPU (bench/RESULTS.md, 2026-12-05). So each yield is
    timed (``_native.yield_wait_timed``): a wait stops at a yield that took more than
    ``CONTENDED_NS`` and is slow, and the next waits yield ``least`` times at most. ``STRIKES``
    slow waits in a row (one alone is a peer's pause: a collection, a page fault) make the yields
    contended: the waiter then sleeps at once (a sleeper is woken ahead of a CPU hog) for its
    next ``QUIET`` waits, and tries ``least`` yields again (the neighbour may have gone, or moved
    to another CPU); found contended again at once, it is quiet again. (One slow wait would do
    beside neighbours, but an idle machine's peers pause often enough that it cost tiny batches
    20% of their rate there. Quiet spells that doubled while the neighbour stayed kept a loader
    sleeping after the scheduler had moved its processes away from the neighbours: a third of
    the rate that yielding has there.)

    A fresh waiter knows nothing yet, and beside neighbours each of its first STRIKES waits would
    hand one a slice: a loader's first couple of hundred batches took 4-16 ms per 25 there. So its
    first wait, if slow, is enough; that spell is short (``FIRST_QUIET``), since starting up is
    slow beside its peers on any machine, and a wait that is fast ends the start."""

    MOST, LEAST = 64, 4
    # A yield this long ran another process's time slice (ms), or a peer's batch over 200 µs: a
    # quiet spell then costs a futex wake per such batch, which is small beside it.
    CONTENDED_NS = 200_000
    STRIKES = 4  # slow waits in a row that make the yields contended
    QUIET = 1024  # waits that sleep at once after contended yields
    FIRST_QUIET = 16  # the spell after a first wait that was slow: starting up is slow on any machine
    __slots__ = ("most", "least", "bound", "quiet", "strikes", "probing", "spell")

    def __init__(self) -> None:
        self.most, self.least = self.MOST, self.LEAST
        self.bound = self.most
        self.quiet = 0  # waits left that sleep without yielding (the yields were contended)
        self.strikes = 0  # slow waits in a row
        self.probing = True  # the first wait, or the first after a quiet: one slow one is enough
        self.spell = self.FIRST_QUIET  # the next quiet spell's length (short until a wait was fast)

    def __call__(self, mm: mmap.mmap, sem: int) -> bool:
        if self.quiet > 0:
            self.quiet -= 1
            self.probing = not self.quiet
            return False
        bound = self.bound
        took, slow = _native.yield_wait_timed(mm, sem, bound, self.CONTENDED_NS)
        if slow:  # (it stopped at that yield: a slow wait costs one slice, not ``bound``)
            self.strikes += 1
            self.bound = self.least
            if self.probing or self.strikes >= self.STRIKES:
                self.quiet, self.spell = self.spell, self.QUIET
                self.strikes = 0
                self.probing = False
            return bool(took)
        self.strikes = 0
        self.probing = False
        self.spell = self.QUIET  # (past the start: spells are the usual length)
        if took:
            self.bound = self.most
            return True
        self.bound = max(self.least, bound // 2)
        return False


class Doorbell:
    """The eventfd an ``async for`` waits on: workers write it when they publish while the
    doorbell flag in the segment is set (they got the fd when they started); the main process
    writes it when a freed overflow batch makes room in ``memory_budget``, from whatever thread
    dropped that batch (a garbage-collection callback). Invariant: nobody writes the fd after
    ``close`` (a write to a closed number could land on a descriptor opened since): ``ring``
    and ``close`` hold one lock, and ``close`` marks the bell closed before it closes the fd.
    (Reentrant: a callback may run in the thread that is closing it.)"""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lock = threading.RLock()
        self._closed = False

    def ring(self) -> None:
        with self._lock:
            if not self._closed:
                os.eventfd_write(self.fd, 1)

    def drain(self) -> None:
        """Forget the rings so far (the consumer looks for ready slots right after)."""
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self.fd)


class _Views:
    """Typed views of a mapped segment, identical in every process, and its semaphores."""

    def __init__(self, geometry: RingGeometry, mm: mmap.mmap) -> None:
        self.geometry = geometry
        self.mm = mm
        self.bytes = np.frombuffer(mm, dtype=np.uint8)
        # Offsets the per-batch calls use, computed once (the geometry's are properties); tuples,
        # as the native calls that take them all at once want them.
        self.data_offsets = tuple(geometry.data_offset(s) for s in range(geometry.num_slots))
        self.header_offsets = tuple(geometry.slot_offset(s) for s in range(geometry.num_slots))
        self.state_offsets = tuple(geometry.state_offset(s) for s in range(geometry.num_slots))
        self.queue_offsets = tuple(geometry.queue_offset(w) for w in range(geometry.num_workers))
        self.task_sems = [geometry.task_sem(w) for w in range(geometry.num_workers)]
        self.ready_sem = geometry.ready_sem
        self.doorbell_flag = geometry.doorbell_flag
        self.wake_sem, self.awaited_word = geometry.wake_sem, geometry.awaited_word
        self.queue_len = geometry.queue_len
        self.data_bytes = geometry.data_bytes
        # Headers, queues and counters as int64 memoryviews: an item reads as a plain int (a
        # numpy scalar costs more, and the consumer reads about ten header fields per batch).
        whole = memoryview(mm)
        self.headers = [whole[off : off + N_FIELDS * 8].cast("q") for off in self.header_offsets]
        self.queues = [whole[off : off + geometry.queue_len * 8].cast("q") for off in self.queue_offsets]
        self.counters = [
            whole[geometry.counters_offset(w) : geometry.counters_offset(w) + N_COUNTERS * 8].cast("q")
            for w in range(geometry.num_workers)
        ]

    def take_ready(self, timeout: float) -> bool:
        """One token of the ready semaphore: at once (``timeout`` 0) or within ``timeout`` s."""
        return _native.sem_wait(self.mm, self.ready_sem, timeout)

    def await_result(self, seq: int | None) -> None:
        """Name the batch a sync wait will sleep for (its ``seq``; None: any result), after
        taking the wake semaphore's stale tokens. Fenced: stored before the consumer's last
        look (``Scheduler.wanted``, or with none named the ready semaphore), it is seen by every
        publisher that stores DONE after that look, and the one it names posts the wake
        semaphore. The caller clears it (``stop_awaiting``) however the wait ends."""
        while _native.sem_wait(self.mm, self.wake_sem, 0):
            pass
        _native.store_fenced(self.mm, self.awaited_word, AWAIT_ANY if seq is None else seq + 1)

    def sleep_awaited(self, timeout: float) -> bool:
        """Sleep until a publisher posts the wake semaphore, for at most ``timeout`` s; whether
        it did."""
        return _native.sem_wait(self.mm, self.wake_sem, timeout)

    def stop_awaiting(self) -> None:
        """Nothing is awaited: publishers post the ready semaphore alone."""
        _native.store_release(self.mm, self.awaited_word, AWAIT_NONE)

    def want_doorbell(self, on: bool) -> None:
        """Ask workers to write the eventfd doorbell when they publish (an ``async for`` is about
        to wait), or stop asking. Fenced: set before the consumer's last look at the ready
        semaphore, it is seen by every publisher that posts after that look."""
        _native.store_fenced(self.mm, self.doorbell_flag, int(on))


class Ring(_Views):
    """The main process's ring: creates the segment and owns its name and fd."""

    def __init__(self, geometry: RingGeometry) -> None:
        # In /dev/shm where it fits, else in a memfd (then elsewhere says why: a warning)
        self.segment, self.fd, mm, self.elsewhere = _shm.create_ring_memory(geometry.total_bytes)
        self._name_linked = self.segment is not None
        try:
            self.unlink()  # the fd is all that workers need: nothing can be left in /dev/shm from here on
            for offset in [geometry.ready_sem, geometry.wake_sem,
                           *(geometry.task_sem(w) for w in range(geometry.num_workers))]:
                _native.sem_init(mm, offset)
        except BaseException:
            self.close()
            raise
        super().__init__(geometry, mm)
        self.mm: _shm.Mapping = mm  # the main process's mapping: pinnable, unpinned before unmapping
        # (The task queues' tails are the scheduler's, their one writer: main.scheduler.)

    def unlink(self) -> None:
        """Remove the segment's name; mappings and the fd stay valid. Idempotent."""
        if self._name_linked and self.segment is not None:
            self._name_linked = False
            _shm.unlink_segment(self.segment)

    def give_back(self, keep: set[int], control: bool = False) -> int:
        """Return the memory of every slot but those in ``keep`` to the system (``MADV_REMOVE``:
        the pages leave the segment, which reads zeros there from now on), once nobody will
        write or read them again: the workers are gone, and the batches the user still holds
        are in ``keep``. A ring outlived by one held batch then costs that batch's slot, not
        the whole ring. With ``control`` (the ring is retired: no worker waits on its
        semaphores or reads its queues), the control region goes too, so the next epoch's
        ring fits wherever the one before fitted. Returns the bytes still kept."""
        g = self.geometry
        if control:
            self.mm.madvise(mmap.MADV_REMOVE, 0, g.control_bytes)
        runs: list[tuple[int, int]] = []  # (first slot, slots) of each run of slots given back
        for slot in range(g.num_slots):
            if slot in keep:
                continue
            if runs and runs[-1][0] + runs[-1][1] == slot:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((slot, 1))
        for first, count in runs:
            self.mm.madvise(mmap.MADV_REMOVE, g.slot_offset(first), count * g.slot_stride)
        return (0 if control else g.control_bytes) + len(keep) * g.slot_stride

    def close(self) -> None:
        """Unlink the name and close the fd (the mapping lives on while batches view it)."""
        self.unlink()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class AttachedRing(_Views):
    """A worker's view of the ring, attached through the segment's fd (sent over its
    connection, or inherited by a worker that replaces a dead one)."""

    def __init__(self, geometry: RingGeometry, mm: mmap.mmap, worker_id: int) -> None:
        super().__init__(geometry, mm)
        self.worker_id = worker_id
        self._task_sem, self._queue = self.task_sems[worker_id], self.queue_offsets[worker_id]
        self._head = 0
        self.yields = YieldWait()  # take_task's, before it sleeps

    @classmethod
    def by_fd(cls, geometry: RingGeometry, fd: int, worker_id: int) -> AttachedRing:
        try:
            mm = mmap.mmap(fd, geometry.total_bytes)
        finally:
            os.close(fd)
        return cls(geometry, mm, worker_id)

    def publish(self, slot: int, results: tuple[int, ...]) -> bool:
        """Store a slot's result fields (``results``: the header from STATUS on, in field
        order), set it DONE with release ordering, post the ready semaphore, and the wake
        semaphore if a consumer sleeps for this result (or any, or the result asks it for
        memory or its pipe): one native call. Returns whether an ``async for`` consumer waits
        for the doorbell."""
        return bool(_native.publish(self.mm, self.header_offsets[slot], Field.STATUS, results, self.state_offsets[slot],
                                    DONE, self.ready_sem, self.doorbell_flag, self.awaited_word, self.wake_sem))

    def take_task(self, timeout: float) -> None | int | tuple[int, int, int, Any, bool]:
        """The next task queued for this worker: (slot, epoch, seq, index, own), where index is the
        batch sampler's list of ints, the pickled index's bytes, or None (it comes over the
        connection: ``Field.TASK_LEN``); a negative queue entry (STOP_TASK, RESIZE_TASK) as it
        is; None when nothing came within ``timeout`` s.

        When no task is queued yet and ``timeout`` is positive, the worker first yields its CPU
        and looks again (``YieldWait``) before it sleeps: a worker that sleeps must be woken by
        the main process's post."""
        task = self._take(0.0)
        if task is not None or timeout <= 0:
            return task
        if self.yields(self.mm, self._task_sem):
            return self._take(-1.0)  # the token is taken: read the entry
        return self._take(timeout)

    def _take(self, timeout: float) -> None | int | tuple[int, int, int, Any, bool]:
        entry = self._queue + (self._head % self.queue_len) * 8
        task = _native.take_task(self.mm, self._task_sem, entry, self.header_offsets, self.data_offsets,
                                 self.data_bytes, timeout)
        if task is not None:
            self._head += 1
        return task
