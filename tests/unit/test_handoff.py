"""The hand-off protocol, model-checked: no lost wake-up (shmloader/README.md, "Hand-offs").

Every interleaving of the consumer's steps, yields and sleeps and the workers' takes, writes and
sleeps that the protocol allows (``tests/slot_model.Handoff``) is explored, state by distinct
state, on small rings: in each reachable state some process can move until the consumer has
taken the whole epoch; and the epoch it takes is every batch, exactly once (in order with
``in_order``). Each state is reached on the native table and on the model alike (twin rings):
the same answers, the same table, the same bytes and semaphores in the segment."""

from __future__ import annotations

from typing import Any

import pytest

from shmloader import _native
from shmloader.main.scheduler import Scheduler
from shmloader.wire.layout import RingGeometry
from shmloader.wire.ring import Ring
from tests.slot_model import (
    ARM,
    DRAIN,
    FINISHED,
    FLAG,
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
)

DATA = 4096


# workers, slots, cap, tasks, in_order, the cap it deepens to (0: none), an ``async for`` consumer
Config = tuple[int, int, int, int, bool, int, bool]


def run(config: Config, path: list[Any]) -> tuple[Handoff, Handoff]:
    """The native and the model runs after ``path`` (who moved, in turn), checked alike at its end.
    The caller closes their rings."""
    workers, slots, cap, tasks, in_order, deepen, bell = config
    geometry = RingGeometry(num_workers=workers, num_slots=slots, data_bytes=DATA)
    native_ring, model_ring = Ring(geometry), Ring(geometry)
    native = Scheduler(slots, workers, cap, in_order=in_order)
    native.attach(native_ring.mm, native_ring.header_offsets, native_ring.data_offsets, native_ring.data_bytes,
                  native_ring.queue_offsets, native_ring.queue_len, tuple(native_ring.task_sems),
                  native_ring.ready_sem)
    runs = (Handoff(native, native_ring, tasks, deepen, bell),
            Handoff(ModelTable(slots, workers, cap, in_order=in_order), model_ring, tasks, deepen, bell))
    for who in path:
        for r in runs:
            r.move(who)
    a, b = runs
    assert isinstance(a.table, Scheduler) and isinstance(b.table, ModelTable)
    same(a.table, b.table)
    assert native_ring.mm[:] == model_ring.mm[:]
    assert (a.consumer, a.workers, a.heads, a.delivered, a.bell) == (b.consumer, b.workers, b.heads, b.delivered, b.bell)
    return runs


def explore(config: Config) -> int:
    """Every distinct state reachable from the start; returns how many. Fails at a lost wake-up
    or a wrong epoch, with the path that led there."""
    tasks, in_order = config[3], config[4]
    seen: set[Any] = set()
    frontier: list[list[Any]] = [[]]
    while frontier:
        path = frontier.pop()
        native, model = run(config, path)
        try:
            key = model.key()
            if key in seen:
                continue
            seen.add(key)
            movers = model.movers()
            assert movers == native.movers(), path
            if model.consumer == FINISHED:
                got = model.delivered
                assert (got == list(range(tasks))) if in_order else sorted(got) == list(range(tasks)), (path, got)
                continue
            assert movers, f"a lost wake-up: nobody can move after {path} ({model.consumer}, {model.workers})"
            frontier.extend(path + [who] for who in movers)
        finally:
            native.ring.close()
            model.ring.close()
    return len(seen)


@pytest.mark.parametrize("config", [
    (1, 2, 1, 4, True, 0, False),  # one worker, one task at a time
    (2, 3, 2, 3, True, 0, False),  # torch's shape: two workers, a slot more than the tasks
    (2, 3, 2, 4, False, 0, False),
    (2, 2, 2, 4, True, 0, False),  # as many tasks as slots: the step's take frees the slot it refills
    (2, 5, 4, 5, True, 0, False),  # deeper than the workers' turn: tasks queue up
    (3, 4, 3, 4, True, 0, False),
    (2, 5, 2, 4, True, 4, False),  # the depth grows mid-epoch, at any point (Scheduler.set_cap)
    (2, 5, 2, 4, False, 4, False),
    (1, 2, 1, 4, True, 0, True),  # an async for: the doorbell, not the semaphore's wait
    (2, 3, 2, 3, True, 0, True),
    (2, 3, 2, 4, False, 0, True),
], ids=lambda c: f"{c[0]}w-{c[1]}slots-cap{c[2]}{f'-to-{c[5]}' if c[5] else ''}-{c[3]}tasks-"
                 f"{'in' if c[4] else 'out-of'}-order{'-async' if c[6] else ''}")
def test_no_interleaving_loses_a_wake_up(config: Config) -> None:
    assert explore(config) > 60  # (every state the protocol allows, each reached on both tables)


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
        explore((2, 3, 2, 3, True, 0, False))


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
