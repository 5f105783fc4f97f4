"""torchdata's ``test/stateful_dataloader/test_sampler.py``, rewritten: each case that iterates a
loader runs through the loader under test (``SDL``). The cases of ``StatefulDistributedSampler``
alone (no loader) run once: they hold what the loader cases rely on."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler


class MockDataset(Dataset[torch.Tensor]):
    def __init__(self, size: int) -> None:
        self.size = size
        self.data = torch.arange(size)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> torch.Tensor:
        return self.data[idx]


@pytest.fixture
def dataset() -> MockDataset:
    return MockDataset(100)


def test_initialization_stateful_distributed_sampler(dataset: MockDataset) -> None:
    sampler = StatefulDistributedSampler(dataset, num_replicas=10, rank=0, shuffle=False, seed=42, drop_last=False)
    assert sampler.dataset is dataset
    assert (sampler.num_replicas, sampler.rank, sampler.shuffle, sampler.seed, sampler.drop_last) == (10, 0, False, 42, False)
    assert sampler.yielded == 0 and sampler.next_yielded is None


def test_dataloader_state_dict(SDL: Any, dataset: MockDataset) -> None:
    sampler = StatefulDistributedSampler(dataset, num_replicas=1, rank=0, shuffle=False)
    dataloader = SDL(dataset, batch_size=10, sampler=sampler)
    for i, _ in enumerate(dataloader):  # a partial epoch
        if i == 4:
            break
    state_dict = dataloader.state_dict()
    new_dataloader = SDL(dataset, batch_size=10,
                         sampler=StatefulDistributedSampler(dataset, num_replicas=1, rank=0, shuffle=False))
    new_dataloader.load_state_dict(state_dict)
    resumed = [data.tolist() for data in new_dataloader]
    expected = [data.tolist() for data in SDL(dataset, batch_size=10, sampler=sampler)]
    assert resumed == expected[5:]


def test_sampler_state_dict(dataset: MockDataset) -> None:
    sampler = StatefulDistributedSampler(dataset, num_replicas=10, rank=0)
    sampler.yielded = 5
    assert sampler.state_dict()["yielded"] == 5


def test_sampler_load_state_dict(dataset: MockDataset) -> None:
    sampler = StatefulDistributedSampler(dataset, num_replicas=10, rank=0)
    sampler.load_state_dict({"epoch": 0, "yielded": 3})
    assert sampler.next_yielded == 3
    with pytest.raises(ValueError):
        sampler.load_state_dict({"epoch": 0, "yielded": -1})


def test_sampler_next_yielded(dataset: MockDataset) -> None:
    sampler = StatefulDistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=42)
    iterator = iter(sampler)
    next(iterator)
    assert sampler.yielded == 1 and sampler.next_yielded is None
    # (upstream spells the keys StatefulDistributedSampler._EPOCH and _YIELDED, which torchdata
    # 0.11 does not have: their values, as test_sampler_load_state_dict writes them)
    sampler.load_state_dict({"epoch": 0, "yielded": 5})
    assert sampler.next_yielded == 5
    iterator = iter(sampler)
    next(iterator)
    assert sampler.yielded == 6


def test_drop_last_effect(SDL: Any, dataset: MockDataset) -> None:
    def indices(drop_last: bool) -> list[Any]:
        sampler = StatefulDistributedSampler(dataset, num_replicas=3, rank=0, drop_last=drop_last, shuffle=False)
        return [data for batch in SDL(dataset, sampler=sampler) for data in batch]

    with_drop, without_drop = indices(True), indices(False)
    assert len(with_drop) == len(dataset) // 3
    assert len(without_drop) == math.ceil(len(dataset) / 3)
    assert len(with_drop) <= len(without_drop)


def test_data_order_with_shuffle(SDL: Any, dataset: MockDataset) -> None:
    sampler = StatefulDistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True)
    sampled = [dataset[i] for i in list(iter(sampler))]
    assert sampled != list(range(100))
    loaded = [x for batch in SDL(dataset, sampler=sampler) for x in batch]
    assert len(loaded) == len(dataset)
    assert loaded == sampled


def test_data_order_without_shuffle(SDL: Any, dataset: MockDataset) -> None:
    sampler = StatefulDistributedSampler(dataset, num_replicas=1, rank=0, shuffle=False)
    sampled = [dataset[i] for i in list(iter(sampler))]
    assert sampled == list(range(100))
    loaded = [x for batch in SDL(dataset, batch_size=32, sampler=sampler) for x in batch]
    assert len(loaded) == len(dataset)
    assert loaded == sampled
    assert loaded == list(range(100))


def test_data_distribution_across_replicas(SDL: Any, dataset: MockDataset) -> None:
    everything = []
    for rank in range(5):
        sampler = StatefulDistributedSampler(dataset, num_replicas=5, rank=rank, shuffle=False)
        everything += [int(x.item()) for batch in SDL(dataset, sampler=sampler) for x in batch]
    assert sorted(everything) == list(range(100))


def test_seed_replicability(SDL: Any, dataset: MockDataset) -> None:
    seed = int(torch.randint(0, 1000, (1,), dtype=torch.int64).item())
    torch.manual_seed(seed)
    results1 = list(SDL(dataset, batch_size=1, shuffle=True))
    torch.manual_seed(seed)
    results2 = list(SDL(dataset, batch_size=1, shuffle=True))
    seed = int(torch.randint(1000, 2000, (1,), dtype=torch.int64).item())
    torch.manual_seed(seed)
    results3 = list(SDL(dataset, batch_size=1, shuffle=True))
    assert results1 == results2
    assert results1 != results3
