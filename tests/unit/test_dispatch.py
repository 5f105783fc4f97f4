"""Which batches the consumer dispatches: ``batches_of`` against torch's own batch sampler."""

from __future__ import annotations

from typing import Any

import pytest
import torch.utils.data as tud

from shmloader.main.dispatch import as_list, batches_of


@pytest.mark.parametrize("drop_last", [False, True])
def test_sequential_batches_are_torchs_as_ranges(drop_last: bool) -> None:
    for n in range(0, 41):
        for size in (1, 2, 3, 7, 40, 64):
            sampler = tud.BatchSampler(tud.SequentialSampler(range(n)), size, drop_last)
            got = list(batches_of(sampler))
            assert all(type(b) is range for b in got)
            assert [as_list(b) for b in got] == list(sampler), (n, size)


def test_the_length_is_read_when_the_first_batch_is_asked_for() -> None:
    # As BatchSampler's loop reads it: a dataset that grows between iter() and next() counts.
    data = list(range(10))
    ours = batches_of(tud.BatchSampler(tud.SequentialSampler(data), 4, False))
    torchs = iter(tud.BatchSampler(tud.SequentialSampler(data), 4, False))
    data.extend(range(10, 14))
    assert [as_list(b) for b in ours] == list(torchs) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13]]


class MyBatchSampler(tud.BatchSampler):
    pass


class MySequential(tud.SequentialSampler):  # type: ignore[type-arg]
    pass


@pytest.mark.parametrize("sampler", [
    MyBatchSampler(tud.SequentialSampler(range(9)), 4, False),  # a subclass may iterate otherwise
    tud.BatchSampler(MySequential(range(9)), 4, False),
    tud.BatchSampler(tud.RandomSampler(range(9)), 4, False),
    [[0, 1], [5]],
])
def test_any_other_sampler_is_iterated_as_it_is(sampler: Any) -> None:
    got = list(batches_of(sampler))
    assert all(type(b) is list for b in got) and len(got) == len(sampler)


def test_as_list_leaves_other_indices_alone() -> None:
    index = (1, 2)
    assert as_list(index) is index and as_list(range(2, 5)) == [2, 3, 4]
