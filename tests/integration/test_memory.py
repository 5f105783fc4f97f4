"""Memory is the loader's: a ring outlived by a held batch keeps that batch's slot only, batches
that arrive while every slot is held come in memory of their own (zero-copy views), and
``memory_budget`` bounds every byte of shared memory the loader has mapped at any moment (all
its rings, held or live, and overflow memory). Peaks are measured in bench/, never asserted
here: these tests check where the bytes are (``/proc/self/maps``, the pages themselves)."""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import shmloader
from shmloader.main import delivery as _delivery
from tests.conftest import same
from tests.datasets import Blocks, Sized, check_blocks


@pytest.fixture(autouse=True)
def held_batches_in_memory_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests follow batches held in memory of their own (OWN tasks), which batches of a
    MiB and more take; small test batches take that path here too (by default they are copied
    out of their slot: test_lifecycle.py)."""
    monkeypatch.setattr(_delivery, "COPY_HELD_UNDER", 0)


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
    for kept in it:  # a loop's variable: the last batch, a view of its slot, outlives the loop
        pass
    ring = it.ring
    assert ring is not None
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


def allocated_by_us() -> int:
    """Bytes allocated in every distinct shared file of shmloader's this process maps (its rings
    and overflow memory), read from the files themselves (``/proc/self/map_files``): memory a
    ring gave back no longer counts, whatever the mapping's extent. Copies of held batches
    (``/memfd:shmloader-copy``) are the training process's own, shared with no worker: outside
    what memory_budget bounds, as the copies torch's pin-memory thread makes are."""
    files: dict[tuple[int, int], int] = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) < 6 or "shmloader" not in parts[5] or not parts[5].startswith(("/dev/shm/", "/memfd:")):
                continue
            if parts[5].startswith("/memfd:shmloader-copy"):
                continue
            try:
                st = os.stat(f"/proc/self/map_files/{parts[0]}")
            except PermissionError:
                pytest.skip("reading /proc/self/map_files needs CAP_SYS_ADMIN")
            except FileNotFoundError:
                continue  # unmapped meanwhile
            files[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return sum(files.values())


class Budgeted:
    """Every batch of a loop checked against torch's, and the loader's shared memory against
    its budget after each one."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.peak = 0

    def look(self) -> None:
        used = allocated_by_us()
        self.peak = max(self.peak, used)
        assert used <= self.budget, (used, self.budget)


SIZES = [8] * 4 + [6000] * 8 + [300] * 36  # a growth, then batches that fit the grown slots
BUDGET = 700_000


@pytest.mark.parametrize("in_order", [True, False])
def test_the_budget_holds_with_two_live_iterators(in_order: bool) -> None:
    want = [b.clone() for b in tud.DataLoader(Blocks(48, words=2000), batch_size=4)]
    loader = shmloader.DataLoader(Blocks(48, words=2000), batch_size=4, num_workers=2, memory_budget=BUDGET,
                                  in_order=in_order)
    watch = Budgeted(BUDGET)
    first, second = iter(loader), iter(loader)
    got: list[list[Any]] = [[], []]
    for _ in range(len(want)):
        for k, it in enumerate((first, second)):
            got[k].append(next(it))
            watch.look()
    for k in range(2):
        assert sorted(map(bytes_of, got[k])) == sorted(map(bytes_of, want))
        if in_order:
            for batch, expected in zip(got[k], want):
                same(batch, expected)
    first._shutdown_workers()
    second._shutdown_workers()


def bytes_of(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


@pytest.mark.parametrize("in_order", [True, False])
def test_the_budget_holds_with_batches_kept_across_epochs(in_order: bool) -> None:
    # Non-persistent epochs, each leaving batches held: the rings they keep alive count, and the
    # next epoch's ring is planned in what they leave.
    # (The budget holds about a ring and three quarters: by the third epoch the rings the held
    # batches keep leave room for a ring of fewer slots.)
    budget = 330_000
    want = [b.clone() for b in tud.DataLoader(Blocks(48, words=2000), batch_size=4)]
    loader = shmloader.DataLoader(Blocks(48, words=2000), batch_size=4, num_workers=2, memory_budget=budget,
                                  in_order=in_order)
    watch = Budgeted(budget)
    kept: list[torch.Tensor] = []
    for epoch in range(3):
        got = []
        for batch in loader:
            got.append(batch.clone())
            watch.look()
            if len(got) in (3, 11):
                kept.append(batch)  # held past the epoch's end
        assert sorted(map(bytes_of, got)) == sorted(map(bytes_of, want))
    assert len(kept) == 6 and all(bytes_of(k) in {bytes_of(w) for w in want} for k in kept)


@pytest.mark.parametrize("in_order", [True, False])
def test_the_budget_holds_when_the_loop_holds_everything(in_order: bool) -> None:
    # A replay buffer under a budget: batches in memory of their own while there is room, then a
    # counted copy when only the batches held could make room; never a hang, never past the budget.
    sizes = [4] * 4 + [1000] * 60
    want = [b.clone() for b in tud.DataLoader(Sized(sizes), batch_size=4)]
    budget = 400_000
    loader = shmloader.DataLoader(Sized(sizes), batch_size=4, num_workers=2, memory_budget=budget,
                                  in_order=in_order)
    watch = Budgeted(budget)
    held = []
    for batch in loader:
        held.append(batch)
        watch.look()
    if in_order:
        same(held, want)
    else:
        assert sorted(map(bytes_of, held)) == sorted(map(bytes_of, want))
    stats = loader.stats()
    assert stats.copies >= 1 and stats.overflow_batches >= 1


def memfd_extent(ptr: int) -> int:
    """Bytes of the overflow memory (``/memfd:shmloader-overflow``) mapping that holds ``ptr``;
    0 when ``ptr`` lies elsewhere."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return hi - lo if len(parts) >= 6 and parts[5] == "/memfd:shmloader-overflow" else 0
    return 0


@pytest.mark.parametrize("in_order", [True, False])
def test_held_batches_of_whole_pages_cost_just_their_pages(in_order: bool) -> None:
    # A replay buffer of batches of exactly 16 pages: once the loop holds the ring, each batch
    # comes in memory of its own holding its leaves alone (its skeleton and leaf table travel in
    # its slot), so it costs what torch's shared-memory batch costs; holding never grows the ring.
    page = os.sysconf("SC_PAGE_SIZE")
    loader = shmloader.DataLoader(Blocks(240, words=page), batch_size=4, num_workers=2, prefetch_factor=2,
                                  in_order=in_order)  # (a ring of 5: the depth never adapts)
    it = iter(loader)
    kept = list(it)
    firsts = [int(b[0, 0]) for b in kept]
    assert firsts == list(range(0, 240, 4)) if in_order else sorted(firsts) == list(range(0, 240, 4))
    for batch, first in zip(kept, firsts):
        check_blocks(batch, first)
    stats = loader.stats()
    assert stats.copies == 2 and stats.ring_growths == 0, stats
    extents = [memfd_extent(b.untyped_storage().data_ptr()) for b in kept]
    own = [e for e in extents if e]
    # all but the 3 lent (every worker keeps a slot) and the 2 copies (the batch that found the
    # ring held and the one in flight beside it)
    assert len(own) == stats.overflow_batches == 60 - 3 - 2, (len(own), stats)
    assert own == [16 * page] * len(own), sorted(set(own))
    del kept, it


def test_held_batches_with_skeletons_and_dataset_states_equal_torchs() -> None:
    # Held batches of every shape come in memory of their own: dicts with strings (their
    # skeleton in the slot, or with the leaves when it does not fit the slot: every 7th text is
    # ~100 KB), and an IterableDataset's state after each batch, which a checkpoint taken with
    # every batch held resumes from.
    from tests.datasets import StatefulShards, Tokens, pad_collate

    want = list(tud.DataLoader(Tokens(96, first_small=8, big_every=7), batch_size=4, collate_fn=pad_collate))
    loader = shmloader.DataLoader(Tokens(96, first_small=8, big_every=7), batch_size=4, num_workers=2,
                                  collate_fn=pad_collate)
    same(list(loader), want)
    assert loader.stats().overflow_batches >= 1

    want_shards = list(tud.DataLoader(StatefulShards(200), batch_size=4, num_workers=2))
    stateful = shmloader.DataLoader(StatefulShards(200), batch_size=4, num_workers=2, prefetch_factor=2)
    it = iter(stateful)
    held = [next(it) for _ in range(30)]
    state = stateful.state_dict()
    same(held, want_shards[:30])
    assert stateful.stats().overflow_batches >= 20
    del held, it
    resumed = shmloader.DataLoader(StatefulShards(200), batch_size=4, num_workers=2)
    resumed.load_state_dict(state)
    same(list(resumed), want_shards[30:])
