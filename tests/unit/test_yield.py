"""A sync next() whose batch is not ready yields its CPU a bounded, adaptive number of times
before it sleeps (README, "async for" section)."""

from __future__ import annotations

import mmap
import types
from typing import Any

import pytest

from shmloader import _native
from shmloader._stats import Counters
from shmloader.main.scheduler import Scheduler
from shmloader.main.wait import Ready, Waiter
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
def yields_slow(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The yields' speed, made the test's: ``yields_slow[0]`` says whether a wait's yields were
    slow (another process's slice); the yields and looks are real. (A busy CI machine's real
    yields could look slow.)"""
    slow = [False]
    bounds: list[int] = []

    def timed(mm: mmap.mmap, sem: int, bound: int, slow_ns: int) -> tuple[int, bool]:
        bounds.append(bound)
        return _native.yield_wait(mm, sem, 1 if slow[0] else bound), slow[0]

    monkeypatch.setattr(_native, "yield_wait_timed", timed)
    slow.append(bounds)  # type: ignore[arg-type]
    return slow


def test_misses_halve_the_bound_down_to_its_floor_and_a_hit_restores_it(yields_slow: list[Any]) -> None:
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
    assert w.counters.waits == 1 and w.counters.blocked_s > 0  # (main.depth: how long a wait is)


def test_yield_wait_says_how_many_yields_it_took_and_takes_one_token() -> None:
    ring = Ring()
    assert _native.yield_wait(ring.mm, SEM, 5) == 0  # none came within the bound
    _native.sem_post(ring.mm, SEM)
    assert _native.yield_wait(ring.mm, SEM, 0) == 0  # a bound of 0 does not look: the token stays
    assert _native.yield_wait(ring.mm, SEM, 5) == 1
    assert _native.yield_wait(ring.mm, SEM, 5) == 0


def started() -> YieldWait:
    """A waiter past its first wait, which was fast (yields were not contended then)."""
    yields = YieldWait()
    assert not yields(Ring().mm, SEM) and not yields.probing
    return yields


def test_a_first_wait_that_is_slow_makes_a_short_quiet_spell_then_the_usual_ones(
        yields_slow: list[Any]) -> None:
    # A fresh waiter knows nothing: beside a neighbour every wait until STRIKES would hand it a
    # slice (a loader's first hundred batches took 4-16 ms per 25), so one slow first wait is
    # enough. A process starting up is slow beside its peers on any machine, though: that first
    # spell is short (FIRST_QUIET), and only a slow wait after it makes the usual QUIET spell.
    ring = Ring()
    yields = YieldWait()
    yields_slow[0] = True
    assert not yields(ring.mm, SEM)
    assert yields.quiet == YieldWait.FIRST_QUIET < YieldWait.QUIET
    for _ in range(YieldWait.FIRST_QUIET):
        assert not yields(ring.mm, SEM)
    assert not yields(ring.mm, SEM)  # tried again, slow: the usual spell
    assert yields.quiet == YieldWait.QUIET


def test_slow_yields_in_a_row_make_a_quiet_spell_then_yields_are_tried_again(
        yields_slow: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # Yields that take a neighbour's slice: each slow wait stops at its slow yield and the next
    # yield `least` times; STRIKES of them in a row make the next QUIET waits sleep at once (no
    # yield at all). Then `least` yields again; slow at once, it is quiet again at once.
    ring = Ring()
    bounds = yields_slow[1]
    monkeypatch.setattr(YieldWait, "QUIET", 3)
    yields = started()
    bounds.clear()
    yields_slow[0] = True
    for _ in range(YieldWait.STRIKES):
        assert not yields(ring.mm, SEM)
    assert bounds == [32, 4, 4, 4] and yields.quiet == 3
    for _ in range(3):
        assert not yields(ring.mm, SEM)  # quiet: the caller sleeps on the semaphore at once
    assert len(bounds) == 4
    assert not yields(ring.mm, SEM)  # tried again, slow at once: quiet again
    assert bounds[4:] == [4] and yields.quiet == 3
    for _ in range(3):
        yields(ring.mm, SEM)
    yields_slow[0] = False
    _native.sem_post(ring.mm, SEM)
    assert yields(ring.mm, SEM) and bounds[5:] == [4]  # fast again: a token came
    assert yields.bound == 64 and not yields.probing  # it yields as before: a next spell needs STRIKES again


def test_one_slow_wait_is_a_peers_pause_not_a_neighbour(yields_slow: list[Any]) -> None:
    ring = Ring()
    yields = started()
    yields_slow[0] = True
    assert not yields(ring.mm, SEM)
    yields_slow[0] = False
    assert not yields(ring.mm, SEM)  # a fast wait: the strikes start over
    yields_slow[0] = True
    for _ in range(YieldWait.STRIKES - 1):
        assert not yields(ring.mm, SEM)
    assert yields.quiet == 0


def test_a_token_found_after_a_slow_yield_is_still_taken(yields_slow: list[Any]) -> None:
    ring = Ring()
    yields = YieldWait()
    _native.sem_post(ring.mm, SEM)
    yields_slow[0] = True
    assert yields(ring.mm, SEM)  # the token it took is the caller's
    assert not _native.sem_wait(ring.mm, SEM, 0)


def test_yield_wait_timed_stops_at_a_slow_yield_and_takes_a_token() -> None:
    ring = Ring()
    assert _native.yield_wait_timed(ring.mm, SEM, 5, 10**12) == (0, False)  # none came, no yield was slow
    assert _native.yield_wait_timed(ring.mm, SEM, 5, -1) == (0, True)  # every yield is "slow": stops at the first
    _native.sem_post(ring.mm, SEM)
    assert _native.yield_wait_timed(ring.mm, SEM, 5, -1) == (1, True)  # the token is taken all the same
    assert not _native.sem_wait(ring.mm, SEM, 0)
