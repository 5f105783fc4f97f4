"""The native slot table under random sequences of dispatch / done / overflow / grant / drop /
take / give back / kill / epoch: after every step it is exactly the Python model
(tests/slot_model.py) and its own invariants hold (``check``); every task of the current
epoch is taken at most once."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shmloader.main.scheduler import Scheduler, SlotState
from tests.conftest import examples
from tests.slot_model import ModelTable, same

SLOTS, WORKERS = 5, 2


class SlotMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.native = Scheduler(SLOTS, WORKERS, SLOTS - 1)
        self.model = ModelTable(SLOTS, WORKERS, SLOTS - 1)
        self.next_seq = 0
        self.taken: list[tuple[int, int]] = []  # (epoch, seq) taken by the consumer
        self.sent: set[tuple[int, int]] = set()  # (epoch, seq) dispatched

    def _slots(self, state: SlotState) -> list[int]:
        return [s for s, st in enumerate(self.model.state) if st is state]

    @precondition(lambda self: bool(self.model.free))
    @rule(worker=st.integers(0, WORKERS - 1))
    def dispatch(self, worker: int) -> None:
        assert self.native.dispatch(worker, self.next_seq, [self.next_seq]) == self.model.dispatch(
            worker, self.next_seq, [self.next_seq])
        self.sent.add((self.model.epoch, self.next_seq))
        self.next_seq += 1

    @precondition(lambda self: bool(self._slots(SlotState.IN_FLIGHT)))
    @rule(data=st.data())
    def done(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(self._slots(SlotState.IN_FLIGHT)))
        assert self.native.done(slot) == self.model.done(slot)

    @precondition(lambda self: bool(self._slots(SlotState.IN_FLIGHT)))
    @rule(data=st.data(), needed=st.integers(1, 1 << 20))
    def overflow(self, data: st.DataObject, needed: int) -> None:
        slot = data.draw(st.sampled_from(self._slots(SlotState.IN_FLIGHT)))
        assert self.native.overflowed(slot, needed) == self.model.overflowed(slot, needed)

    @precondition(lambda self: bool(self._slots(SlotState.WAITING)))
    @rule()
    def grant_or_drop(self) -> None:
        slot = self.native.waiting()[0]
        task = self.native.task_of(slot)
        assert task is not None
        if task.epoch == self.native.epoch:
            self.native.granted(slot)
            self.model.granted(slot)
        else:
            self.native.drop(slot)
            self.model.drop(slot)

    @precondition(lambda self: bool(self.model.ready()))
    @rule(data=st.data(), keep=st.booleans())
    def take(self, data: st.DataObject, keep: bool) -> None:
        seq = data.draw(st.sampled_from(sorted(self.model.ready())))
        slot = self.native.take(seq)
        assert slot == self.model.take(seq)
        self.taken.append((self.model.epoch, seq))
        if not keep:
            self.native.give_back(slot)
            self.model.give_back(slot)

    @precondition(lambda self: bool(self._slots(SlotState.LENT)))
    @rule(data=st.data())
    def give_back(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(self._slots(SlotState.LENT)))
        self.native.give_back(slot)
        self.model.give_back(slot)

    @rule(worker=st.integers(0, WORKERS - 1), to=st.integers(0, WORKERS - 1))
    def kill(self, worker: int, to: int) -> None:
        orphans = self.native.orphaned(worker)
        assert orphans == self.model.orphans(worker)
        for slot, task in orphans:
            if task.epoch == self.model.epoch:
                self.native.redispatch(slot, to, task.seq, task.index)
                self.model.redispatch(slot, to, task.seq, task.index)

    @rule()
    def new_epoch(self) -> None:
        self.native.new_epoch()
        self.model.new_epoch()
        self.next_seq = 0

    @invariant()
    def exactly_the_model(self) -> None:
        same(self.native, self.model)
        assert sum(self.native.count(s) for s in SlotState) == SLOTS
        assert len(self.taken) == len(set(self.taken)), "a task was taken twice"
        assert set(self.taken) <= self.sent


TestSlotMachine = SlotMachine.TestCase
TestSlotMachine.settings = settings(max_examples=examples(200), stateful_step_count=60, deadline=None)


def test_wrong_transitions_are_refused() -> None:
    table = Scheduler(2, 1)
    slot = table.dispatch(0, 0, [0])
    with pytest.raises(AssertionError, match=r"slot 0 is IN_FLIGHT, expected \[LENT\]"):
        table.give_back(slot)
    table.overflowed(slot, 100)
    with pytest.raises(AssertionError, match="slot 0 is WAITING"):
        table.done(slot)
    table.granted(slot)
    assert table.done(slot) and table.take(0) == slot
    with pytest.raises(KeyError):
        table.take(0)
    with pytest.raises(IndexError, match="slot 7 is not one of the 2 slots"):
        table.give_back(7)
    with pytest.raises(IndexError, match="worker 1 is not one of the 1 workers"):
        table.dispatch(1, 1, [1])
    table.give_back(slot)
    table.dispatch(0, 1, [1])
    table.dispatch(0, 2, [2])
    with pytest.raises(IndexError, match="no free slot"):
        table.dispatch(0, 3, [3])
    table.check()


def test_a_stale_request_for_memory_frees_its_slot() -> None:
    table = Scheduler(2, 1)
    slot = table.dispatch(0, 0, [0])
    table.new_epoch()
    assert table.overflowed(slot, 100) is False
    assert table.state(slot) is SlotState.FREE and table.load == (0,)
    table.check()


def test_resize_keeps_the_cursors_and_refuses_tasks() -> None:
    table = Scheduler(3, 2, 4, epoch=5)
    table.skip_result(2)  # (the cursors moved through their named operations only)
    table.bank_token()
    table.bank_token()
    table.start_round_robin_at(1)
    table.end_shard(0)
    slot = table.dispatch(1, 7, [7])
    with pytest.raises(AssertionError, match="1 slots still have tasks"):
        table.resize(9)
    table.done(slot)
    table.take(7)  # LENT: the old ring's, forgotten by the new table
    table.resize(9)
    table.check()
    assert (table.num_slots, table.n_free, table.epoch, table.send_seq, table.rcvd_seq, table.banked, table.rr,
            tuple(table.active), table.cap) == (9, 9, 5, 0, 3, 2, 1, (False, True), 4)


def test_the_cursors_are_read_only_from_outside_and_move_through_named_operations() -> None:
    table = Scheduler(3, 2, 4)
    for name in ("rr", "send_seq", "rcvd_seq", "banked", "own"):
        with pytest.raises(AttributeError):
            setattr(table, name, 1)
    table.set_own(True)
    assert table.own is True
    table.skip_result(0)
    assert table.rcvd_seq == 1
    with pytest.raises(ValueError, match=r"skip_result\(0\): results are already past it \(1\)"):
        table.skip_result(0)
    with pytest.raises(IndexError, match="worker 2 is not one of the 2 workers"):
        table.start_round_robin_at(2)


@pytest.mark.parametrize("table", [lambda: Scheduler(9, 4, 8, in_order=False), lambda: ModelTable(9, 4, 8, in_order=False)],
                         ids=["native", "model"])
def test_no_room_now_is_not_the_end_of_the_epoch(table: object) -> None:
    # torch, out of order: a task goes to an active worker with fewer than max_tasks // active
    # tasks. Shard 0 ended: 8 // 3 = 2 each, so 6 tasks fill every share while 8 may exist.
    t = table()  # type: ignore[operator]
    t.end_shard(0)
    for w in (1, 2, 3):
        for _ in range(2):
            t.dispatch(w, 0, [0])
    assert t.pick() == -1 and not t.exhausted  # nobody has room: wait for a result
    if isinstance(t, Scheduler):
        assert t.next_task(iter([[7]])) is None and not t.exhausted
        t.done(t.of_worker(2)[0])
        assert t.next_task(iter([[7]]))[0] == 2  # a result lowered worker 2's load: it has room again
    for w in (1, 2, 3):
        t.end_shard(w)
    assert t.exhausted  # every shard ended: the epoch has no more tasks
