"""IterableDataset epochs whose shards differ in length, against torch's DataLoader.

With ``in_order=False`` torch gives a task to an active worker with fewer than
``max_tasks // active workers`` tasks, and when none has, waits for a result: once a shard ends
and that share floors, no worker may take one for a while, which is never the end of the
epoch. Each worker batches its own shard, so the multiset of batches (and with
``in_order=True`` their order) is torch's whatever the timing.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch.utils.data as tud
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmloader
from tests.conftest import examples
from tests.datasets import LenShards


def shapes(workers: int) -> dict[str, list[int]]:
    """Shard lengths: one shard empty, one short, none equal."""
    return {"empty": [0 if w == 1 else 30 for w in range(workers)],
            "short": [2] + [40] * (workers - 1),
            "unequal": [5 + 13 * w for w in range(workers)][::-1]}


def epoch(cls: type[tud.DataLoader], lengths: list[int], **kw: Any) -> list[tuple[int, ...]]:  # type: ignore[type-arg]
    return [tuple(batch.flatten().tolist()) for batch in cls(LenShards(lengths), num_workers=len(lengths), **kw)]


@pytest.mark.parametrize("batch_size", [None, 5])
@pytest.mark.parametrize("prefetch", [1, 2, 3])
@pytest.mark.parametrize("workers", [2, 3, 4])
@pytest.mark.parametrize("shape", ["empty", "short", "unequal"])
def test_an_unordered_epoch_of_unequal_shards_delivers_all_of_torchs_batches(
        shape: str, workers: int, prefetch: int, batch_size: int | None) -> None:
    lengths = shapes(workers)[shape]
    kw = dict(batch_size=batch_size, prefetch_factor=prefetch, in_order=False)
    want = epoch(tud.DataLoader, lengths, **kw)
    got = epoch(shmloader.DataLoader, lengths, **kw)
    assert len(got) == len(want)
    assert Counter(got) == Counter(want)


def test_a_short_shard_does_not_end_the_epoch_in_the_issue_s_job() -> None:
    # The report's job: torch delivers 122 batches; the epoch used to end after 19.
    lengths = [2, 40, 40, 40]
    got = epoch(shmloader.DataLoader, lengths, batch_size=None, in_order=False)
    assert sorted(got) == sorted((w * 1000 + i,) for w, n in enumerate(lengths) for i in range(n))


def test_each_epoch_of_persistent_workers_is_whole() -> None:
    lengths = [1, 17, 0]
    kw: dict[str, Any] = dict(batch_size=4, in_order=False, persistent_workers=True, num_workers=3)
    loader = shmloader.DataLoader(LenShards(lengths), **kw)
    want = Counter(tuple(b.flatten().tolist()) for b in tud.DataLoader(LenShards(lengths), **kw))
    for _ in range(3):
        assert Counter(tuple(b.flatten().tolist()) for b in loader) == want
    del loader


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(0, 25), min_size=2, max_size=4), prefetch=st.integers(1, 3),
       batch_size=st.sampled_from([None, 1, 3]), in_order=st.booleans())
def test_any_shard_lengths_give_torchs_epoch(lengths: list[int], prefetch: int, batch_size: int | None,
                                             in_order: bool) -> None:
    kw = dict(batch_size=batch_size, prefetch_factor=prefetch, in_order=in_order)
    want = epoch(tud.DataLoader, lengths, **kw)
    got = epoch(shmloader.DataLoader, lengths, **kw)
    if in_order:
        assert got == want
    else:
        assert Counter(got) == Counter(want)
