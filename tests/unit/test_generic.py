"""`shmloader.DataLoader[T]` works as torch's does: subscription at import time, subclassing,
`typing.get_type_hints`, pickling and deepcopy (the typed module is also checked by mypy
--strict in `make test`)."""

from __future__ import annotations

import copy
import pickle
import typing

import torch

import shmloader
from tests.datasets import Range
from tests.typed import user_module

IntLoader = shmloader.DataLoader[int]  # evaluated at import, as a user's alias would be


def returns_loader() -> shmloader.DataLoader[list[torch.Tensor]]:
    return shmloader.DataLoader(Range(4))


def test_subscription_subclass_and_type_hints() -> None:
    assert typing.get_origin(IntLoader) is shmloader.DataLoader
    assert typing.get_type_hints(returns_loader)["return"] == shmloader.DataLoader[list[torch.Tensor]]
    loader = user_module.make_loader(2)
    assert isinstance(loader, shmloader.DataLoader) and isinstance(loader, torch.utils.data.DataLoader)
    assert user_module.total(loader) == sum(range(8))
    assert user_module.stats_line(loader).startswith("2 batches")


def test_a_loader_pickles_and_deep_copies_like_torchs() -> None:
    loader = shmloader.DataLoader(Range(10), batch_size=2, num_workers=2, slot_bytes=8192, max_worker_restarts=5)
    want = [b.tolist() for b in torch.utils.data.DataLoader(Range(10), batch_size=2)]
    clone = pickle.loads(pickle.dumps(loader))
    assert (clone.slot_bytes, clone.max_worker_restarts) == (8192, 5)
    assert [b.tolist() for b in clone] == want
    it = iter(loader)
    next(it)  # mid-epoch, without persistent workers: torch's loader deep-copies here too
    assert [b.tolist() for b in copy.deepcopy(loader)] == want
    assert [b.tolist() for b in it] == want[1:]


def test_a_live_persistent_iterator_refuses_as_torchs_does() -> None:
    import pytest

    def refusal(cls: type) -> str:
        loader = cls(Range(10), batch_size=2, num_workers=2, persistent_workers=True)
        it = iter(loader)
        next(it)
        with pytest.raises(NotImplementedError) as info:
            copy.deepcopy(loader)
        message = str(info.value.args[0])
        # The traceback holds the loader: dropped now, not in the next gc pass (where torch's
        # persistent iterator takes 10 s to join its workers)
        del info, it, loader
        return message

    assert refusal(shmloader.DataLoader) == refusal(torch.utils.data.DataLoader) == "{} cannot be pickled"
