"""The hand-off protocol, model-checked: no lost wake-up (shmloader/README.md, "Hand-offs").

Every interleaving of the consumer's steps, yields and sleeps and the workers' takes, writes and
sleeps that the protocol allows (``tests/slot_model.Handoff``) is explored, state by distinct
state, on small rings: in each reachable state some process can move until the consumer has
taken the whole epoch; and the epoch it takes is every batch, exactly once (in order with
``in_order``). Each state that a move of the consumer (or the depth's) led to is reached on the
native table too (twin rings): the same answers, the same table, the same bytes and semaphores
in the segment. (A worker's move runs the same code on both rings; each distinct state is
checked once, by the first path that reached it.)"""

from __future__ import annotations

from typing import Any

import pytest

from shmloader import _native
from shmloader.main.scheduler import Scheduler
from shmloader.wire.layout import AWAIT_ANY, AWAIT_NONE, Field, RingGeometry
from shmloader.wire.ring import Ring
from tests.slot_model import (
    ARM,
    ASLEEP,
    AWAIT,
    DRAIN,
    FINISHED,
    FLAG,
    LAST,
    LOOK,
    PEEK,
    POST,
    RING,
    RINGING,
    RUN,
    TAKE,
    WRITE,
    Handoff,
    ModelTable,
    same,
    word,
)

DATA = 4096


# workers, slots, cap, tasks, in_order, the cap it deepens to (0: none), an ``async for`` consumer
Config = tuple[int, int, int, int, bool, int, bool]


def replay(config: Config, path: list[Any], native: bool) -> Handoff:
    """The run after ``path`` (who moved, in turn) on the native table or on the model. The
    caller closes its ring."""
    workers, slots, cap, tasks, in_order, deepen, bell = config
    ring = Ring(RingGeometry(num_workers=workers, num_slots=slots, data_bytes=DATA))
    table: Scheduler | ModelTable = ModelTable(slots, workers, cap, in_order=in_order)
    if native:
        table = Scheduler(slots, workers, cap, in_order=in_order)
        table.attach(ring.mm, ring.header_offsets, ring.data_offsets, ring.data_bytes, ring.queue_offsets,
                     ring.queue_len, tuple(ring.task_sems), ring.ready_sem)
    run = Handoff(table, ring, tasks, deepen, bell)
    for who in path:
        run.move(who)
    return run


def alike(a: Handoff, b: Handoff) -> None:
    """The native run ``a`` and the model's ``b`` are in the same state."""
    assert isinstance(a.table, Scheduler) and isinstance(b.table, ModelTable)
    same(a.table, b.table)
    assert a.ring.mm[:] == b.ring.mm[:]
    assert (a.consumer, a.workers, a.heads, a.delivered, a.bell) == (b.consumer, b.workers, b.heads, b.delivered, b.bell)


def explore(config: Config) -> int:
    """Every distinct state reachable from the start; returns how many. Fails at a lost wake-up
    or a wrong epoch, with the path that led there. The model's run goes from state to state
    (a move from a snapshot). Each new state that a move of the consumer (or the depth's) led to
    is reached on the native table too, by its path, and must be the model's: a worker's move
    runs the same code on both (``Handoff._worker``, on the ring alone)."""
    tasks, in_order = config[3], config[4]
    model = replay(config, [], native=False)
    seen: set[Any] = set()
    frontier: list[tuple[Any, list[Any]]] = [(model.snapshot(), [])]  # (the state before the path's last move, the path)
    try:
        while frontier:
            before, path = frontier.pop()
            model.restore(before)
            if path:
                model.move(path[-1])
            key = model.key()
            if key in seen:
                continue
            seen.add(key)
            movers = model.movers()
            if not path or not isinstance(path[-1], int):  # (a worker's move runs the same code on both)
                native = replay(config, path, native=True)
                try:
                    alike(native, model)
                    assert movers == native.movers(), path
                finally:
                    native.ring.close()
            if model.consumer == FINISHED:
                got = model.delivered
                assert (got == list(range(tasks))) if in_order else sorted(got) == list(range(tasks)), (path, got)
                continue
            assert movers, f"a lost wake-up: nobody can move after {path} ({model.consumer}, {model.workers})"
            now = model.snapshot()
            frontier.extend((now, path + [who]) for who in movers)
    finally:
        model.ring.close()
    return len(seen)


@pytest.mark.parametrize("config", [
    (1, 2, 1, 4, True, 0, False),  # one worker, one task at a time
    (2, 3, 2, 3, True, 0, False),  # torch's shape: two workers, a slot more than the tasks
    (2, 3, 2, 4, False, 0, False),
    (2, 2, 2, 4, True, 0, False),  # as many tasks as slots: the step's take frees the slot it refills
    (2, 5, 4, 4, True, 0, False),  # deeper than the workers' turn: tasks queue up
    (3, 4, 3, 3, True, 0, False),
    (2, 3, 2, 4, True, 3, False),  # the depth grows mid-epoch, at any point (Scheduler.set_cap), slots reused
    (2, 5, 2, 3, False, 4, False),
    (1, 2, 1, 4, True, 0, True),  # an async for: the doorbell, not the semaphore's wait
    (2, 3, 2, 3, True, 0, True),
    (2, 3, 2, 4, False, 0, True),
], ids=lambda c: f"{c[0]}w-{c[1]}slots-cap{c[2]}{f'-to-{c[5]}' if c[5] else ''}-{c[3]}tasks-"
                 f"{'in' if c[4] else 'out-of'}-order{'-async' if c[6] else ''}")
def test_no_interleaving_loses_a_wake_up(config: Config) -> None:
    assert explore(config) > 60  # (every state the protocol allows; the consumer's, on both tables)


def test_a_token_dropped_instead_of_banked_is_a_lost_wake_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # The check itself: a consumer that takes a token while it yields and forgets it (does not
    # bank it) leaves a published slot nobody will collect; the exploration finds the state
    # where everyone sleeps.
    real = Handoff._consumer

    def forgets(self: Handoff) -> None:
        if self.consumer == LOOK and _native.sem_wait(self.ring.mm, self.ring.ready_sem, 0):
            self.consumer = RUN  # (the token is gone, and nothing was banked)
            return
        real(self)

    monkeypatch.setattr(Handoff, "_consumer", forgets)
    with pytest.raises(AssertionError, match=r"a lost wake-up: nobody can move after .* \(asleep, \['asleep', 'asleep'\]\)"):
        explore((2, 3, 2, 4, False, 0, False))  # (out of order: any result wakes it, and the last one is gone)


def test_a_token_posted_before_done_is_a_lost_wake_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # A worker that posts its token before it stores DONE: the consumer may take the token, find
    # nothing DONE, bank it and sleep; DONE then comes with no token to wake it.
    real = Handoff._worker

    def posts_first(self: Handoff, w: int) -> None:
        state = self.workers[w]
        if isinstance(state, tuple) and state[0] == WRITE:
            _native.sem_post(self.ring.mm, self.ring.ready_sem)
            self.workers[w] = (POST, state[1])
        elif isinstance(state, tuple) and state[0] == POST:
            self.workers[w] = (WRITE, state[1])
            real(self, w)  # (the result and DONE, now)
            self.workers[w] = TAKE
        else:
            real(self, w)

    monkeypatch.setattr(Handoff, "_worker", posts_first)
    with pytest.raises(AssertionError, match=r"a lost wake-up"):
        explore((2, 3, 2, 3, True, 0, False))


def test_a_doorbell_drained_after_the_last_look_is_a_lost_wake_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # An async for that looks for a token before it drains the doorbell: a worker may post and
    # ring between the look and the drain, and the drain swallows the only ring.
    real = Handoff._async_wait

    def peeks_first(self: Handoff) -> None:  # the real moves, in the order arm, peek, drain, ring
        was = self.consumer
        real(self)
        if was == ARM:
            self.consumer = PEEK
        elif was == PEEK and self.consumer == RINGING:
            self.consumer = DRAIN
        elif was == DRAIN:
            self.consumer = RINGING

    monkeypatch.setattr(Handoff, "_async_wait", peeks_first)
    with pytest.raises(AssertionError, match=r"a lost wake-up: nobody can move after .* \(ringing, "):
        explore((2, 3, 2, 3, True, 0, True))


def test_a_flag_read_before_the_post_is_a_lost_wake_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # A worker that reads the doorbell flag before it posts its token (no fence between them, as
    # a store-load reordering would have it): it sees no waiter, the consumer arms, drains and
    # looks before the token comes, and nobody rings.
    real = Handoff._worker

    def reads_first(self: Handoff, w: int) -> None:
        state = self.workers[w]
        if isinstance(state, tuple) and state[0] == POST:
            ring = self.ring
            flag = int.from_bytes(ring.mm[ring.doorbell_flag:ring.doorbell_flag + 8], "little")
            self.workers[w] = (FLAG, state[1], flag)
        elif isinstance(state, tuple) and state[0] == FLAG:
            _native.sem_post(self.ring.mm, self.ring.ready_sem)
            self.workers[w] = (RING, state[1]) if state[2] else TAKE
        else:
            real(self, w)

    monkeypatch.setattr(Handoff, "_worker", reads_first)
    with pytest.raises(AssertionError, match=r"a lost wake-up: nobody can move after .* \(ringing, "):
        explore((2, 3, 2, 3, True, 0, True))


def test_a_result_named_after_the_last_look_is_a_lost_wake_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # A sync next() that looks for a token before it names the result it waits for: the result
    # may be published between the look and the naming, its worker reading the word unset, and
    # nobody posts the wake semaphore.
    real = Handoff._sleep

    def names_late(self: Handoff) -> None:
        ring = self.ring
        if self.consumer == AWAIT:  # the last look, first: the ready semaphore alone
            if ring.take_ready(0):
                self.table.bank_token()
                self.consumer = RUN
            else:
                self.consumer = LAST
        elif self.consumer == LAST:  # then the naming, and the sleep
            awaiting = self.table.awaited()
            ring.await_result(None if awaiting is None else awaiting[1])
            self.consumer = ASLEEP
        else:
            real(self)

    monkeypatch.setattr(Handoff, "_sleep", names_late)
    with pytest.raises(AssertionError, match=r"a lost wake-up: nobody can move after .* \(asleep, "):
        explore((2, 3, 2, 3, True, 0, False))


def test_a_last_look_blind_to_the_named_result_is_a_lost_wake_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # A last look at the ready semaphore alone: the named result may have been published before
    # it was named, its token taken by an earlier look and matched with another DONE slot; no
    # token is left, its worker read the word unset, and the consumer sleeps beside a DONE slot.
    real = Handoff._sleep

    def blind(self: Handoff) -> None:
        if self.consumer == LAST:
            self.awaiting = None  # (the named slot is not looked at)
        real(self)

    monkeypatch.setattr(Handoff, "_sleep", blind)
    with pytest.raises(AssertionError, match=r"a lost wake-up: nobody can move after .* \(asleep, "):
        explore((2, 3, 2, 3, True, 0, False))


def test_the_awaited_word_read_before_the_post_is_a_lost_wake_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # A worker that reads the awaited word before it posts its ready token (no fence between
    # them): it sees nothing named, the consumer names its result and looks before the token
    # comes (and before DONE shows, were DONE stored as late), and nobody posts the wake.
    real = Handoff._worker

    def reads_first(self: Handoff, w: int) -> None:
        state, ring = self.workers[w], self.ring
        if isinstance(state, tuple) and state[0] == WRITE:  # the word read before DONE and the post
            awaited = word(ring, ring.awaited_word)
            self.workers[w] = (FLAG, state[1], awaited)
        elif isinstance(state, tuple) and state[0] == FLAG and len(state) == 3:
            self.workers[w] = (WRITE, state[1])
            real(self, w)  # (the result and DONE)
            _native.sem_post(ring.mm, ring.ready_sem)
            if state[2] == AWAIT_ANY or (state[2] != AWAIT_NONE and state[2] == ring.headers[state[1]][Field.R_SEQ] + 1):
                _native.sem_post(ring.mm, ring.wake_sem)
            self.workers[w] = TAKE
        else:
            real(self, w)

    monkeypatch.setattr(Handoff, "_worker", reads_first)
    with pytest.raises(AssertionError, match=r"a lost wake-up: nobody can move after .* \(asleep, "):
        explore((2, 3, 2, 3, True, 0, False))
