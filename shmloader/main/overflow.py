"""Overflow memory (main process): where a batch goes when it does not fit a ring slot.

The path of an oversized batch:

1. the worker measures the batch as a slot would hold it, publishes its slot with
   ``Status.NEED_MEMORY`` and the bytes it needs, and waits on its setup connection;
2. the consumer grants the memory when ``memory_budget`` has room (until then the worker
   waits: backpressure): an anonymous ``memfd`` of that size, reserved with
   ``posix_fallocate`` and mapped here, whose fd goes to the worker over its connection.
   (When only batches the consumer holds could make room for the batch it waits for, the
   worker is asked to send that batch pickled over the connection instead: a copy, not a
   hang, as a slot's batch is copied when the consumer holds the whole ring.);
3. the worker maps it, writes the batch exactly as into a slot (leaves, skeleton, leaf
   table, dataset state), unmaps it and publishes the slot again, now with
   ``Field.REGION = Region.OVERFLOW``;
4. the consumer builds the batch from views of its own mapping, as from a slot; the slot
   is free at once, and the memory is freed when the batch's last view is dropped.

The memory never has a name: nothing can be left in ``/dev/shm``, whichever process dies
at whichever step; the kernel frees it with the last mapping and fd.

``LoaderMemory`` (one per loader) counts every byte of shared memory the loader has mapped:
the rings of all its iterators (those batches kept from earlier epochs still view, at the size
they kept) and the overflow memory granted and not yet freed, so ``memory_budget`` covers
everything the loader allocates. Release callbacks may run in any thread. ``OverflowBroker``
owns one iterator's policy: which waiting worker gets memory when, and the slot size its ring
should grow to; the grants themselves belong to the ring's scope (``main.scope.RingScope.grants``).
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from shmloader._errors import MemoryBudgetError
from shmloader.main.scheduler import SlotState
from shmloader.wire.layout import PAGE, grown_slot_bytes, round_up
from shmloader.wire.ring import Ring
from shmloader.wire.shm import Mapping, create_memfd

if TYPE_CHECKING:
    from shmloader.main.scheduler import Task
    from shmloader.main.scope import RingScope


class LoaderMemory:
    """Every byte of shared memory a loader has mapped, whichever of its iterators mapped it:
    its rings (the live ones, and those that batches kept from earlier epochs or growths still
    view, at the size they kept) and overflow memory granted and not yet freed. One per loader
    (``memory_budget`` bounds ``in_use``). Callbacks may run in any thread (a batch's last
    view dropped there frees its memory): the counts are kept under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.overflow = 0  # bytes of overflow memory granted and not yet freed
        self.rings = 0  # bytes of this loader's rings still mapped (each at the size it keeps)
        # Called after memory was freed (any thread): an iterator waiting for room wakes. Each
        # returns False once its iterator is gone (then it is dropped).
        self.listeners: list[Callable[[], bool]] = []
        self.batch_bytes: int | None = None  # the slot size this loader's rings start at (measured, then grown)

    @property
    def in_use(self) -> int:
        return self.overflow + self.rings

    def __reduce__(self) -> tuple[Any, ...]:
        """A loader pickled or copied (ddp_spawn, deepcopy) starts with none: mappings are a
        process's own."""
        return (LoaderMemory, ())

    def remember(self, nbytes: int) -> None:
        """Rings made later (next epochs, when not persistent) start at slots of ``nbytes`` at least."""
        self.batch_bytes = max(self.batch_bytes or 0, nbytes)

    def allocate(self, nbytes: int) -> tuple[int, Mapping]:
        """A new anonymous shared region of ``nbytes`` for an overflow batch: (fd, mapping). The
        caller sends the fd and closes it; the mapping is the consumer's."""
        fd, mm = create_memfd(nbytes, "shmloader-overflow",
                              f"a batch that does not fit a ring slot needs {nbytes:,} bytes of shared memory, "
                              "and the system could not provide them")
        with self._lock:
            self.overflow += nbytes
        return fd, mm

    def free(self, nbytes: int) -> None:
        with self._lock:
            self.overflow -= nbytes
        self._freed()

    def lend(self, base: np.ndarray[Any, Any], nbytes: int) -> None:
        """Free ``nbytes`` once ``base`` (which every leaf of a delivered batch keeps alive) dies."""
        weakref.finalize(base, self.free, nbytes)

    def map_ring(self, mm: mmap.mmap, nbytes: int) -> RingShare:
        """Count a ring of ``nbytes`` until its mapping is gone (the last batch viewing it)."""
        share = RingShare(self, nbytes)
        with self._lock:
            self.rings += nbytes
        weakref.finalize(mm, share.resize, 0)
        return share

    def _resize(self, share: RingShare, nbytes: int) -> None:
        with self._lock:
            self.rings += nbytes - share.nbytes
            share.nbytes = nbytes
        self._freed()

    def _freed(self) -> None:
        self.listeners = [listener for listener in self.listeners if listener()]


class RingShare:
    """A ring's bytes in its loader's ``LoaderMemory``: all of them while it runs, those it keeps
    once the memory nobody holds went back (``Ring.give_back``), none once it is unmapped."""

    def __init__(self, memory: LoaderMemory, nbytes: int) -> None:
        self.memory = memory
        self.nbytes = nbytes

    def resize(self, nbytes: int) -> None:
        self.memory._resize(self, nbytes)


class OverflowBroker:
    """Overflow memory for the tasks of one iterator: grants under ``memory_budget``, and the
    growth of the ring's slots that oversized batches ask for.

    A grant belongs to its slot's task, and so to the ring's scope (``RingScope.grants``): it is
    taken by the delivered batch (``RingScope.take``; freed when the batch's last view dies) or
    dropped with its task (``RingScope.drop``: stale epoch, dead worker, error), exactly once."""

    def __init__(self, memory: LoaderMemory, budget: int | None, in_order: bool, in_flight: int) -> None:
        self.memory = memory
        self.budget = budget
        self.in_order = in_order
        # Overflow batches granted and not yet delivered, at most: torch's batches in flight
        # (num_workers * prefetch_factor, torch's default when none was given; with it given the
        # cap of tasks is as many, so this never binds). A depth grown for small batches may have
        # num_workers * depth.MOST tasks out when batches outgrow their slots: each would ask for
        # memory of its own, where torch's loader holds its default (_held_back).
        self.in_flight = in_flight
        self.grow_to: int | None = None  # the slot size of a new ring, made once the ring drains
        self.growth_declined = False  # memory_budget had no room to grow; overflow carries large batches
        self.awaiting_room = False  # a grant waits for memory_budget: freed memory rings the doorbell

    def new_epoch(self, scope: RingScope | None) -> None:
        """Results the new epoch dropped (their slots FREE) give their grants back."""
        if scope is not None:
            scope.drop_free()
        self.growth_declined = False

    def want_growth(self, nbytes: int, slot_bytes: int) -> None:
        """A batch (or index) of ``nbytes`` did not fit a slot of ``slot_bytes``: grow the slots
        once the ring drains."""
        target = grown_slot_bytes(nbytes)
        self.memory.remember(target)
        if self.growth_declined or target <= slot_bytes:
            return
        self.grow_to = max(self.grow_to or 0, target)

    def want_deeper(self, slot_bytes: int) -> None:
        """The depth outgrew the ring (``Depth.outgrew``): a ring with more slots of ``slot_bytes``
        (or larger, if a batch asked for that too) once the ring drains."""
        self.grow_to = max(self.grow_to or 0, slot_bytes)

    def take_growth(self) -> int:
        """The slot size the ring grows to now (asked for by ``want_growth`` or ``want_deeper``);
        asked no more."""
        size, self.grow_to = self.grow_to, None
        assert size is not None
        return size

    def room_beside(self, ring: Ring, nbytes: int) -> bool:
        """Whether ``memory_budget`` leaves room beside ``ring`` for a batch of ``nbytes`` in
        memory of its own: tasks are posted ``own`` only then, or a batch that fits a slot would
        ask for memory it can never have."""
        return self.budget is None or ring.geometry.total_bytes + round_up(nbytes, PAGE) <= self.budget

    def requested(self, scope: RingScope, slot: int, needed: int, own: bool) -> None:
        """``slot``'s worker asks for ``needed`` bytes of overflow memory (its result is published
        NEED_MEMORY): it waits for a grant (``grant`` runs at once), and the ring grows once it
        drains, unless the task was posted ``own`` (the batch may well fit a slot: the user holds
        them); a stale epoch's request is answered "drop"."""
        sched = scope.sched
        task = sched.task_of(slot)
        assert task is not None
        if not sched.overflowed(slot, needed):
            scope.answer_memory(task.worker, slot, 0)  # a stale epoch's batch: drop it
            return
        if not own:
            self.want_growth(needed, scope.ring.data_bytes)
        self.grant(scope)

    def grant(self, scope: RingScope) -> None:
        """Give waiting workers their overflow memory, lowest sequence number first, while
        ``memory_budget`` has room and fewer than ``in_flight`` are undelivered; the rest wait
        (backpressure). Under a budget with in-order delivery, a batch gets memory only once
        every batch before it has its memory or fits a slot, so the budget is never taken by a
        batch that cannot be delivered yet."""
        self.awaiting_room = False
        sched = scope.sched
        for slot in sched.waiting():
            task = sched.task_of(slot)
            assert task is not None
            if task.epoch != sched.epoch:
                sched.drop(slot)
                scope.answer_memory(task.worker, slot, 0)
                continue
            if self._held_back(scope, slot, task):
                continue  # (a later one may be one the order needs; a round after a delivery looks again)
            size = round_up(task.needed, PAGE)
            if self.budget is not None and self.in_order and self._earlier_may_overflow(scope, task.seq):
                return  # granting out of order could give an undeliverable later batch the room
            room = self._room_for(scope, task.seq, size)
            if room is None:  # only the batches the caller holds could make room: a copy, not a hang
                sched.set_idle(slot)
                sched.granted(slot)
                scope.answer_memory(task.worker, slot, -1)
                continue
            if not room:
                self.awaiting_room = True
                return
            fd, mm = self.memory.allocate(size)
            try:
                scope.grant(slot, mm, size)
                sched.set_idle(slot)  # before the worker can publish again
                sched.granted(slot)
                scope.answer_memory(task.worker, slot, size, fd)
            finally:
                os.close(fd)

    def _held_back(self, scope: RingScope, slot: int, task: Task) -> bool:
        """Whether ``slot``'s grant waits: ``in_flight`` granted batches are not yet delivered (a
        batch taken for a device copy is delivered). In order, never the batch the loop waits
        for, nor one its worker makes before a batch of a lower sequence number (queued behind
        it: a task sent over the connection comes after tasks posted after it), which would then
        never come."""
        sched = scope.sched
        if sum(1 for s in scope.grants if sched.state_of(s) != SlotState.LENT) < self.in_flight:
            return False
        if not self.in_order:
            return True  # (the granted batches are delivered in any order: then this one's turn)
        if task.seq == sched.rcvd_seq:
            return False
        for other in sched.tasks():
            t = sched.task_of(other)
            if (t is not None and t.worker == task.worker and t.epoch == task.epoch and t.seq < task.seq
                    and sched.state_of(other) == SlotState.IN_FLIGHT):
                return False
        return True

    def _earlier_may_overflow(self, scope: RingScope, seq: int) -> bool:
        """Whether a task of this epoch before ``seq`` is still being made without overflow
        memory (it may yet ask for some)."""
        sched = scope.sched
        for slot in sched.tasks():
            task = sched.task_of(slot)
            assert task is not None
            if (sched.state_of(slot) == SlotState.IN_FLIGHT and slot not in scope.grants
                    and task.epoch == sched.epoch and task.seq < seq):
                return True
        return False

    def _room_for(self, scope: RingScope, seq: int, size: int) -> bool | None:
        """Whether ``memory_budget`` has room for ``size`` more bytes now. None when it has not
        and only the caller could make room (the batches it holds) while it waits for this very
        batch: that batch then comes as a pickled copy. Raises when it never will have room
        (the batch is larger than the budget leaves beside the ring)."""
        budget = self.budget
        if budget is None:
            return True
        sched = scope.sched
        g = scope.ring.geometry
        if g.total_bytes + size > budget:
            if size <= g.data_bytes:  # it fits a slot (an own task's): never an error, a copy
                return None
            raise MemoryBudgetError(
                f"batch {seq} needs {size:,} bytes, more than memory_budget={budget:,} leaves beside the "
                f"ring ({g.total_bytes:,} bytes: {g.num_slots} slots of {g.data_bytes:,}). Raise "
                f"memory_budget to at least {g.total_bytes + size:,}, or use smaller batches."
            )
        if self.memory.in_use + size <= budget:  # (in_use counts this ring, and every other of the loader's)
            return True
        if self.in_order:
            wanted_next = seq == sched.rcvd_seq
        else:  # nothing else can arrive: a worker that waits for memory makes no other batch
            tasks = {slot: sched.task_of(slot) for slot in sched.tasks()}
            blocked = {task.worker for slot, task in tasks.items() if task and slot in sched.waiting()}
            # (a worker whose shard ended takes no task: it cannot unblock anything)
            active = sched.active
            unblocked = any(active[w] and w not in blocked for w in range(sched.num_workers))
            moving = any(sched.state_of(slot) == SlotState.IN_FLIGHT and task and task.worker not in blocked
                         for slot, task in tasks.items())
            can_dispatch = sched.n_free and not sched.exhausted and self.grow_to is None and unblocked
            wanted_next = not sched.n_ready and not moving and not can_dispatch
        return None if wanted_next and not scope.grants and scope.stager is None else False
