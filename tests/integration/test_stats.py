"""loader.stats(): counts, bytes, wait vs compute, ring occupancy, worker busy; memory_budget
end to end."""

from __future__ import annotations

import re
import time

import pytest
import torch

import shmloader
from tests.conftest import same
from tests.datasets import Range, Sized


def test_stats_count_batches_bytes_and_time() -> None:
    loader = shmloader.DataLoader(Range(40), batch_size=4, num_workers=2, prefetch_factor=2, persistent_workers=True)
    assert loader.stats().batches == 0 and loader.stats().ring is None
    began = time.perf_counter()
    for _ in range(2):
        for batch in loader:
            pass
    elapsed = time.perf_counter() - began
    s = loader.stats()
    assert s.batches == 20
    assert s.bytes == 40 * 8 * 2
    assert s.wait_s > 0 and s.compute_s > 0
    assert s.wait_s + s.compute_s <= elapsed  # each stretch of time counted once, as one or the other
    assert 0 < s.loader_bound <= 1
    assert s.copies == 0 and s.worker_restarts == 0
    assert len(s.worker_busy) == 2 and all(0 <= b <= 1 for b in s.worker_busy)
    assert sum(s.worker_busy) > 0
    assert s.ring is not None and s.ring.slots == 5  # 2 workers * prefetch 2, and one for the batch in hand
    assert s.ring.free + s.ring.in_flight + s.ring.ready + s.ring.held == 5
    assert s.depth == 2 and s.depth_why == "prefetch_factor=2 given: torch's meaning"
    del batch
    loader._iterator._shutdown_workers()


def test_stats_see_held_batches() -> None:
    loader = shmloader.DataLoader(Range(40), batch_size=4, num_workers=2, prefetch_factor=3)
    it = iter(loader)
    kept = [next(it), next(it)]
    ring = loader.stats().ring
    assert ring is not None and ring.held == 2 and ring.slots == 7
    del kept, it


def test_stats_describe_the_latest_iterator() -> None:
    # Two epochs' iterators alive at once: the ring figures are the latest one's, every time.
    loader = shmloader.DataLoader(Range(40), batch_size=4, num_workers=2, prefetch_factor=3)
    first = iter(loader)
    kept = [next(first)]
    second = iter(loader)
    kept += [next(second), next(second)]
    for _ in range(3):
        ring = loader.stats().ring
        assert ring is not None and ring.held == 2
    del second
    assert loader.stats().ring is None  # the latest iterator is gone: no live ring to describe
    assert loader.stats().batches == 3
    del kept, first


def test_memory_budget_shrinks_the_ring_and_batches_stay_right() -> None:
    sizes = [100_000] * 16  # 400 KB float32 samples; batch of 2 = 800 KB
    budget = "2.5MiB"
    loader = shmloader.DataLoader(Sized(sizes), batch_size=2, num_workers=2, prefetch_factor=4,
                                  memory_budget=budget)
    it = iter(loader)
    got = [next(it)]
    ring = it.ring
    assert ring is not None and ring.geometry.total_bytes <= int(2.5 * 2**20)
    assert 2 <= ring.geometry.num_slots < 8
    got += list(it)
    same(got, list(torch.utils.data.DataLoader(Sized(sizes), batch_size=2)))


def test_memory_budget_too_small_is_a_clear_error() -> None:
    loader = shmloader.DataLoader(Sized([100_000] * 8), batch_size=2, num_workers=2, memory_budget="1MiB")
    with pytest.raises(shmloader.MemoryBudgetError, match="cannot hold one slot per worker"):
        list(loader)


def test_memory_budget_argument_is_validated() -> None:
    with pytest.raises(ValueError, match="is not a size"):
        shmloader.DataLoader(Range(4), num_workers=1, memory_budget="lots")


@pytest.mark.parametrize(
    "wait_s, blocked_s, busy, says",
    [
        (0.05, 0.05, (1.0, 1.0), "the loader keeps up"),
        (0.5, 0.45, (0.95, 0.85), "workers 90% busy: the workers are the bottleneck; add workers"),
        (0.5, 0.45, (0.2, 0.3), "workers only 25% busy: the ring is too shallow .* raise prefetch_factor"),
        (0.5, 0.45, (), "the loop waits for data"),
        (0.5, 0.1, (0.2, 0.3), r"mostly the loader's own work in your process \(40000 µs a batch\): .* transport-bound"),
    ],
)
def test_advice_reads_loader_bound_and_worker_busy_together(wait_s: float, blocked_s: float, busy: tuple[float, ...],
                                                             says: str) -> None:
    s = shmloader.LoaderStats(batches=10, bytes=0, wait_s=wait_s, compute_s=1 - wait_s, copies=0, worker_restarts=0,
                              overflow_batches=0, ring_growths=0, worker_busy=busy, ring=None, blocked_s=blocked_s)
    assert re.search(says, s.advice), s.advice


def test_blocked_time_is_part_of_the_wait() -> None:
    import multiprocessing

    from tests.datasets import Gated

    gate = multiprocessing.get_context("fork").Event()
    gate.set()
    loader = shmloader.DataLoader(Gated(8, gate), batch_size=2, num_workers=1)
    assert len(list(loader)) == 4
    s = loader.stats()
    assert 0 < s.blocked_s <= s.wait_s  # the first batch, at least, is waited for


def test_bench_report_says_the_advice() -> None:
    from shmloader._bench import report
    from shmloader._bench.measure import Result

    r = Result("tiny", "shmloader", 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, advice="loader-bound 50%, workers only 25% busy: x")
    assert report([r, Result("tiny", "torch", 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0)]) == f"tiny: {r.advice}"
