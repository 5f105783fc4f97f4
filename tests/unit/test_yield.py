"""A sync next() whose batch is not ready yields its CPU a bounded, adaptive number of times
before it sleeps (README, "async for" section)."""

from __future__ import annotations

import mmap
from typing import Any

from shmloader import _native
from shmloader._consume import RingIterator
from shmloader._ring import YieldWait

SEM = 64  # the ready semaphore's offset in the test's buffer


class Ring:
    """The ready semaphore where RingIterator._yield_for_ready looks for it."""

    def __init__(self) -> None:
        self.mm = mmap.mmap(-1, 4096)
        self.ready_sem = SEM
        _native.sem_init(self.mm, SEM)


class Consumer:
    def __init__(self) -> None:
        self._ring: Any = Ring()
        self.yields = YieldWait()
        self._banked = 0


def look(consumer: Consumer) -> bool:
    return RingIterator._yield_for_ready(consumer)  # type: ignore[arg-type]


def test_misses_halve_the_bound_down_to_its_floor_and_a_hit_restores_it() -> None:
    c = Consumer()
    bounds = []
    for _ in range(6):
        bounds.append(c.yields.bound)
        assert not look(c) and c._banked == 0
    assert bounds == [64, 32, 16, 8, 4, 4] and (YieldWait.MOST, YieldWait.LEAST) == (64, 4)
    _native.sem_post(c._ring.mm, SEM)
    _native.sem_post(c._ring.mm, SEM)
    assert look(c) and c._banked == 1  # one token taken and banked for _collect...
    assert c.yields.bound == 64
    assert _native.sem_wait(c._ring.mm, SEM, 0) and not _native.sem_wait(c._ring.mm, SEM, 0)  # ...the other left


def test_yield_wait_says_how_many_yields_it_took_and_takes_one_token() -> None:
    ring = Ring()
    assert _native.yield_wait(ring.mm, SEM, 5) == 0  # none came within the bound
    _native.sem_post(ring.mm, SEM)
    assert _native.yield_wait(ring.mm, SEM, 0) == 0  # a bound of 0 does not look: the token stays
    assert _native.yield_wait(ring.mm, SEM, 5) == 1
    assert _native.yield_wait(ring.mm, SEM, 5) == 0
