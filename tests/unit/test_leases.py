"""Leases: a slot comes back exactly once, whether its batch is dropped, released early, or
both, in any order and from any thread, and a stale return never takes back a slot lent again.
Slots come back as the consumer takes them: the scheduler's reclaim (batches gone) and the
released ones (``Consumer.take_returned``)."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from shmloader.main.lease import Leases
from shmloader.main.scheduler import Scheduler, SlotState


def base() -> np.ndarray:
    return np.zeros(4, dtype=np.uint8)


class Consumer(Leases):
    """A lease table with the consumer's scheduler beside it: a slot lent here is LENT there."""

    def __init__(self, slots: int = 64) -> None:
        super().__init__()
        self.sched = Scheduler(slots, 1)
        self.seq = 0  # the next batch's sequence number

    def lend(self, slot: int, base: np.ndarray) -> None:
        sched = self.sched
        assert sched.free_slots()[-1] == slot, "lend the slot the scheduler dispatches next"
        sched.dispatch(0, self.seq, [slot])
        sched.done(slot)
        sched.take(self.seq)
        self.seq += 1
        super().lend(slot, base)

    def take_returned(self) -> list[int]:
        """What the consumer's round takes back: released slots, then the reclaimed ones."""
        released = self.take_released()
        for slot in released:
            self.sched.give_back(slot)
        lent = [s for s in range(self.sched.num_slots) if self.sched.state(s) is SlotState.LENT]
        self.sched.reclaim(self.bases)
        self.sched.check()
        return released + [s for s in lent if self.sched.state(s) is SlotState.FREE]


def test_a_dropped_batch_returns_its_slot_once() -> None:
    leases = Consumer()
    b = base()
    leases.lend(0, b)
    assert leases.viewed_count() == 1
    del b
    assert leases.viewed_count() == 0
    assert leases.take_returned() == [0] and leases.take_returned() == []
    assert not leases.bases and not leases.released


def test_release_then_drop_returns_once() -> None:
    leases = Consumer()
    b = base()
    leases.lend(0, b)
    assert leases.release(0) is True and leases.release(0) is False
    assert leases.viewed_count() == 0
    del b  # its callback's entry is stale now
    assert leases.take_returned() == [0] and leases.take_returned() == []


def test_drop_then_release_before_the_consumer_looks_returns_once() -> None:
    leases = Consumer()
    b = base()
    leases.lend(0, b)
    del b
    leases.release(0)
    assert leases.take_returned() == [0] and not leases.bases and not leases.released


def test_a_stale_return_never_takes_back_the_slot_lent_again() -> None:
    leases = Consumer()
    old = base()
    leases.lend(0, old)
    leases.release(0)
    assert leases.take_returned() == [0]
    new = base()
    leases.lend(0, new)  # the same slot, a new batch
    del old  # the first batch's views go now: its return is stale
    assert leases.take_returned() == [] and leases.viewed_count() == 1
    del new
    assert leases.take_returned() == [0]


def test_batches_dropped_by_other_threads_come_back_exactly_once() -> None:
    n = 64
    leases = Consumer()
    bases = [base() for _ in range(n)]
    for slot, b in enumerate(bases):
        leases.lend(slot, b)
    held = [[b] for b in bases]
    del bases
    go = threading.Barrier(4)

    def drop(part: list[list[np.ndarray]]) -> None:
        go.wait()
        for box in part:
            box.clear()  # the last reference, dropped in this thread

    def release(slots: range) -> None:
        go.wait()
        for slot in slots:
            leases.release(slot)

    threads = [threading.Thread(target=drop, args=(held[: n // 2],)), threading.Thread(target=drop, args=(held[n // 2 :],)),
               threading.Thread(target=release, args=(range(0, n, 3),))]
    for t in threads:
        t.start()
    go.wait()
    taken = leases.take_returned()
    for t in threads:
        t.join()
    gc.collect()
    taken += leases.take_returned()
    assert sorted(taken) == list(range(n)) and leases.viewed_count() == 0 and not leases.bases and not leases.released


def test_a_view_of_a_view_keeps_the_slot_lent() -> None:
    # What a batch's last view is: a tensor over the base, a slice of it, a numpy view of that.
    import torch

    leases = Consumer()
    b = base()
    tensor = torch.from_numpy(b)
    leases.lend(0, b)
    del b
    part = tensor[1:].numpy()[::2]
    del tensor
    assert leases.viewed_count() == 1 and leases.take_returned() == []
    del part
    assert leases.take_returned() == [0] and leases.viewed_count() == 0


@pytest.mark.parametrize(
    "slots, workers, most",
    [(5, 2, 3), (3, 1, 2), (2, 1, 1), (9, 4, 5), (17, 8, 9), (5, 4, 2), (4, 2, 2), (3, 2, 2), (2, 2, 1)],
)
def test_most_lent_leaves_every_worker_a_slot_and_a_one_batch_loop_its_next(slots: int, workers: int, most: int) -> None:
    import types

    from shmloader.main.scope import RingScope

    scope = RingScope.__new__(RingScope)
    scope.sched = types.SimpleNamespace(num_slots=slots, num_workers=workers)  # type: ignore[assignment]
    assert scope.most_lent() == most
