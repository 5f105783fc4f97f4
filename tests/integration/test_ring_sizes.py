"""Rings of any slot count: W x P + 1 slots with no limit of the implementation's own (the
per-batch path once had a fixed 256-entry table). Every word of every batch is checked, with
batches held so that every slot is lent at once, and released."""

from __future__ import annotations

import pytest

import shmloader
from tests.datasets import Blocks, check_blocks


@pytest.mark.parametrize(("workers", "prefetch"), [(1, 256), (2, 512)], ids=["257 slots", "1025 slots"])
def test_a_ring_of_many_slots_delivers_every_batch(workers: int, prefetch: int) -> None:
    slots = workers * prefetch + 1
    batches = 2 * slots + 3  # more than the ring holds: slots are reused
    loader = shmloader.DataLoader(Blocks(batches * 2, words=64), batch_size=2, num_workers=workers,
                                  prefetch_factor=prefetch)
    it = iter(loader)
    held = []
    for n, batch in enumerate(it):
        check_blocks(batch, 2 * n)
        held.append(batch)
        if len(held) == slots:  # every slot in the user's hands or in flight: hand them back
            for kept in held:
                loader.release(kept)
            held.clear()
        if n == 0:
            assert it.occupancy() is not None and it.occupancy().slots == slots  # type: ignore[union-attr]
    assert n == batches - 1
    assert loader.stats().batches == batches
