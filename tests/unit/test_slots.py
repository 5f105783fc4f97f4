"""SlotTable under random sequences of dispatch / done / overflow / grant / take / give back /
kill / epoch: every slot is always in exactly one state, the per-worker load and the
outstanding count stay exact, and every task of the current epoch is taken exactly once."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shmloader._slots import SlotState, SlotTable


class SlotMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = SlotTable(num_slots=5, num_workers=2)
        self.next_seq = 0
        self.taken: list[tuple[int, int]] = []  # (epoch, seq) taken by the consumer
        self.sent: set[tuple[int, int]] = set()  # (epoch, seq) dispatched

    def _slots(self, state: SlotState) -> list[int]:
        return [s for s, st in enumerate(self.table.state) if st is state]

    @precondition(lambda self: bool(self.table.free))
    @rule(worker=st.integers(0, 1))
    def dispatch(self, worker: int) -> None:
        self.table.dispatch(worker, self.next_seq, [self.next_seq])
        self.sent.add((self.table.epoch, self.next_seq))
        self.next_seq += 1

    @precondition(lambda self: bool(self._slots(SlotState.IN_FLIGHT)))
    @rule(data=st.data())
    def done(self, data: st.DataObject) -> None:
        self.table.done(data.draw(st.sampled_from(self._slots(SlotState.IN_FLIGHT))))

    @precondition(lambda self: bool(self._slots(SlotState.IN_FLIGHT)))
    @rule(data=st.data(), needed=st.integers(1, 1 << 20))
    def overflow(self, data: st.DataObject, needed: int) -> None:
        self.table.overflowed(data.draw(st.sampled_from(self._slots(SlotState.IN_FLIGHT))), needed)

    @precondition(lambda self: bool(self.table.waiting()))
    @rule()
    def grant_or_drop(self) -> None:
        slot = self.table.waiting()[0]
        if self.table.tasks[slot].epoch == self.table.epoch:
            self.table.granted(slot)
        else:
            self.table.drop(slot)

    @precondition(lambda self: bool(self.table.ready))
    @rule(data=st.data(), keep=st.booleans())
    def take(self, data: st.DataObject, keep: bool) -> None:
        seq = data.draw(st.sampled_from(sorted(self.table.ready)))
        slot = self.table.take(seq)
        self.taken.append((self.table.epoch, seq))
        if not keep:
            self.table.give_back(slot)

    @precondition(lambda self: bool(self._slots(SlotState.LENT)))
    @rule(data=st.data())
    def give_back(self, data: st.DataObject) -> None:
        self.table.give_back(data.draw(st.sampled_from(self._slots(SlotState.LENT))))

    @rule(worker=st.integers(0, 1), to=st.integers(0, 1))
    def kill(self, worker: int, to: int) -> None:
        for slot, task in self.table.orphans(worker):
            if task.epoch == self.table.epoch:
                self.table.redispatch(slot, task, to)

    @rule()
    def new_epoch(self) -> None:
        self.table.new_epoch()
        self.next_seq = 0

    @invariant()
    def consistent(self) -> None:
        self.table.check()
        counts = [self.table.count(s) for s in SlotState]
        assert sum(counts) == self.table.num_slots
        assert len(self.taken) == len(set(self.taken)), "a task was taken twice"
        assert set(self.taken) <= self.sent


TestSlotMachine = SlotMachine.TestCase
TestSlotMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)


def test_wrong_transitions_are_refused() -> None:
    table = SlotTable(num_slots=2, num_workers=1)
    slot = table.dispatch(0, 0, [0])
    with pytest.raises(AssertionError, match="slot 0 is IN_FLIGHT, expected"):
        table.give_back(slot)
    table.overflowed(slot, 100)
    with pytest.raises(AssertionError, match="slot 0 is WAITING"):
        table.done(slot)
    table.granted(slot)
    assert table.done(slot) is not None and table.take(0) == slot
    table.give_back(slot)
    table.check()


def test_a_stale_request_for_memory_frees_its_slot() -> None:
    table = SlotTable(num_slots=2, num_workers=1)
    slot = table.dispatch(0, 0, [0])
    table.new_epoch()
    assert table.overflowed(slot, 100) is None
    assert table.state[slot] is SlotState.FREE and table.load == [0]
    table.check()
