"""A sync next() whose batch is not ready yields its CPU a bounded, adaptive number of times
before it sleeps (README, "async for" section)."""

from __future__ import annotations

import mmap
import types

import pytest

from shmloader import _native
from shmloader._stats import Counters
from shmloader.main.scheduler import Scheduler
from shmloader.main.wait import Ready, Waiter
from shmloader.wire import ring as ring_module
from shmloader.wire.ring import YieldWait

SEM = 64  # the ready semaphore's offset in the test's buffer


class Ring:
    """The ready semaphore where the waiter looks for it."""

    def __init__(self) -> None:
        self.mm = mmap.mmap(-1, 4096)
        self.ready_sem = SEM
        _native.sem_init(self.mm, SEM)


def scope() -> types.SimpleNamespace:
    """What a wait for a ready slot reads of the current ring's scope."""
    return types.SimpleNamespace(ring=Ring(), sched=Scheduler(1, 1))


def no_sleep() -> None:
    raise AssertionError("a token came while yielding: nothing is checked, nobody sleeps")


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The yields' clock, made the test's: each reading advances it by ``step[0]`` ns (1 µs: an
    idle CPU's yield; a busy CI machine's real yields could look contended)."""
    step = [1_000]
    now = [0]

    def read() -> int:
        now[0] += step[0]
        return now[0]

    monkeypatch.setattr(ring_module, "_clock", read)
    return step


def test_misses_halve_the_bound_down_to_its_floor_and_a_hit_restores_it(clock: list[int]) -> None:
    ring = Ring()
    yields = YieldWait()
    bounds = []
    for _ in range(6):
        bounds.append(yields.bound)
        assert not yields(ring.mm, SEM)
    assert bounds == [64, 32, 16, 8, 4, 4] and (YieldWait.MOST, YieldWait.LEAST) == (64, 4)
    _native.sem_post(ring.mm, SEM)
    _native.sem_post(ring.mm, SEM)
    assert yields(ring.mm, SEM)  # one token taken...
    assert yields.bound == 64
    assert _native.sem_wait(ring.mm, SEM, 0) and not _native.sem_wait(ring.mm, SEM, 0)  # ...the other left


def test_a_token_taken_while_yielding_is_banked_for_the_step() -> None:
    w = Waiter(None, Counters())  # type: ignore[arg-type]
    current = scope()
    mm = current.ring.mm
    _native.sem_post(mm, SEM)
    _native.sem_post(mm, SEM)
    w.block(Ready(current), no_sleep, None)  # type: ignore[arg-type]
    assert current.sched.banked == 1  # one token banked (a token means "look for DONE slots")...
    assert _native.sem_wait(mm, SEM, 0) and not _native.sem_wait(mm, SEM, 0)  # ...the other left


def test_yield_wait_says_how_many_yields_it_took_and_takes_one_token() -> None:
    ring = Ring()
    assert _native.yield_wait(ring.mm, SEM, 5) == 0  # none came within the bound
    _native.sem_post(ring.mm, SEM)
    assert _native.yield_wait(ring.mm, SEM, 0) == 0  # a bound of 0 does not look: the token stays
    assert _native.yield_wait(ring.mm, SEM, 5) == 1
    assert _native.yield_wait(ring.mm, SEM, 5) == 0


def test_contended_yields_stop_yielding_for_a_while_then_yields_are_tried_again(
        clock: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    # A yield that takes a neighbour's whole slice (here 1 ms each) is contended: the next QUIET
    # waits sleep at once (no yield at all), then a wait tries `least` yields again.
    ring = Ring()
    calls: list[int] = []
    real = _native.yield_wait

    def counted(mm: mmap.mmap, sem: int, bound: int) -> int:
        calls.append(bound)
        return real(mm, sem, bound)

    monkeypatch.setattr(_native, "yield_wait", counted)
    monkeypatch.setattr(YieldWait, "QUIET", 3)
    yields = YieldWait()
    clock[0] = YieldWait.CONTENDED_NS * 64 + 1  # 64 yields at just over CONTENDED_NS each
    assert not yields(ring.mm, SEM) and calls == [64]
    clock[0] = 1_000
    for _ in range(3):
        assert not yields(ring.mm, SEM)  # quiet: the caller sleeps on the semaphore at once
    assert calls == [64]
    _native.sem_post(ring.mm, SEM)
    assert yields(ring.mm, SEM) and calls == [64, 4]  # tried again, from the floor: a token came
    assert yields.bound == 64  # uncontended, it yields as before


def test_a_token_found_by_contended_yields_is_still_taken(clock: list[int]) -> None:
    ring = Ring()
    yields = YieldWait()
    _native.sem_post(ring.mm, SEM)
    clock[0] = 10 * YieldWait.CONTENDED_NS  # the one yield before the token came took a slice
    assert yields(ring.mm, SEM)  # the token it took is the caller's
    assert yields.quiet == YieldWait.QUIET and not _native.sem_wait(ring.mm, SEM, 0)
