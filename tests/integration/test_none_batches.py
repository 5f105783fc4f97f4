"""A batch may be any value, None and falsy ones included: each arrives exactly once, in
torch's order, through every path of the iterator (the first next() and later ones, in and
out of order, iterable datasets, timeouts, async for, device delivery, persistent epochs).
"Nothing ready" inside the iterator is a private sentinel, never a user's value."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset, IterableDataset

import shmloader
from tests.conftest import examples
from tests.fakes import FakeStream, fake_device

PLANS = {
    "first": [None, 1, 2, 3, 4],
    "middle": [1, 2, None, 3, 4],
    "last": [1, 2, 3, 4, None],
    "all": [None, None, None, None],
    "alternating": [1, None, 2, None],
}


class Plan(Dataset):  # type: ignore[type-arg]
    """Sample i is ``plan[i]``: with batch_size=None, batch i."""

    def __init__(self, plan: list[Any]) -> None:
        self.plan = plan

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, i: int) -> Any:
        return self.plan[i]


class PlanStream(IterableDataset):  # type: ignore[type-arg]
    """The plan, split between the workers as torch's docs shard an IterableDataset."""

    def __init__(self, plan: list[Any]) -> None:
        self.plan = plan

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        step, first = (1, 0) if info is None else (info.num_workers, info.id)
        return iter(self.plan[first::step])


def typed(batches: list[Any]) -> list[tuple[str, Any]]:
    """Batches as (type, value): 0, False and None are three different batches."""
    return [(type(b).__name__, b) for b in batches]


def torchs(dataset: Any, **kw: Any) -> list[tuple[str, Any]]:
    return typed(list(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, **kw)))


async def collected(loader: Any) -> list[Any]:
    return [batch async for batch in loader]


def run_async(loader: Any) -> list[Any]:
    """An epoch through ``async for``, bounded: a hang fails the test instead of stopping CI."""
    return asyncio.run(asyncio.wait_for(collected(loader), timeout=60))


MODES = ["map", "iterable", "unordered", "timeout", "persistent", "async", "async iterable", "device"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("plan", list(PLANS))
def test_none_batches_arrive_as_torchs(plan: str, mode: str, request: pytest.FixtureRequest) -> None:
    values = PLANS[plan]
    dataset: Any = PlanStream(values) if "iterable" in mode else Plan(values)
    kw: dict[str, Any] = {"in_order": mode != "unordered", "timeout": 30 if mode == "timeout" else 0,
                          "persistent_workers": mode == "persistent"}
    want = torchs(dataset, **kw)
    loader = shmloader.DataLoader(dataset, batch_size=None, num_workers=2, **kw)
    if mode == "device":
        request.getfixturevalue("fake_cuda")
        fake_device(loader)
    epochs = 2 if mode == "persistent" else 1
    for _ in range(epochs):
        got = typed(run_async(loader) if "async" in mode else list(loader))
        if mode == "unordered":  # the order is the workers' timing: exactly once each
            got, want = sorted(got, key=repr), sorted(want, key=repr)
        assert got == want
    assert loader.stats().batches == len(values) * epochs


class SkipBad(Dataset):  # type: ignore[type-arg]
    """Samples of which some are bad (None); a batch of only bad samples collates to None."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> Any:
        return None if i < 4 or 6 <= i < 8 else torch.tensor([i])


def skip_bad_collate(samples: list[Any]) -> Any:
    good = [s for s in samples if s is not None]
    return torch.utils.data.default_collate(good) if good else None


@pytest.mark.parametrize("persistent", [False, True])
def test_a_skip_bad_samples_collate_loses_no_batch(persistent: bool) -> None:
    kw: dict[str, Any] = {"batch_size": 2, "num_workers": 2, "collate_fn": skip_bad_collate,
                          "persistent_workers": persistent}
    want = [None if b is None else b.tolist() for b in torch.utils.data.DataLoader(SkipBad(), **kw)]
    assert want[:2] == [None, None] and want[3] is None
    loader = shmloader.DataLoader(SkipBad(), **kw)
    for _ in range(2):  # every epoch begins with None batches
        assert [None if b is None else b.tolist() for b in loader] == want


def test_state_dict_and_stats_count_a_none_batch_once() -> None:
    loader = shmloader.DataLoader(Plan([None, 1, None, 2]), batch_size=None, num_workers=2)
    it = iter(loader)
    assert next(it) is None and next(it) == 1 and next(it) is None
    state = loader.state_dict()
    assert loader.stats().batches == 3
    resumed = shmloader.DataLoader(Plan([None, 1, None, 2]), batch_size=None, num_workers=2)
    resumed.load_state_dict(state)
    assert list(resumed) == [2]
    del it


FALSY = st.sampled_from([None, 0, False, "", [], {}, 0.0, b""]) | st.integers(1, 9)


@settings(max_examples=examples(12), deadline=None)
@given(plan=st.lists(FALSY, min_size=1, max_size=10), use_async=st.booleans())
def test_falsy_batches_arrive_exactly_once_in_order(plan: list[Any], use_async: bool) -> None:
    # With batch_size=None torch's loader delivers each sample as it is (default_convert leaves
    # these alone): the plan itself, type for type.
    loader = shmloader.DataLoader(Plan(plan), batch_size=None, num_workers=2)
    got = run_async(loader) if use_async else list(loader)
    assert typed(got) == typed(plan)


def test_device_delivery_of_none_between_tensors(fake_cuda: FakeStream) -> None:
    # Staged "copies" (the fakes) of tensors, and None batches between them, each once, in order.
    loader = fake_device(shmloader.DataLoader(Plan([None, torch.ones(2), None]), batch_size=None, num_workers=2))
    got = list(loader)
    assert got[0] is None and got[2] is None and torch.equal(got[1], torch.ones(2))
