"""The current ring and everything tied to it (main process): ``RingScope``.

What lives and dies with one ring of an iterator is owned by one object: the ring and its
bytes in the loader's memory, the scheduler's table over its slots, the leases of the slots
the user holds, the overflow memory granted to its slots' tasks, the device stager copying out
of it, and the way to the workers that write it. The lifecycle makes a scope once the ring
exists and replaces it whole when the ring grows (``Lifecycle.grow``), so nothing reads one
ring through another's table, and nothing asks whether a ring exists: what needs one is
handed the scope.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from shmloader.main import device as _device
from shmloader.main.lease import Leases, Where, lone_args
from shmloader.main.overflow import LoaderMemory
from shmloader.main.pool import WorkerPool
from shmloader.main.scheduler import Scheduler, SlotState
from shmloader.wire.ring import Ring
from shmloader.wire.shm import Mapping


class RingUse(NamedTuple):
    """How every ring of an iterator is used, whichever ring it is."""

    pinned: bool  # page-locked (pin_memory=True or device= on CUDA, and the first pin held): its overflow too
    stager: _device.DeviceStager | None  # device=: batches are copied to the device ahead of the consumer
    lone: bool  # one-tensor batches are built in one native call (no worker snapshot to note per batch)


class RingScope:
    """One ring of an iterator and what refers to its slots. Made once the ring exists; its
    ``sched`` then reads and writes this ring's table (resized, every slot FREE)."""

    def __init__(self, ring: Ring, sched: Scheduler, pool: WorkerPool, memory: LoaderMemory, use: RingUse) -> None:
        """Take ``ring`` over (page-locked already when ``use.pinned``): counted in the loader's
        ``memory`` until its mapping is gone."""
        self.ring = ring
        self.use = use
        self.sched = sched
        self.pool = pool
        self.memory = memory
        self.stager = use.stager
        self.share = memory.map_ring(ring.mm, ring.geometry.total_bytes)
        self.leases = Leases()
        self.grants: dict[int, tuple[Mapping, int]] = {}  # slot -> (memory, bytes) granted to its task
        self.retired = False
        sched.resize(ring.geometry.num_slots)
        sched.attach(ring.mm, ring.header_offsets, ring.data_offsets, ring.data_bytes, ring.queue_offsets,
                     ring.queue_len, tuple(ring.task_sems), ring.ready_sem)
        self.lone: tuple[Any, ...] | None = lone_args(ring, self.most_lent()) if use.lone else None

    # ------------------------------------------------------------ workers
    def send(self, wid: int, msg: tuple[Any, ...], fd: int | None = None) -> bool:
        """Send ``msg`` (and ``fd``) to worker ``wid``; False when it died (the next liveness check
        replaces it and dispatches its tasks again)."""
        return self.pool.send(wid, msg, fd, dead_ok=True)

    def answer_memory(self, wid: int, slot: int, size: int, fd: int = -1) -> None:
        """Answer ``wid``'s request for overflow memory (``WorkerPool.send_memory``)."""
        self.pool.send_memory(wid, slot, size, fd)

    # -------------------------------------------------------------- leases
    def most_lent(self) -> int:
        """How many slots the user may hold before a batch is copied rather than lent: the ring
        less one slot a worker (a loop that keeps every batch then still has every worker at
        work), at least 2 (a loop holding its one batch is lent the next), at most the ring less
        one (the workers keep a slot: a ring of 2 slots lends one)."""
        slots = self.sched.num_slots
        return min(slots - 1, max(2, slots - self.sched.num_workers))

    def held(self) -> set[int]:
        """The slots whose memory someone may still read: lent and not given back (a batch the
        user holds, or a device copy's source), less those whose batch is gone or released."""
        sched, leases = self.sched, self.leases
        lent = {s for s in range(sched.num_slots) if sched.state_of(s) == SlotState.LENT}
        return lent - (set(leases.bases) - leases.viewed()) - set(leases.released)

    # ------------------------------------------------------------ overflow
    def where(self, slot: int) -> Where | None:
        """Where the result of ``slot``'s task lies when it was granted overflow memory."""
        granted = self.grants.get(slot)
        return None if granted is None else (granted[0], 0, granted[1])

    def grant(self, slot: int, mm: Mapping, nbytes: int) -> None:
        """``slot``'s task was granted ``mm`` (``nbytes``), page-locked as the ring is."""
        if self.use.pinned:
            _device.register_host(mm, nbytes)
        self.grants[slot] = (mm, nbytes)

    def take(self, slot: int, base: np.ndarray[Any, Any]) -> None:
        """The batch of ``slot`` was delivered from its grant: the memory is freed once ``base``
        (which every view of the batch keeps alive) dies."""
        self.memory.lend(base, self.grants.pop(slot)[1])

    def drop(self, slot: int) -> None:
        """``slot``'s task is gone undelivered: its grant, if any, is freed."""
        granted = self.grants.pop(slot, None)
        if granted is not None:
            self.memory.free(granted[1])

    def drop_free(self) -> None:
        """Grants of slots a new epoch dropped (FREE) go back."""
        for slot in [s for s in self.grants if self.sched.state_of(s) == SlotState.FREE]:
            self.drop(slot)

    # -------------------------------------------------------------- device
    def reap(self, block: bool = False) -> None:
        """Slots whose device copies completed go back (with their overflow memory); with
        ``block``, after waiting for the oldest copy."""
        assert self.stager is not None
        for slot in self.stager.reap(block):
            self.sched.give_back(slot)
            self.drop(slot)

    # ----------------------------------------------------------------- end
    def retire(self, held: set[int], control: bool) -> None:
        """Nobody writes the ring any more (it was replaced, or its workers stopped): the memory
        of every slot but ``held`` (``held()``, asked while the scheduler still reads this ring)
        goes back to the system, with ``control`` its control region too, and the ring is
        closed. It stays counted at what the held batches keep, and overflow memory granted to
        tasks that will never be delivered is no longer counted. Once."""
        if self.retired:
            return
        self.retired = True
        for slot in list(self.grants):
            self.drop(slot)
        try:
            kept = self.ring.give_back(held, control)
        finally:
            self.ring.close()
        self.share.resize(kept if held else 0)
