"""``_native.dispatch_next`` makes the next task of an in-order epoch exactly as the Python it
stands for does (``Dispatcher.pick``, ``next(sampler)``, ``SlotTable.dispatch``,
``Ring.post_task``): over random slot tables, worker sets, queue tails and indices (lists of
ints, ranges, lists that are not all int64 ints, indices too long for a slot), each call leaves
the table, the round robin, the segment's bytes and the task semaphores as that Python does on
a twin ring, and answers the same."""

from __future__ import annotations

import copy
import random
from typing import Any, Iterator

import pytest

from shmloader import _native
from shmloader._consume import _DISPATCH
from shmloader._dispatch import Dispatcher
from shmloader._layout import RingGeometry
from shmloader._ring import POSTED, Ring
from shmloader._slots import SlotState, SlotTable

SLOTS, WORKERS, DATA = 5, 3, 4096  # a slot's data holds 512 int64 values


def indices(rng: random.Random, n: int) -> list[Any]:
    out: list[Any] = []
    for _ in range(n):
        kind = rng.randrange(6)
        if kind == 0:
            out.append([rng.randrange(-2**63, 2**63) for _ in range(rng.randrange(0, 40))])
        elif kind == 1:
            start = rng.randrange(0, 10**6)
            out.append(range(start, start + rng.randrange(0, 600), rng.choice((1, 1, 3, -2))))
        elif kind == 2:
            out.append([rng.randrange(100) for _ in range(rng.randrange(500, 530))])  # fits, or just not
        elif kind == 3:
            out.append([1, 2, rng.choice(("3", 3.0, 2**63, None))])  # not all int64 ints
        elif kind == 4:
            out.append((1, 2, 3))  # not a list: pickled by the caller
        else:
            out.append([rng.randrange(10**9)])
    return out


def sem_tokens(ring: Ring) -> list[int]:
    """Drains every task semaphore of ``ring``; the tokens each held."""
    counts = []
    for w in range(ring.geometry.num_workers):
        n = 0
        while _native.sem_wait(ring.mm, ring.task_sems[w], 0):
            n += 1
        counts.append(n)
    return counts


def model(table: SlotTable, dispatcher: Dispatcher, ring: Ring, sampler: Iterator[Any], seq: int) -> tuple[Any, ...]:
    """What one call must do, in the Python it stands for: (code, slot, worker, index)."""
    wid = dispatcher.pick(table.load, WORKERS * 2)
    if wid is None:
        return -1, None, -1, None
    try:
        index = next(sampler)
    except StopIteration:
        return -2, None, wid, None
    slot = table.dispatch(wid, seq, index)
    return int(ring.post_task(wid, slot, table.epoch, seq, index) == POSTED), slot, wid, index


def shuffle_table(rng: random.Random, table: SlotTable) -> None:
    """Random transitions of the table's own kinds: tasks done, results taken, slots given back."""
    for _ in range(rng.randrange(6)):
        in_flight = [s for s, st in enumerate(table.state) if st is SlotState.IN_FLIGHT]
        lent = [s for s, st in enumerate(table.state) if st is SlotState.LENT]
        if in_flight and rng.random() < 0.5:
            task = table.done(rng.choice(in_flight))
            if task is not None and rng.random() < 0.7:
                table.take(task.seq)
        elif lent:
            table.give_back(rng.choice(lent))


@pytest.mark.parametrize("seed", range(30))
def test_dispatch_next_makes_the_pythons_task(seed: int) -> None:
    rng = random.Random(seed)
    geometry = RingGeometry(num_workers=WORKERS, num_slots=SLOTS, data_bytes=DATA)
    want_ring, got_ring = Ring(geometry), Ring(geometry)
    try:
        want_table = SlotTable(SLOTS, WORKERS, epoch=rng.randrange(3))
        want_disp = Dispatcher(WORKERS, iterable=False, in_order=True)
        feed = indices(rng, rng.randrange(10, 200))  # an epoch that may end within the walk
        want_it, got_it = iter(feed), iter(copy.deepcopy(feed))
        seq = 0
        for step in range(200):
            shuffle_table(rng, want_table)
            if rng.random() < 0.2:
                want_disp.active = [rng.random() < 0.6 for _ in range(WORKERS)]
            if rng.random() < 0.1:
                want_disp.next_rr = rng.randrange(WORKERS)
            if not want_table.free:
                continue
            got_table, got_disp = copy.deepcopy(want_table), copy.deepcopy(want_disp)
            got_ring._tails[:] = want_ring._tails
            got_ring.mm[:] = want_ring.mm[:]
            want = model(want_table, want_disp, want_ring, want_it, seq)
            code, got_disp.next_rr, slot, wid, index = _native.dispatch_next(
                got_it, got_disp.active, got_disp.next_rr, got_table.load, got_table.free, got_table.state,
                got_table.tasks, got_table.epoch, seq, got_ring.posting, _DISPATCH)
            if code >= 0:
                got_table.outstanding += 1  # the caller's part
                seq += 1
            assert (code, slot, wid, index) == want, step
            assert got_disp.next_rr == want_disp.next_rr
            assert (got_table.state, got_table.free, got_table.tasks, got_table.load, got_table.outstanding) == (
                want_table.state, want_table.free, want_table.tasks, want_table.load, want_table.outstanding)
            assert all(type(t) is type(w) for t, w in zip(got_table.tasks.values(), want_table.tasks.values()))
            assert got_ring._tails == want_ring._tails
            assert got_ring.mm[:] == want_ring.mm[:], step
            assert sem_tokens(got_ring) == sem_tokens(want_ring)
            got_table.check()
    finally:
        want_ring.close()
        got_ring.close()


def test_dispatch_next_takes_nothing_when_it_cannot_dispatch() -> None:
    geometry = RingGeometry(num_workers=2, num_slots=3, data_bytes=DATA)
    ring = Ring(geometry)
    try:
        table = SlotTable(3, 2)

        def call(sampler: Any, free: list[int] | None = None, state: list[Any] | None = None) -> Any:
            return _native.dispatch_next(sampler, [True, True], 0, table.load, table.free if free is None else free,
                                         table.state if state is None else state, table.tasks, 0, 0, ring.posting,
                                         _DISPATCH)

        def failing() -> Iterator[Any]:
            raise KeyError("the sampler's own error")
            yield

        before = copy.deepcopy((table.state, table.free, table.tasks, table.load, ring._tails))
        with pytest.raises(KeyError, match="the sampler's own error"):
            call(failing())
        assert (table.state, table.free, table.tasks, table.load, ring._tails) == before
        assert sem_tokens(ring) == [0, 0]
        sampler = iter([[1, 2]])
        with pytest.raises(ValueError, match="no free slot"):
            call(sampler, free=[])
        lent = [SlotState.FREE, SlotState.FREE, SlotState.LENT]
        with pytest.raises(AssertionError, match=r"slot 2 is LENT, expected \['FREE'\]"):
            call(sampler, free=[2], state=lent)
        assert next(sampler) == [1, 2], "a refused call took the sampler's index"
        with pytest.raises(TypeError, match="wrong container types"):
            _native.dispatch_next(iter([]), (True, True), 0, table.load, table.free, table.state, table.tasks, 0, 0,
                                  ring.posting, _DISPATCH)
        with pytest.raises(TypeError, match="wrong container types"):  # an iterable, not an iterator
            _native.dispatch_next([[1, 2]], [True, True], 0, table.load, table.free, table.state, table.tasks, 0, 0,
                                  ring.posting, _DISPATCH)
        with pytest.raises(TypeError, match="sizes disagree"):
            _native.dispatch_next(iter([]), [True], 0, table.load, table.free, table.state, table.tasks, 0, 0,
                                  ring.posting, _DISPATCH)
        with pytest.raises(ValueError, match="out of range"):
            _native.dispatch_next(iter([]), [True, True], 2, table.load, table.free, table.state, table.tasks, 0, 0,
                                  ring.posting, _DISPATCH)
        assert (table.state, table.free, table.tasks, table.load, ring._tails) == before
    finally:
        ring.close()
