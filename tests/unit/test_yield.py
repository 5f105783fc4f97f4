"""A sync next() whose batch is not ready yields its CPU a bounded, adaptive number of times
before it sleeps (README, "async for" section)."""

from __future__ import annotations

from typing import Any

from shmloader._consume import MAX_YIELDS, MIN_YIELDS, RingIterator


class Ready:
    """A ready semaphore that gets a token after ``after`` looks (never, if None)."""

    def __init__(self, after: int | None) -> None:
        self.after, self.looks = after, 0

    def take_ready(self, timeout: float) -> bool:
        assert timeout == 0  # the yield loop never waits on the semaphore itself
        self.looks += 1
        return self.after is not None and self.looks >= self.after


class Consumer:
    def __init__(self, ring: Ready) -> None:
        self._ring: Any = ring
        self._yields = MAX_YIELDS
        self._banked = 0


def look(consumer: Consumer) -> bool:
    return RingIterator._yield_for_ready(consumer)  # type: ignore[arg-type]


def test_misses_halve_the_bound_down_to_its_floor_and_a_hit_restores_it() -> None:
    c = Consumer(Ready(None))
    bounds = []
    for _ in range(6):
        c._ring.looks = 0
        assert not look(c) and c._banked == 0
        bounds.append(c._ring.looks)
    assert bounds == [64, 32, 16, 8, 4, 4] and (MAX_YIELDS, MIN_YIELDS) == (64, 4)
    c._ring = Ready(3)
    assert look(c) and c._banked == 1 and c._ring.looks == 3  # the token is banked for _collect
    assert c._yields == MAX_YIELDS


def test_a_token_after_the_bound_is_left_to_the_sleeping_wait() -> None:
    c = Consumer(Ready(MAX_YIELDS + 1))
    assert not look(c) and c._ring.looks == MAX_YIELDS and c._banked == 0
