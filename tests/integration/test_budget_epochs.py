"""memory_budget from one slot per worker up, on batches large enough (1 MiB) that a held ring
turns on memory of their own: every epoch equals torch's, or the first ``next()`` refuses the
budget with the size that would do, before any batch. Never an error mid-epoch, nor at the
start of a later epoch, for batches that fit a slot."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch.utils.data as tud

import shmloader
from shmloader.wire.layout import RingGeometry
from tests.conftest import same
from tests.datasets import Sized
from tests.integration.test_memory import Budgeted

WORKERS, PREFETCH = 2, 2
SIZES = [65536] * 24  # float32: batches of 4 are 1 MiB, 6 an epoch


@functools.cache
def data_bytes() -> int:
    """A slot's data region for these batches, as the probe measures them (asked once, when the
    first test needs it: no worker starts while tests are collected)."""
    it = iter(shmloader.DataLoader(Sized(SIZES), batch_size=4, num_workers=WORKERS))
    next(it)
    assert it.ring is not None
    size = it.ring.geometry.data_bytes
    it._shutdown_workers()
    return size


SHAPES = [(slots, room) for slots in range(WORKERS, WORKERS * PREFETCH + 2) for room in (False, True)]


def budget(slots: int, room: bool) -> int:
    """A ring of ``slots`` slots, and with ``room`` one batch beside it."""
    size = data_bytes()
    return RingGeometry(WORKERS, slots, size).total_bytes + (size if room else 0)


def run(budget: int, pattern: str, persistent: bool) -> list[list[Any]]:
    """Two epochs of ``pattern``: "loop" holds its batch into the next one (a plain ``for``),
    "replay" keeps every batch, "last2" the last two."""
    loader = shmloader.DataLoader(Sized(SIZES), batch_size=4, num_workers=WORKERS, prefetch_factor=PREFETCH,
                                  memory_budget=budget, persistent_workers=persistent)
    watch = Budgeted(budget)
    epochs, kept = [], []
    for _ in range(2):
        got = []
        for batch in loader:
            got.append(batch.clone())
            watch.look()
            if pattern == "replay":
                kept.append(batch)
            elif pattern == "last2":
                kept = [*kept[-1:], batch]
        epochs.append(got)
    del batch, kept
    if persistent:
        loader._iterator._shutdown_workers()
    return epochs


@pytest.mark.parametrize("slots, room", SHAPES,
                         ids=[f"{slots} slots" + (" and a batch" if room else "") for slots, room in SHAPES])
@pytest.mark.parametrize("pattern, persistent", [("loop", False), ("loop", True), ("replay", False), ("last2", False)])
def test_every_epoch_completes_under_budgets_from_one_slot_per_worker_up(slots: int, room: bool, pattern: str,
                                                                          persistent: bool) -> None:
    want = list(tud.DataLoader(Sized(SIZES), batch_size=4))
    for got in run(budget(slots, room), pattern, persistent):
        same(got, want)


def test_a_budget_below_one_slot_per_worker_is_refused_before_any_batch() -> None:
    smallest = budget(WORKERS, False)
    loader = shmloader.DataLoader(Sized(SIZES), batch_size=4, num_workers=WORKERS, memory_budget=smallest - 1)
    it = iter(loader)
    with pytest.raises(shmloader.MemoryBudgetError,
                       match=rf"memory_budget={smallest - 1:,} bytes cannot hold one slot per worker: 2 worker\(s\) "
                             rf".* need a ring of at least {smallest:,} bytes"):
        next(it)
    del it
