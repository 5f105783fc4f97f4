"""The depth that adapts (``main.depth``): without ``prefetch_factor``, the batches in flight grow
for small batches while the loop waits on idle workers. Whatever the depth does mid-epoch, the
loader yields torch's batches in torch's order, checkpoints resume exactly, and memory_budget
holds after every batch; a ``prefetch_factor`` given keeps torch's meaning.

The depth's decision is timing (blocked and busy shares over a window), so these tests make it
grow at every look: ``grows`` sets the windows to 3 batches and the thresholds so that every
window qualifies. What is tested is everything around the decision; the decision itself is
tested with a fake clock in ``tests/unit/test_depth.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import shmloader
from shmloader.main import depth as _depth
from tests.conftest import same
from tests.datasets import Range, Shards, StatefulShards


@pytest.fixture
def grows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_depth, "START", 3)
    monkeypatch.setattr(_depth, "WINDOW", 3)
    monkeypatch.setattr(_depth, "BLOCKED", 0.0)
    monkeypatch.setattr(_depth, "IDLE", float("inf"))
    monkeypatch.setattr(_depth, "WAIT_NS", 0)
    monkeypatch.setattr(_depth, "SPAN_NS", 0)


def dataset(kind: str) -> Any:
    return {"map": Range(600), "iterable": Shards(600), "iterable-stateful": StatefulShards(600)}[kind]


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("kind", ["map", "iterable"])
@pytest.mark.parametrize("persistent", [False, True])
def test_a_depth_grown_mid_epoch_yields_torchs_batches(grows: None, in_order: bool, kind: str,
                                                       persistent: bool) -> None:
    shuffle = kind == "map"
    reference = tud.DataLoader(dataset(kind), batch_size=4, shuffle=shuffle, num_workers=2,
                               generator=torch.Generator().manual_seed(5), persistent_workers=persistent)
    loader = shmloader.DataLoader(dataset(kind), batch_size=4, num_workers=2, in_order=in_order, shuffle=shuffle,
                                  generator=torch.Generator().manual_seed(5), persistent_workers=persistent)
    depths = []
    for epoch in range(2):
        want = list(reference)
        got = []
        for batch in loader:
            got.append(batch)
            depths.append(loader.stats().depth)
            occupancy = loader.stats().ring
            assert occupancy is not None and occupancy.in_flight + occupancy.ready <= 2 * depths[-1]
        if in_order:
            same(got, want)
        else:  # each batch exactly once
            assert sorted(b.tolist() for b in got) == sorted(b.tolist() for b in want)
    stats = loader.stats()
    assert depths[0] == 2 and depths[-1] == _depth.MOST and depths == sorted(depths), depths  # (from torch's default, up)
    assert stats.depth_why.startswith(f"{_depth.MOST}, grown from torch's default"), stats.depth_why
    assert stats.ring_growths == 1  # (torch's ring made again for the deepest, once; then more tasks in it)


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("kind", ["map", "iterable-stateful"])
@pytest.mark.parametrize("at", [16, 40])
def test_a_checkpoint_taken_while_the_depth_grows_resumes_exactly(grows: None, in_order: bool, kind: str,
                                                                  at: int) -> None:
    shuffle = kind == "map"

    def make() -> shmloader.DataLoader[Any]:
        return shmloader.DataLoader(dataset(kind), batch_size=4, num_workers=2, in_order=in_order, shuffle=shuffle,
                                    generator=torch.Generator().manual_seed(9))

    # The reference: torch's own loader, uninterrupted, on the same job
    whole = [b.tolist() for b in tud.DataLoader(dataset(kind), batch_size=4, num_workers=2, shuffle=shuffle,
                                                generator=torch.Generator().manual_seed(9))]
    loader = make()
    it = iter(loader)
    before = [next(it).tolist() for _ in range(at)]
    state = loader.state_dict()
    grown = loader.stats().depth
    del it
    resumed = make()
    resumed.load_state_dict(state)
    after = [b.tolist() for b in resumed]
    if in_order:
        assert before + after == whole
    else:
        assert sorted(before + after) == sorted(whole) and len(before + after) == len(whole)
    assert grown > 2  # (the state was taken with more batches in flight than torch's default)


@pytest.mark.parametrize("in_order", [True, False])
def test_memory_budget_holds_after_every_batch_while_the_depth_grows(grows: None, in_order: bool) -> None:
    # Batches of 16 KiB (slots of 20 KiB): under a budget a deeper ring takes an eighth of it at
    # most (150 KB: 7 slots, a depth of 3), and the depth stops where they end. The ring starts as
    # torch's (5 slots) and is made again once, when the depth first grows.
    budget = 1_200_000
    loader = shmloader.DataLoader(_Wide(400), batch_size=4, num_workers=2, in_order=in_order, memory_budget=budget)
    got = []
    for batch in loader:
        got.append(batch[:, 0].clone())  # (the loop keeps a value, not the slot)
        assert loader._shm_memory.in_use <= budget
        stats = loader.stats()
        assert stats.ring is not None and stats.depth <= (stats.ring.slots - 1) // 2
        assert stats.ring.slots in (5, 7)  # (torch's ring, then the deepest the budget allows)
    del batch
    want = [b[:, 0] for b in tud.DataLoader(_Wide(400), batch_size=4)]
    if in_order:
        same(got, want)
    else:
        assert sorted(b.tolist() for b in got) == sorted(b.tolist() for b in want)
    assert loader.stats().depth == 3 and loader.stats().ring_growths == 1


class _Wide(tud.Dataset):  # type: ignore[type-arg]
    """Sample i: 1,024 int32 equal to i (4 KiB; a batch of 4 fills a 16 KiB slot)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((1024,), i, dtype=torch.int32)


def test_a_prefetch_factor_given_keeps_torchs_meaning(grows: None) -> None:
    loader = shmloader.DataLoader(Range(600), batch_size=4, num_workers=2, prefetch_factor=2)
    for batch in loader:
        occupancy = loader.stats().ring
        assert occupancy is not None and occupancy.slots == 5 and occupancy.in_flight + occupancy.ready <= 4
    assert loader.stats().depth == 2 and loader.stats().depth_why == "prefetch_factor=2 given: torch's meaning"
    del batch


class _Growing(tud.Dataset):  # type: ignore[type-arg]
    """Samples of 4 KiB, then (from ``at`` on) of 1 MiB: int32 equal to i."""

    def __init__(self, n: int, at: int) -> None:
        self.n, self.at = n, at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((1024 if i < self.at else 1 << 18,), i, dtype=torch.int32)


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("persistent", [False, True])
def test_a_depth_grown_for_small_batches_gives_larger_ones_torchs_ring(grows: None, persistent: bool,
                                                                      in_order: bool) -> None:
    # The depth reaches its deepest on 4 KiB batches; then 4 MiB batches come. The tasks then out
    # (2 * MOST of them) each ask for memory of their own, but no more than torch's batches in
    # flight (2 * 2) hold it undelivered at once; the ring grows for them once they are in, and
    # it is torch's ring again (5 slots: never 2 * MOST + 1 of 4 MiB), this epoch and the next.
    # (The first ring is torch's too: it is made again for the deepest when the depth first grows.)
    big, small = 4 << 20, 100  # (bytes a large batch, and how many small batches an epoch begins with)
    n = small + 2 * _depth.MOST + 50
    loader: Any = shmloader.DataLoader(_Growing(4 * n, at=4 * small), batch_size=4, num_workers=2,
                                       persistent_workers=persistent, in_order=in_order)
    for epoch in range(2):
        depths, slots, firsts = [], [], []
        for k, batch in enumerate(loader):
            first = int(batch[0, 0])
            firsts.append(first)
            assert batch.shape[1] == (1024 if first < 4 * small else 1 << 18) and (first == 4 * k or not in_order)
            stats = loader.stats()
            assert stats.ring is not None
            depths.append(stats.depth)
            slots.append(stats.ring.slots)
            assert stats.ring.slots <= 5 or stats.ring.slots * stats.ring.slot_bytes <= _depth.RING_BYTES  # (never both)
            ring = stats.ring.slots * (stats.ring.slot_bytes + 4096)  # (a header page a slot, at most)
            # torch's 4 in flight, the batch the loop waits for, and the one it holds
            assert loader._shm_memory.in_use - ring <= 6 * (big + 4096), (k, loader._shm_memory.in_use, ring)
        assert sorted(firsts) == list(range(0, 4 * n, 4))  # (each batch once)
        if epoch == 0:
            assert max(depths) == _depth.MOST and slots[0] == 5 and max(slots) == 2 * _depth.MOST + 1
        assert depths[-1] == 2 and slots[-1] == 5, (depths[-5:], slots[-5:])
    del batch


def test_large_batches_never_deepen_past_torchs_memory(grows: None) -> None:
    # 2 MiB batches: a ring deeper than torch's default would pass the 8 MiB a deeper ring may hold.
    assert (2 * 3 + 1) * (2 << 20) > _depth.RING_BYTES  # (a depth of 3: 7 slots)
    loader = shmloader.DataLoader(_Wide(4000), batch_size=512, num_workers=2, persistent_workers=True)
    it = iter(loader)
    for _ in range(6):
        next(it)
    stats = loader.stats()
    assert stats.depth == 2 and stats.ring is not None and stats.ring.slots == 5, stats
    assert "leave no room to deepen" in stats.depth_why
    del it


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_loops_waits_are_counted_for_the_depth(mode: str) -> None:
    # (the depth grows only for long waits: a wait not counted would read as one long one)
    loader: Any = shmloader.DataLoader(Range(64), batch_size=4, num_workers=2)
    if mode == "sync":
        got = [b.tolist() for b in loader]
    else:
        async def consume() -> list[Any]:
            return [b.tolist() async for b in loader]

        got = asyncio.run(consume())
    assert got == [b.tolist() for b in tud.DataLoader(Range(64), batch_size=4)]
    counters = loader._shm_counters
    assert counters.waits >= 1 and counters.blocked_s > 0  # (the first batch, at least, was waited for)
