"""Memory is the loader's: a ring outlived by a held batch keeps that batch's slot only, batches
that arrive while every slot is held come in memory of their own (zero-copy views), and
``memory_budget`` bounds every byte of shared memory the loader has mapped at any moment (all
its rings, held or live, and overflow memory). Peaks are measured in bench/, never asserted
here: these tests check where the bytes are (``/proc/self/maps``, the pages themselves)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import shmloader
from tests.conftest import same
from tests.datasets import Blocks, check_blocks
from tests.integration.test_overflow import mapped_by_us


def resident_bytes(mm_start: int, mm_end: int) -> int:
    """Resident bytes of the mapping [start, end) of this process (``/proc/self/smaps``)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and all(c in "0123456789abcdef-" for c in head[0]):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo < mm_end and mm_start < hi
            elif inside and head[0] == "Rss:":
                rss += int(head[1]) * 1024
    return rss


@pytest.mark.parametrize("persistent", [False, True])
def test_a_ring_outlived_by_a_held_batch_keeps_only_that_batchs_slot(persistent: bool) -> None:
    # The loop's last batch outlives the epoch's iterator (non-persistent), or the loader drops
    # its persistent iterator: the ring's other slots go back to the system at once.
    loader = shmloader.DataLoader(Blocks(40, words=64 * 1024), batch_size=4, num_workers=2,
                                  persistent_workers=persistent)
    it = iter(loader)
    batches = [b for b in it]  # the last slots still hold their batches: these views
    ring = it.ring
    assert ring is not None
    kept = batches[-1]
    del batches
    if persistent:
        it._shutdown_workers()
    assert it.shut_down
    gc.collect()
    start = ring.bytes.__array_interface__["data"][0]
    g = ring.geometry
    resident = resident_bytes(start, start + g.total_bytes)
    assert resident <= g.control_bytes + g.slot_stride, (resident, g)  # one slot: the held batch's
    check_blocks(kept, 36)  # ...which is intact
    slot = (kept.untyped_storage().data_ptr() - start - g.control_bytes) // g.slot_stride
    other = (slot + 1) % g.num_slots
    view = ring.bytes[g.data_offset(other) : g.data_offset(other) + 64]
    assert not view.any()  # another slot's pages were removed: the segment reads zeros there
    del kept, view, it, loader
