"""Overflow grants held to torch's batches in flight (``OverflowBroker._held_back``): a batch
that outgrew its slot gets memory of its own only while fewer than ``in_flight`` granted batches
are undelivered, lowest sequence number first; in order, never at the cost of a batch that
would then never come. The scheduler and the ring's scope are stand-ins here: the rule only
reads slot states, tasks and the grants."""

from __future__ import annotations

from typing import Any

from shmloader.main.overflow import LoaderMemory, OverflowBroker
from shmloader.main.scheduler import SlotState, Task

IN_FLIGHT, WAITING, READY, LENT = SlotState.IN_FLIGHT, SlotState.WAITING, SlotState.READY, SlotState.LENT


class Table:
    """slot -> (state, Task); ``rcvd_seq``: the next batch in order."""

    def __init__(self, slots: dict[int, tuple[SlotState, Task]], rcvd_seq: int) -> None:
        self.slots, self.rcvd_seq = slots, rcvd_seq

    def state_of(self, slot: int) -> int:
        return int(self.slots[slot][0])

    def task_of(self, slot: int) -> Task | None:
        return self.slots[slot][1]

    def tasks(self) -> list[int]:
        return [s for s, (state, _) in self.slots.items() if state in (IN_FLIGHT, WAITING, READY)]


    # (what OverflowBroker.grant does to the table)
    epoch = 0

    def waiting(self) -> list[int]:
        return sorted((s for s, (state, _) in self.slots.items() if state == WAITING), key=lambda s: self.slots[s][1].seq)

    def set_idle(self, slot: int) -> None:
        pass

    def granted(self, slot: int) -> None:
        self.slots[slot] = (IN_FLIGHT, self.slots[slot][1])


class Scope:
    def __init__(self, sched: Table, granted: list[int]) -> None:
        self.sched, self.grants = sched, {slot: (None, 1 << 20) for slot in granted}
        self.answered: list[int] = []

    def grant(self, slot: int, mm: Any, size: int) -> None:
        self.grants[slot] = (mm, size)

    def answer_memory(self, worker: int, slot: int, size: int, fd: int = -1) -> None:
        self.answered.append(slot)


def held(in_order: bool, slots: dict[int, tuple[SlotState, Task]], granted: list[int], slot: int,
         rcvd_seq: int = 0, in_flight: int = 4) -> bool:
    broker = OverflowBroker(LoaderMemory(), None, in_order, in_flight)
    scope: Any = Scope(Table(slots, rcvd_seq), granted)
    task = slots[slot][1]
    return broker._held_back(scope, slot, task)


def t(worker: int, seq: int) -> Task:
    return Task(worker, 0, seq, None)


# Batches 1-4 were granted, 1-3 are written (READY); batch 0, the next in order, is being made by
# worker 0; batch 5 (worker 1) asks for memory.
BASE = {10: (IN_FLIGHT, t(0, 0)), 11: (READY, t(1, 1)), 12: (READY, t(0, 2)), 13: (READY, t(1, 3)),
        14: (IN_FLIGHT, t(0, 4)), 15: (WAITING, t(1, 5))}


def test_under_torchs_batches_in_flight_every_grant_is_given() -> None:
    for in_order in (True, False):
        assert not held(in_order, BASE, [11, 12, 13], 15)


def test_at_torchs_batches_in_flight_a_later_batch_waits() -> None:
    for in_order in (True, False):
        assert held(in_order, BASE, [11, 12, 13, 14], 15)


def test_batches_the_loop_took_are_delivered_and_do_not_count() -> None:
    # (a device copy still reading a taken batch keeps its grant until it is reaped)
    slots = {**BASE, 12: (LENT, t(0, 2)), 13: (LENT, t(1, 3))}
    assert not held(True, slots, [11, 12, 13, 14], 15)
    assert not held(False, slots, [11, 12, 13, 14], 15)


def test_in_order_the_batch_the_loop_waits_for_is_never_held_back() -> None:
    slots = {**BASE, 10: (WAITING, t(0, 0))}
    assert not held(True, slots, [11, 12, 13, 14], 10, rcvd_seq=0)


def test_in_order_a_batch_made_before_a_lower_one_of_its_worker_is_not_held_back() -> None:
    # Batch 0 was taken. Worker 1 makes batch 5 before its batch 1 (batch 1's index came over the
    # connection after 5 was posted): holding 5 back would hold back batch 1, which the loop
    # waits for, and every batch after it, for good.
    slots = {**BASE, 10: (LENT, t(0, 0)), 11: (IN_FLIGHT, t(1, 1)), 16: (READY, t(0, 6))}
    assert not held(True, slots, [12, 13, 14, 16], 15, rcvd_seq=1)
    # Batch 1 is worker 0's instead: worker 1 makes nothing before 5 that the loop waits for.
    other = {**slots, 11: (IN_FLIGHT, t(0, 1))}
    assert held(True, other, [12, 13, 14, 16], 15, rcvd_seq=1)


def test_out_of_order_every_batch_waits_its_turn() -> None:
    # (the granted batches are delivered in any order, so a turn comes)
    slots = {**BASE, 10: (WAITING, t(0, 0))}
    assert held(False, slots, [11, 12, 13, 14], 10)


def test_a_batch_held_back_does_not_hold_back_a_later_one_the_order_needs() -> None:
    # Batch 5 (worker 1) waits its turn; batch 7 (worker 0) is made before worker 0's batch 1,
    # which the loop waits for: 7 gets its memory though 5 came first.
    slots = {**BASE, 10: (LENT, t(0, 0)), 11: (IN_FLIGHT, t(0, 1)), 16: (READY, t(0, 6)),
             17: (WAITING, Task(0, 0, 7, None, 4096))}
    slots[15] = (WAITING, Task(1, 0, 5, None, 4096))
    scope: Any = Scope(Table(slots, rcvd_seq=1), [12, 13, 14, 16])
    OverflowBroker(LoaderMemory(), None, True, 4).grant(scope)
    assert scope.answered == [17] and 15 not in scope.grants
    for mm, _ in scope.grants.values():
        if mm is not None:
            mm.close()
