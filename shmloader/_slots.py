"""Slot bookkeeping (main process): which state each slot of the ring is in.

``SlotTable`` is the one place slot state changes. It knows tasks (worker, epoch,
sequence number, index) and the five states below; it knows nothing of memory,
processes or waiting, so a property test can drive it through any sequence of events.
(Two native calls make its per-batch transitions on its containers for an in-order
``next()``: ``_native.steady_take`` give_back, done and take, ``_native.dispatch_next``
dispatch (with ``outstanding`` left to the caller); ``tests/unit/test_steady_take.py`` and
``tests/unit/test_dispatch_next.py`` hold them to these methods.)

Invariants (``check()`` asserts them; ``tests/unit/test_slots.py`` runs it after
every step of random dispatch / done / overflow / grant / kill / epoch sequences):
- every slot is in exactly one state, and ``free`` lists exactly the FREE slots;
- a slot has a task exactly when it is IN_FLIGHT, WAITING or READY;
- ``ready`` maps the sequence number of every READY slot of the current epoch to it;
- ``load[w]`` counts the IN_FLIGHT and WAITING slots of worker ``w``;
- ``outstanding`` counts the IN_FLIGHT and WAITING slots of the current epoch;
- ``waiting_count`` counts the WAITING slots.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple


class SlotState(enum.IntEnum):
    FREE = 0  # no task; may be dispatched
    IN_FLIGHT = 1  # a worker owns it: task queued, being written, or written and not yet collected
    WAITING = 2  # its worker's batch did not fit; the worker waits for overflow memory
    READY = 3  # a finished result of the current epoch, not yet taken by the consumer
    LENT = 4  # taken by the consumer: the user views it, or a device copy reads it


_FREE, _IN_FLIGHT, _READY, _LENT = SlotState.FREE, SlotState.IN_FLIGHT, SlotState.READY, SlotState.LENT
_new_task = tuple.__new__


class Task(NamedTuple):  # a tuple: made for every batch, so cheap to make
    worker: int
    epoch: int
    seq: int
    index: Any
    needed: int = 0  # bytes asked for, while WAITING


class SlotTable:
    def __init__(self, num_slots: int, num_workers: int, epoch: int = 0) -> None:
        self.num_slots = num_slots
        self.epoch = epoch
        self.state = [SlotState.FREE] * num_slots
        self.free = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 is used first
        self.tasks: dict[int, Task] = {}
        self.ready: dict[int, int] = {}  # seq -> slot
        self.load = [0] * num_workers
        self.outstanding = 0
        self.waiting_count = 0

    # ---------------------------------------------------------- questions
    def count(self, state: SlotState) -> int:
        return sum(1 for s in self.state if s is state)

    def busy(self) -> bool:
        """Whether any slot is owned by a worker or holds an untaken result."""
        return bool(self.tasks)

    def waiting(self) -> list[int]:
        """WAITING slots, lowest sequence number first (the order overflow memory is granted in)."""
        if not self.waiting_count:
            return []
        slots = [s for s, st in enumerate(self.state) if st is SlotState.WAITING]
        return sorted(slots, key=lambda s: (self.tasks[s].epoch, self.tasks[s].seq))

    def of_worker(self, worker: int) -> list[int]:
        """IN_FLIGHT and WAITING slots of ``worker``."""
        return [s for s, t in self.tasks.items() if t.worker == worker and self.state[s] is not SlotState.READY]

    # ---------------------------------------------------------- transitions
    def _move(self, slot: int, expected: tuple[SlotState, ...], to: SlotState) -> None:
        now = self.state[slot]
        if now not in expected:
            self._wrong(slot, expected)
        self.state[slot] = to
        self.waiting_count += (to is SlotState.WAITING) - (now is SlotState.WAITING)

    def _wrong(self, slot: int, expected: tuple[SlotState, ...]) -> None:
        raise AssertionError(f"slot {slot} is {self.state[slot].name}, expected {[e.name for e in expected]}")

    # The per-batch transitions (dispatch, done, take, give_back) check and set the state
    # inline: none of them involves WAITING, and each runs once per batch.

    def dispatch(self, worker: int, seq: int, index: Any) -> int:
        """FREE -> IN_FLIGHT: the slot that now carries task ``seq`` of the current epoch."""
        slot = self.free.pop()
        if self.state[slot] is not _FREE:
            self._wrong(slot, (_FREE,))
        self.state[slot] = _IN_FLIGHT
        self.tasks[slot] = _new_task(Task, (worker, self.epoch, seq, index, 0))  # Task(...) without its Python __new__
        self.load[worker] += 1
        self.outstanding += 1
        return slot

    def redispatch(self, slot: int, task: Task, worker: int) -> None:
        """FREE -> IN_FLIGHT: ``task`` (orphaned by a dead worker) again, for ``worker``."""
        self.free.remove(slot)
        self._move(slot, (SlotState.FREE,), SlotState.IN_FLIGHT)
        self.tasks[slot] = task._replace(worker=worker, needed=0)
        self.load[worker] += 1
        self.outstanding += 1

    def _leave_worker(self, slot: int) -> Task:
        task = self.tasks[slot]
        self.load[task.worker] -= 1
        if task.epoch == self.epoch:
            self.outstanding -= 1
        return task

    def done(self, slot: int) -> Task | None:
        """IN_FLIGHT -> READY; a stale epoch's result goes FREE instead (returns None)."""
        if self.state[slot] is not _IN_FLIGHT:
            self._wrong(slot, (_IN_FLIGHT,))
        self.state[slot] = _READY
        task = self.tasks[slot]
        self.load[task.worker] -= 1
        if task.epoch != self.epoch:
            self._release(slot)
            return None
        self.outstanding -= 1
        self.ready[task.seq] = slot
        return task

    def overflowed(self, slot: int, needed: int) -> Task | None:
        """IN_FLIGHT -> WAITING (its worker waits for ``needed`` bytes of overflow memory).
        A stale epoch's request is not served: the slot goes FREE (returns None)."""
        task = self.tasks[slot]
        if task.epoch != self.epoch:
            self._move(slot, (SlotState.IN_FLIGHT,), SlotState.READY)
            self._leave_worker(slot)
            self._release(slot)
            return None
        self._move(slot, (SlotState.IN_FLIGHT,), SlotState.WAITING)
        self.tasks[slot] = task._replace(needed=needed)
        return self.tasks[slot]

    def drop(self, slot: int) -> Task:
        """WAITING -> FREE: a request of a stale epoch is answered with "drop"."""
        self._move(slot, (SlotState.WAITING,), SlotState.READY)
        task = self._leave_worker(slot)
        self._release(slot)
        return task

    def granted(self, slot: int) -> None:
        """WAITING -> IN_FLIGHT: the worker has its memory and writes the batch."""
        self._move(slot, (SlotState.WAITING,), SlotState.IN_FLIGHT)

    def take(self, seq: int) -> int:
        """READY -> LENT: the slot holding result ``seq``."""
        slot = self.ready.pop(seq)
        if self.state[slot] is not _READY:
            self._wrong(slot, (_READY,))
        self.state[slot] = _LENT
        del self.tasks[slot]
        return slot

    def give_back(self, slot: int) -> None:
        """LENT -> FREE: the user dropped (or released) the batch, or its copy completed."""
        if self.state[slot] is not _LENT:
            self._wrong(slot, (_LENT,))
        self.state[slot] = _FREE
        self.free.append(slot)

    def _release(self, slot: int) -> None:
        del self.tasks[slot]
        self._move(slot, (SlotState.READY,), SlotState.FREE)
        self.free.append(slot)

    def orphans(self, worker: int) -> list[tuple[int, Task]]:
        """IN_FLIGHT / WAITING -> FREE for every slot of a dead ``worker``; returns the slots and
        tasks, lowest sequence number first (the caller dispatches the current epoch's again)."""
        out = []
        for slot in self.of_worker(worker):
            task = self._leave_worker(slot)
            del self.tasks[slot]
            self.waiting_count -= self.state[slot] is SlotState.WAITING
            self.state[slot] = SlotState.FREE
            self.free.append(slot)
            out.append((slot, task))
        return sorted(out, key=lambda st: (st[1].epoch, st[1].seq))

    def new_epoch(self) -> None:
        """Results nobody will take are dropped; tasks still in flight become stale."""
        self.epoch += 1
        for slot in self.ready.values():
            self._release(slot)
        self.ready = {}
        self.outstanding = 0

    # ---------------------------------------------------------- invariant
    def check(self) -> None:
        free = set(self.free)
        assert len(free) == len(self.free), "a slot is listed free twice"
        for slot, st in enumerate(self.state):
            assert (slot in free) == (st is SlotState.FREE), (slot, st)
            assert (slot in self.tasks) == (st in (SlotState.IN_FLIGHT, SlotState.WAITING, SlotState.READY)), (slot, st)
        assert {s for s in self.ready.values()} == {s for s, st in enumerate(self.state) if st is SlotState.READY}
        for seq, slot in self.ready.items():
            assert self.tasks[slot].seq == seq and self.tasks[slot].epoch == self.epoch
        owned = [t for s, t in self.tasks.items() if self.state[s] is not SlotState.READY]
        assert self.load == [sum(1 for t in owned if t.worker == w) for w in range(len(self.load))], self.load
        assert self.outstanding == sum(1 for t in owned if t.epoch == self.epoch)
        assert self.waiting_count == self.state.count(SlotState.WAITING)
