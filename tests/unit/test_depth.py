"""The depth's decision (``main.depth``), with a fake clock and fake worker counters: it grows
only while the loop waits, each wait a scheduler's, on idle workers, doubles up to what the ring allows, never moves
when ``prefetch_factor`` was given, and plans rings deeper than torch's for small batches only."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from shmloader._stats import Counters
from shmloader.main import depth as _depth
from shmloader.main.depth import DEFAULT, MOST, RING_BYTES, SPAN_NS, WAIT_NS, WINDOW, Depth, Watch
from shmloader.wire.layout import N_COUNTERS, Counter

MS = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.ns = 10**12

    def monotonic_ns(self) -> int:
        return self.ns


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(_depth, "time", fake)
    return fake


def ring(workers: int = 2) -> Any:
    return SimpleNamespace(counters=[[0] * N_COUNTERS for _ in range(workers)])


def window(watch: Watch, r: Any, clock: Clock, blocked: float, busy: float, wait_us: float = 1000) -> int | None:
    """One window of 100 ms: the loop blocked ``blocked`` of it, in waits of ``wait_us`` (a
    scheduler's time slice by default), each worker busy ``busy`` of it."""
    clock.ns += 100 * MS
    watch.counters.blocked_s += 0.1 * blocked
    watch.counters.waits += round(0.1 * blocked * 1e6 / wait_us)
    watch.counters.batches += WINDOW
    for c in r.counters:
        c[Counter.BUSY_NS] += int(100 * MS * busy)
    return watch.look(r)


def started(depth: Depth, clock: Clock, r: Any) -> Watch:
    """A watch on ``r`` whose first window has begun (the first look only starts it)."""
    depth.planned(len(r.counters), 2 * MOST + 1, 4096)
    watch = Watch(depth, Counters())
    assert window(watch, r, clock, blocked=1.0, busy=0.0) is None
    return watch


def test_it_grows_while_the_loop_waits_on_idle_workers_and_doubles_up_to_the_ring(clock: Clock) -> None:
    depth, r = Depth(DEFAULT, given=False), ring()
    watch = started(depth, clock, r)
    doublings = MOST.bit_length() - DEFAULT.bit_length()  # (2, 4, ... MOST)
    caps = [window(watch, r, clock, blocked=0.8, busy=0.1) for _ in range(doublings + 2)]
    assert caps == [2 * (DEFAULT << k) for k in range(1, doublings + 1)] + [None, None]
    assert depth.prefetch == MOST
    assert depth.why.startswith(f"{MOST}, grown from torch's default: over a window (128 batches and 20 ms at least) the "
                                "loop waited 80% of its time, 1000 µs a wait, while the workers were 10% busy"), depth.why
    assert watch.at > 10**15  # (nothing left to decide)


def test_an_idle_machines_short_waits_keep_torchs_depth(clock: Clock) -> None:
    # The loop waits on idle workers, but each wait is a wake-up's (20 µs), not a scheduler's: a
    # deeper queue would make the rare empty ring's wait a worker's whole queue
    depth, r = Depth(DEFAULT, given=False), ring()
    watch = started(depth, clock, r)
    assert [window(watch, r, clock, blocked=0.8, busy=0.1, wait_us=20) for _ in range(4)] == [None] * 4
    assert depth.prefetch == DEFAULT and "torch's default" in depth.why
    assert window(watch, r, clock, blocked=0.8, busy=0.1, wait_us=0.9 * WAIT_NS / 1e3) is None  # (just under)
    assert window(watch, r, clock, blocked=0.8, busy=0.1, wait_us=1.1 * WAIT_NS / 1e3) == 2 * 4  # (neighbours came)


def test_a_window_without_a_wait_counted_never_grows(clock: Clock) -> None:
    # (blocked time with no wait counted is no evidence of a long wait)
    depth, r = Depth(DEFAULT, given=False), ring()
    watch = started(depth, clock, r)
    clock.ns += 100 * MS
    watch.counters.blocked_s += 0.08
    watch.counters.batches += WINDOW
    assert watch.look(r) is None and depth.prefetch == DEFAULT


def test_a_window_lasts_long_enough_for_a_mean(clock: Clock) -> None:
    # 128 tiny batches take under a millisecond on an idle machine: the window goes on until SPAN_NS
    depth, r = Depth(DEFAULT, given=False), ring()
    watch = started(depth, clock, r)
    for _ in range(3):
        clock.ns += SPAN_NS // 4
        watch.counters.batches += WINDOW
        watch.counters.blocked_s += SPAN_NS / 4e9
        watch.counters.waits += 1
        assert watch.look(r) is None and watch.at == watch.counters.batches + WINDOW
    clock.ns += SPAN_NS // 4
    assert watch.look(r) == 2 * 4  # (blocked all of it, 5 ms a wait, workers idle)


@pytest.mark.parametrize(("blocked", "busy"), [(0.1, 0.1), (0.8, 0.9), (0.3, 0.5)])
def test_a_computing_loop_or_busy_workers_keep_the_depth(clock: Clock, blocked: float, busy: float) -> None:
    depth, r = Depth(DEFAULT, given=False), ring()
    watch = started(depth, clock, r)
    for _ in range(4):
        assert window(watch, r, clock, blocked=blocked, busy=busy) is None
    assert depth.prefetch == DEFAULT and "torch's default" in depth.why


def test_a_prefetch_factor_given_never_moves(clock: Clock) -> None:
    depth, r = Depth(3, given=True), ring()
    watch = started(depth, clock, r)
    assert window(watch, r, clock, blocked=1.0, busy=0.0) is None
    assert watch.at > 10**15  # (never looks again)
    assert depth.prefetch == 3 and depth.ring_prefetch(2, 4096) == 3
    assert depth.why == "prefetch_factor=3 given: torch's meaning"


def test_a_window_across_another_ring_or_a_replaced_worker_starts_over(clock: Clock) -> None:
    depth, r = Depth(DEFAULT, given=False), ring()
    watch = started(depth, clock, r)
    grown = ring()
    assert window(watch, grown, clock, blocked=1.0, busy=0.1) is None  # a grown ring: its counters start at 0
    assert window(watch, grown, clock, blocked=1.0, busy=0.1) == 2 * 4
    grown.counters[0][Counter.BUSY_NS] = 0  # a replaced worker's counters start anew
    assert window(watch, grown, clock, blocked=1.0, busy=0.1) is None
    assert window(watch, grown, clock, blocked=1.0, busy=0.1) == 2 * 8


def test_rings_deeper_than_torchs_are_for_small_batches_only() -> None:
    depth = Depth(DEFAULT, given=False)
    assert depth.deepest(2, 4096) == MOST  # 2 * MOST + 1 slots of 4 KiB (room for 2,047)
    assert depth.deepest(2, 256 * 1024) == 15  # 31 slots of 256 KiB: within RING_BYTES
    assert (2 * 15 + 1) * 256 * 1024 <= RING_BYTES < (2 * 16 + 1) * 256 * 1024
    assert depth.deepest(2, 1 << 20) == 3  # 7 slots of 1 MiB
    assert depth.deepest(2, 2 << 20) == DEFAULT  # torch's ring, never more
    assert depth.deepest(8, 1 << 20) == DEFAULT
    # A ring is torch's until the depth grew; then it is made for the deepest, for its batches'
    # size (a depth grown for small batches gives larger ones torch's ring all the same)
    assert depth.ring_prefetch(2, 4096) == depth.ring_prefetch(2, 256 * 1024) == DEFAULT
    depth.prefetch = 2 * DEFAULT
    assert depth.ring_prefetch(2, 4096) == MOST and depth.ring_prefetch(2, 256 * 1024) == 15
    assert depth.ring_prefetch(2, 2 << 20) == DEFAULT


def test_under_a_budget_a_deeper_ring_takes_an_eighth_of_it_at_most() -> None:
    assert Depth(DEFAULT, given=False, budget=128 << 20).deepest(2, 4096) == MOST  # (8 MiB: all of it)
    assert Depth(DEFAULT, given=False, budget=8 << 20).deepest(2, 256 * 1024) == DEFAULT  # 1 MiB: torch's
    assert Depth(DEFAULT, given=False, budget=16 << 20).deepest(2, 256 * 1024) == 3  # 2 MiB: 7 slots


def test_the_first_growth_outgrows_torchs_ring_and_the_deeper_ring_holds_the_rest(clock: Clock) -> None:
    depth, r = Depth(DEFAULT, given=False), ring()
    assert depth.planned(2, 5, 4096) == 2 * DEFAULT  # torch's ring: an idle loader holds nothing more
    assert (depth.holds, depth.most) == (DEFAULT, MOST) and not depth.outgrew
    watch = Watch(depth, Counters())
    assert window(watch, r, clock, blocked=1.0, busy=0.0) is None  # (the first look starts a window)
    assert window(watch, r, clock, blocked=1.0, busy=0.1) == 2 * 4
    assert depth.outgrew and depth.ring_prefetch(2, 4096) == MOST  # a ring made again, for the deepest
    assert depth.planned(2, 2 * MOST + 1, 4096) == 2 * 4  # (made: the depth as grown)
    assert not depth.outgrew and depth.holds == depth.most == MOST
    assert window(watch, ring(), clock, blocked=1.0, busy=0.1) is None  # (another ring: a window anew)
    assert window(watch, r, clock, blocked=1.0, busy=0.1) is None
    assert window(watch, r, clock, blocked=1.0, busy=0.1) == 2 * 8 and not depth.outgrew  # one number now


def test_a_deeper_ring_memory_budget_declined_keeps_the_depth_the_ring_holds() -> None:
    depth = Depth(DEFAULT, given=False, budget=64 << 20)
    depth.planned(2, 5, 4096)
    depth.prefetch = 4
    assert depth.outgrew
    depth.declined()
    assert (depth.prefetch, depth.most, depth.outgrew) == (DEFAULT, DEFAULT, False)
    assert depth.why == ("2: memory_budget has no room for a deeper ring beside the memory the loader holds "
                         "now")
    assert depth.planned(2, 5, 4096) == 2 * DEFAULT and depth.most == DEFAULT  # (a later epoch's ring asks no more)


def test_a_ring_with_fewer_slots_lowers_the_depth_and_says_why() -> None:
    depth = Depth(DEFAULT, given=False)
    depth.prefetch = 8
    assert depth.planned(2, 9, 1 << 20) == 2 * 4  # (a ring grown for larger batches, or memory_budget's)
    assert depth.prefetch == depth.most == 4
    assert depth.why == "4: the deepest this ring allows (its batches' size, memory_budget)"
    assert depth.planned(2, 3, 4096) == 2 * DEFAULT  # a budget's ring of 3: never below torch's depth
    assert depth.prefetch == depth.most == DEFAULT
    fresh = Depth(DEFAULT, given=False)
    assert fresh.planned(2, 5, 2 << 20) == 4
    assert "leave no room to deepen" in fresh.why
    assert Depth(3, given=True).planned(2, 4, 4096) == 2 * 3  # (torch's cap: the ring's slots hold fewer)


def test_a_pickled_depth_starts_from_torchs_default_or_the_one_given() -> None:
    # (a loader pickled for spawn or deepcopy: the depth measured belongs to this process's conditions)
    import pickle

    grown = Depth(DEFAULT, given=False)
    grown.prefetch = 8
    again = pickle.loads(pickle.dumps(grown))
    assert (again.prefetch, again.given) == (DEFAULT, False)
    given = pickle.loads(pickle.dumps(Depth(5, given=True)))
    assert (given.prefetch, given.given, given.why) == (5, True, "prefetch_factor=5 given: torch's meaning")
