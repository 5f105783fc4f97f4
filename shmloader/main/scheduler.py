"""Slot bookkeeping (main process): the state of every slot, the epoch's tasks, and the step.

``Scheduler`` is the one place slot state changes: ``native/_schedule.c`` writes each
transition once, and both its methods (the general path) and ``step`` (the per-batch path,
which chains the ordinary transitions and stops at the first that is not) call it. This
module gives it Python's view: the states as ``SlotState``, tasks as ``Task``, the answers of
``step`` as ``Step``. It knows nothing of memory contents, processes or waiting, so a
property test can drive it through any sequence of events (``tests/unit/test_slots.py``).

Invariants (``check()`` asserts them after every step of that test):
- every slot is in exactly one state, and the free stack lists exactly the FREE slots;
- a slot has a task exactly when it is IN_FLIGHT, WAITING or READY;
- every READY slot holds a task of the current epoch;
- ``load[w]`` counts the IN_FLIGHT and WAITING slots of worker ``w``; ``outstanding`` those
  of the current epoch; ``waiting_count`` the WAITING slots.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

from shmloader import _native
from shmloader.wire.layout import _agree


class SlotState(enum.IntEnum):
    FREE = 0  # no task; may be dispatched
    IN_FLIGHT = 1  # a worker owns it: task queued, being written, or written and not yet collected
    WAITING = 2  # its worker's batch did not fit; the worker waits for overflow memory
    READY = 3  # a finished result of the current epoch, not yet taken by the consumer
    LENT = 4  # taken by the consumer: the user views it, or a device copy reads it


_agree("the slot states", {f"SLOT_{s.name}": int(s) for s in SlotState},
       {name: value for name, value in _native.LAYOUT.items() if name.startswith("SLOT_")})


class Step(enum.IntEnum):
    """What ``Scheduler.step`` answers when it does not hand over a slot (a slot is >= 0)."""

    NOT_READY = _native.NOT_READY  # nothing to take yet
    NEED_MEMORY = _native.EV_NEED_MEMORY  # event's result asks for overflow memory (it is still IN_FLIGHT)
    PIPE = _native.EV_PIPE  # event's result comes over its worker's pipe (still IN_FLIGHT: read it, then done())
    TORN = _native.EV_TORN  # event's header echoes another task than its own
    STALE = _native.EV_STALE  # event's result was a past epoch's: its slot went FREE
    RESULT = _native.EV_RESULT  # event's result was taken (LENT) and is no batch: an error or an end of shard


class Task(NamedTuple):
    worker: int
    epoch: int
    seq: int
    index: Any
    needed: int = 0  # bytes asked for, while WAITING


class Scheduler(_native.Scheduler):
    """``_native.Scheduler`` with its tasks as ``Task``s and its states as ``SlotState``s."""

    __slots__ = ()  # (no instance dict: the per-batch calls find the native methods at once)

    def task_of(self, slot: int) -> Task | None:
        raw = self.task(slot)
        return None if raw is None else Task(*raw)

    def state(self, slot: int) -> SlotState:
        return SlotState(self.state_of(slot))

    def resume_after(self, active: list[bool], last_worker: int | None) -> None:
        """A resumed epoch: the shards that had ended end again, and round-robin goes on after
        ``last_worker`` (the worker of the last batch consumed; None: from worker 0)."""
        for worker, going_on in enumerate(active):
            if not going_on:
                self.end_shard(worker)
        if last_worker is not None:
            self.start_round_robin_at((last_worker + 1) % self.num_workers)

    def orphaned(self, worker: int) -> list[tuple[int, Task]]:
        """``orphans(worker)``: every slot of a dead worker FREE again, with its task."""
        return [(slot, Task(*task)) for slot, task in self.orphans(worker)]
