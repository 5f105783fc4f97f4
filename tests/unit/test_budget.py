"""memory_budget: size strings, and ring plans that stay inside the budget."""

from __future__ import annotations

import mmap

import pytest

import shmloader
from shmloader.main.budget import parse_size, plan_ring
from shmloader.wire.layout import RingGeometry, slot_data_bytes


@pytest.mark.parametrize(
    "text, n",
    [("4096", 4096), (4096, 4096), ("512MiB", 512 << 20), ("2GiB", 2 << 30), ("1.5GB", 1_500_000_000),
     ("10 kb", 10_000), ("3MB", 3_000_000), ("1TiB", 1 << 40)],
)
def test_parse_size(text: int | str, n: int) -> None:
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["", "12 parsecs", "MiB", "-5MiB", 0, -1])
def test_parse_size_rejects(bad: int | str) -> None:
    with pytest.raises(ValueError, match="memory_budget"):
        parse_size(bad)


def test_parse_size_rejects_types() -> None:
    with pytest.raises(TypeError, match="memory_budget should be an int of bytes"):
        parse_size(1.5)  # type: ignore[arg-type]


def test_no_budget_is_workers_times_prefetch_and_one_in_hand() -> None:
    g = plan_ring(2, 3, 1_000_000, None, None)
    assert (g.num_slots, g.data_bytes) == (7, slot_data_bytes(1_000_000))
    g = plan_ring(2, 3, None, 5000, None)
    assert (g.num_slots, g.data_bytes) == (7, 2 * mmap.PAGESIZE)


@pytest.mark.parametrize("budget_mib", [3, 5, 8, 10, 40])
def test_budget_lowers_slots_then_headroom_and_always_fits(budget_mib: int) -> None:
    budget = budget_mib << 20
    g = plan_ring(2, 4, 1 << 20, None, budget)
    assert g.total_bytes <= budget
    assert 2 <= g.num_slots <= 9
    assert g.data_bytes >= 1 << 20
    if budget >= plan_ring(2, 4, 1 << 20, None, None).total_bytes + (1 << 20):
        assert g.num_slots == 9  # with room beside the ring for one batch to overflow
    elif budget >= plan_ring(2, 1, 1 << 20, None, None).total_bytes + (1 << 20):
        assert g.total_bytes + (1 << 20) <= budget


def test_budget_too_small_for_one_slot_per_worker() -> None:
    with pytest.raises(shmloader.MemoryBudgetError, match=r"memory_budget=2,097,152 bytes cannot hold one slot per worker: 2 worker\(s\).*batches measure 1,048,576 bytes.*Raise memory_budget"):
        plan_ring(2, 2, 1 << 20, None, 2 << 20)
    with pytest.raises(shmloader.MemoryBudgetError, match=r"\(slot_bytes\)"):
        plan_ring(2, 2, None, 1 << 20, 2 << 20)


def test_memory_held_from_before_may_take_the_ring_below_one_slot_per_worker() -> None:
    # The loop's batch held as the next epoch begins: 4 workers, a budget of 4 slots, one of
    # them still held. The next ring takes the 3 slots left (workers take turns), not an error.
    size = slot_data_bytes(15 << 20)
    four = RingGeometry(4, 4, size)
    held = four.slot_stride
    g = plan_ring(4, 2, 15 << 20, None, four.total_bytes, in_use=held)
    assert g.num_slots == 3 and g.total_bytes + held <= four.total_bytes
    with pytest.raises(shmloader.MemoryBudgetError, match="beside the .* bytes this loader already holds"):
        plan_ring(4, 2, 15 << 20, None, four.total_bytes, in_use=4 * held)
    # With nothing held, one slot per worker stays the floor.
    with pytest.raises(shmloader.MemoryBudgetError, match="cannot hold one slot per worker"):
        plan_ring(4, 2, 15 << 20, None, four.total_bytes - 1)
