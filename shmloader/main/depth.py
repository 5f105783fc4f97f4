"""How many batches are in flight (main process): torch's ``prefetch_factor``, or a depth that
adapts when the user gave none.

With ``prefetch_factor`` given, it keeps torch's meaning exactly: that many tasks per worker, a
ring of ``num_workers * prefetch_factor + 1`` slots. Without it, the depth starts at torch's
default (2) and, for small batches, grows while the hand-offs between processes set the rate
rather than the work: over a window of batches the loop was blocked waiting for a batch while
the workers were mostly idle. That happens beside CPU-bound neighbours, where each wake-up
waits for a scheduler slice: the rate becomes (batches in flight) / (wake-up latency), and a
deeper queue lets each wake-up carry more batches. A loop that computes (it never waits) or
workers that are busy (the data is the limit) never deepen it.

On an idle machine a loop that takes tiny batches shows the first two signs too: it waits on
workers that spend their time handing off. But there a wait is a wake-up's, 10-35 µs, and a
deeper queue raises the rate little while it makes the rare ``next()`` that finds the ring empty
wait for a worker's whole queue (p99 ~100 µs against ~30). Beside CPU-bound neighbours a wait
is a scheduler's, often a time slice: so the depth grows only while the mean blocked wait is
``WAIT_NS`` at least. Windows last ``WINDOW`` batches and ``SPAN_NS`` at least, so that their
means are not one scheduler tick's.

The ring starts as torch's (``num_workers * 2 + 1`` slots), so an idle loader holds torch's
ring and nothing more. The first time the depth grows, the ring is made again for the deepest
the depth may reach (``ring_prefetch``): the growth path of larger batches (``Lifecycle.grow``:
no task out, a new ring, every worker attaches), with more slots instead of larger ones, once.
Growing further is one number in the scheduler (``Scheduler.set_cap``). Small batches only:
that ring holds at most ``RING_BYTES`` of slots, and it stays within ``memory_budget`` (an
eighth of it; ``budget.plan_ring`` may give fewer slots); batches too large for a deeper ring
in that room keep torch's default, and so never more memory than torch's loader. Batches, their
order and checkpoints do not depend on the depth: it only says how far ahead the sampler is
drawn.
"""

from __future__ import annotations

import time
from typing import Any

from shmloader._stats import Counters
from shmloader.wire.layout import Counter

DEFAULT = 2  # torch's prefetch_factor when num_workers > 0 and none is given
# The deepest an adaptive depth grows to (batches in flight per worker). Beside two CPU-bound
# neighbours on 2 CPUs a loop of tiny batches that runs for seconds kept 61-66k batches/s at 64,
# 55k at 32 and 17-46k at 16 (its rate alone: 130-136k); at 128, 45-53k (bench/RESULTS.md,
# 2026-12-05, late night). Batches of 256 KiB stop at 15, where RING_BYTES ends.
MOST = 64
# The most slot data a ring made deeper than torch's default may hold (only once the depth grew:
# an idle loader keeps torch's ring). Beside two neighbours, batches of 256 KiB kept 27-28% of
# their rate alone at 4 MiB (a depth of 7) and 34-41% at 8 MiB (15) (bench/RESULTS.md,
# 2026-12-05, night)...
RING_BYTES = 8 << 20
BUDGET_SHARE = 8  # ...and, under memory_budget, this fraction of it at most (the rest stays the batches')
START = 32  # batches before the first window begins (a start-up's are not the steady state)
WINDOW = 128  # batches a window lasts
BLOCKED = 0.25  # the loop was blocked at least this share of the window...
IDLE = 0.5  # ...while the workers were busy less than this share of it, on average
WAIT_NS = 50_000  # ...and its blocked waits took this long on average (a scheduler's, not a wake-up's)
SPAN_NS = 20_000_000  # the shortest a window is (a mean over less is one scheduler tick's)


class Depth:
    """One loader's depth: batches in flight per worker, kept across its epochs (a later epoch's
    ring starts where the last one ended), and why it is what it is (``stats().depth_why``)."""

    def __init__(self, prefetch_factor: int, given: bool, budget: int | None = None) -> None:
        self.given = given
        self.budget = budget
        # The room a deeper ring may take: under a budget, a share of it, so that overflow and
        # held batches keep what torch's depth left them
        self.ring_bytes = RING_BYTES if budget is None else min(RING_BYTES, budget // BUDGET_SHARE)
        self.prefetch = prefetch_factor  # tasks per worker now (the scheduler's cap / num_workers)
        self.holds = prefetch_factor  # the depth the current ring has slots for
        self.most = prefetch_factor  # the deepest it may grow to with the current ring's batches
        self.refused = False  # memory_budget had no room for a deeper ring: this loader asks no more
        self.why = (f"{prefetch_factor}, torch's default, until the loop waits on idle workers for "
                    f"{WAIT_NS // 1000} µs a wait or more (a scheduler's wait, beside CPU-bound neighbours)")
        self.begin(prefetch_factor)

    def __reduce__(self) -> tuple[Any, ...]:
        """A loader pickled or copied starts from torch's default again (the depth measured
        belongs to this process's conditions)."""
        return (Depth, (self.prefetch if self.given else DEFAULT, self.given, self.budget))

    def begin(self, prefetch_factor: int) -> None:
        """An iterator begins. With ``prefetch_factor`` given, the loader's attribute is the depth
        (set again since, it counts from the next epoch, as in torch's loader)."""
        if self.given:
            self.prefetch = self.holds = self.most = prefetch_factor
            self.why = f"prefetch_factor={prefetch_factor} given: torch's meaning"

    @property
    def now(self) -> int:
        """The depth in effect (``stats().depth``): the one decided, or what the ring holds while
        the deeper ring it outgrew is not made yet."""
        return min(self.prefetch, self.holds)

    @property
    def outgrew(self) -> bool:
        """The depth grew past what its ring has slots for: a deeper ring is wanted."""
        return self.prefetch > self.holds

    def deepest(self, num_workers: int, slot_bytes: int) -> int:
        """The deepest the depth may grow to with slots of ``slot_bytes``: within ``RING_BYTES``
        (or an eighth of memory_budget when less), ``MOST`` at most, torch's default at least."""
        room = (self.ring_bytes // slot_bytes - 1) // num_workers
        return max(DEFAULT, min(MOST, room))

    def ring_prefetch(self, num_workers: int, slot_bytes: int) -> int:
        """The prefetch factor a ring of ``slot_bytes`` slots is planned for: the one given;
        torch's default until the depth grew; once it grew, the deepest it may grow to
        (``deepest``: a depth grown for small batches does not make a ring of larger ones
        deeper)."""
        if self.given:
            return self.prefetch
        return self.deepest(num_workers, slot_bytes) if self.prefetch > DEFAULT else DEFAULT

    def planned(self, num_workers: int, num_slots: int, slot_bytes: int) -> int:
        """A ring of ``num_slots`` slots of ``slot_bytes`` was made (``memory_budget`` may have
        given fewer than ``ring_prefetch`` asked): the cap of tasks to start it with. A depth
        deeper than the ring holds comes down to it, never below torch's default (a ring with
        fewer slots than that holds fewer tasks). A ring the budget made smaller, or any once the
        budget refused a deeper one (``declined``), is as deep as the depth goes; otherwise it may
        grow to ``deepest``, in a ring made again for it."""
        if self.given:
            return num_workers * self.prefetch
        slots_for = (num_slots - 1) // num_workers
        self.holds = max(DEFAULT, slots_for)
        short = self.refused or slots_for < self.ring_prefetch(num_workers, slot_bytes)
        self.most = most = self.holds if short else max(self.holds, self.deepest(num_workers, slot_bytes))
        if most <= DEFAULT and self.prefetch <= DEFAULT:
            self.why = (f"{self.prefetch}, torch's default: batches this large leave no room to deepen "
                        f"(a deeper ring holds at most {RING_BYTES >> 20} MiB, or an eighth of memory_budget)")
        elif self.prefetch > self.holds:  # (a ring of larger slots, after batches grew, or a budget's)
            self.prefetch = self.holds
            self.why = f"{self.holds}: the deepest this ring allows (its batches' size, memory_budget)"
        return num_workers * self.prefetch

    def declined(self) -> None:
        """memory_budget had no room for the deeper ring: the depth stays what the ring holds, and
        later epochs' rings do not ask again (each ask drains the ring)."""
        self.refused = True
        self.prefetch = self.most = self.holds
        self.why = (f"{self.holds}: memory_budget has no room for a deeper ring beside the memory "
                    "the loader holds now")

    def deepen(self, blocked: float, working: float, wait_ns: float) -> int | None:
        """A window ended in which the loop was blocked ``blocked`` of its time, for ``wait_ns``
        a wait on average, and the workers busy ``working`` of theirs: the new depth when it
        grows, else None. Past what the ring holds (``outgrew``), the ring is made again."""
        if (self.given or self.prefetch >= self.most or blocked < BLOCKED or working >= IDLE
                or wait_ns < WAIT_NS):
            return None
        self.prefetch = min(self.most, self.prefetch * 2)
        self.why = (f"{self.prefetch}, grown from torch's default: over a window ({WINDOW} batches and "
                    f"{SPAN_NS // 1_000_000} ms at least) the loop waited "
                    f"{blocked:.0%} of its time, {wait_ns / 1e3:.0f} µs a wait, while the workers were "
                    f"{working:.0%} busy (the hand-offs, not the work, set the rate); it grows up to "
                    f"{self.most}")
        return self.prefetch


class Watch:
    """One iterator's look at its depth: every window (``WINDOW`` batches and ``SPAN_NS`` at
    least), the share of it the loop spent blocked, its mean blocked wait, and the workers' mean
    busy share (their counters in the ring)."""

    def __init__(self, depth: Depth, counters: Counters) -> None:
        self.depth = depth
        self.counters = counters
        self.at = 1 << 62 if depth.given else counters.batches + START  # the batch count of the next look
        self._ring: Any = None
        # At the window's start: (blocked_s, each worker's busy ns, monotonic ns, waits)
        self._since: tuple[float, tuple[int, ...], int, int] = (0.0, (), 0, 0)

    def look(self, ring: Any) -> int | None:
        """The window may have ended (``counters.batches >= at``): the new cap of tasks when the
        depth grows, else None. A window lasts ``SPAN_NS`` at least; one begun on another ring
        (grown, or the first), or across a replaced worker, starts over."""
        depth, counters = self.depth, self.counters
        now = time.monotonic_ns()
        self.at = counters.batches + WINDOW
        if depth.given or depth.prefetch >= depth.most:
            self.at = 1 << 62  # (nothing left to decide)
            return None
        busy = tuple(int(c[Counter.BUSY_NS]) for c in ring.counters)
        began = self._since
        # (a window begun on another ring, or across a replaced worker, whose counters start anew)
        if self._ring is ring and began[2] < now and all(a <= b for a, b in zip(began[1], busy)):
            span = now - began[2]
            if span < SPAN_NS:
                return None  # (the window goes on)
            blocked_ns = (counters.blocked_s - began[0]) * 1e9
            waits = counters.waits - began[3]  # (none counted: no wait is long, nothing to grow for)
            prefetch = depth.deepen(blocked_ns / span, (sum(busy) - sum(began[1])) / (span * len(busy)),
                                    blocked_ns / waits if waits > 0 else 0.0)
        else:
            prefetch = None
        self._ring = ring
        self._since = (counters.blocked_s, busy, now, counters.waits)
        return None if prefetch is None else len(busy) * prefetch
