"""shmloader.install(): torch's own DataLoader, and the loaders frameworks build from it
(Accelerate's prepare and skip_first_batches), carry their batches through the ring, with
torch's batches, order and errors; uninstalled, torch's iterator is back."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

import shmloader
from shmloader._consume import RingIterator
from tests.conftest import same
from tests.datasets import Augmented, Range, Tokens, pad_collate
from tests.integration.test_errors import job, outcomes

needs_accelerate = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed")


@pytest.fixture
def ring() -> Iterator[None]:
    with shmloader.installed(max_worker_restarts=5):
        yield
    assert not shmloader._install.is_installed()


def test_torchs_loader_uses_the_ring_with_torchs_results(ring: None) -> None:
    kw: dict[str, Any] = dict(batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)
    loader = tud.DataLoader(Augmented(), generator=torch.Generator().manual_seed(3), **kw)
    got = [list(loader) for _ in range(2)]
    assert isinstance(loader._iterator, RingIterator)
    assert loader.max_worker_restarts == 5  # install()'s options, as attributes
    shmloader.uninstall()
    want_loader = tud.DataLoader(Augmented(), generator=torch.Generator().manual_seed(3), **kw)
    want = [list(want_loader) for _ in range(2)]
    assert isinstance(want_loader._iterator, _MultiProcessingDataLoaderIter)
    same(got, want)
    assert shmloader.stats(loader).batches == 24


def test_errors_and_variable_batches_are_torchs_under_install(ring: None) -> None:
    got = outcomes(tud.DataLoader(**job(True, num_workers=2)), epochs=2)
    varlen = tud.DataLoader(Tokens(48, first_small=8), batch_size=8, collate_fn=pad_collate, num_workers=2)
    got_varlen = list(varlen)
    assert shmloader.stats(varlen).overflow_batches >= 1
    shmloader.uninstall()
    assert got == outcomes(tud.DataLoader(**job(True, num_workers=2)), epochs=2)
    same(got_varlen, list(tud.DataLoader(Tokens(48, first_small=8), batch_size=8, collate_fn=pad_collate)))


def test_no_workers_and_shmloaders_own_options_are_left_alone(ring: None) -> None:
    plain = tud.DataLoader(Range(8), batch_size=2)
    assert [b.tolist() for b in plain] == [[[0], [1]], [[2], [3]], [[4], [5]], [[6], [7]]]
    with pytest.raises(ValueError, match="has not used a shmloader ring"):
        shmloader.stats(plain)
    own = shmloader.DataLoader(Range(8), batch_size=2, num_workers=2, max_worker_restarts=9)
    list(own)
    assert own.max_worker_restarts == 9 and shmloader.stats(own).batches == 4


def test_options_are_validated_like_shmloaders() -> None:
    with pytest.raises(ValueError, match="max_worker_restarts should be a non-negative int"):
        shmloader.install(max_worker_restarts=-1)
    assert not shmloader._install.is_installed()


@needs_accelerate
def test_accelerate_prepare_and_skip_first_batches_use_the_ring(ring: None) -> None:
    from accelerate import Accelerator, skip_first_batches

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = shmloader.DataLoader(Range(40), batch_size=4, num_workers=2)
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    assert not isinstance(prepared, shmloader.DataLoader)  # Accelerate rebuilt it from torch's class
    got = [b.flatten().tolist() for b in prepared]
    assert got == [list(range(i, i + 4)) for i in range(0, 40, 4)]
    assert shmloader.stats(prepared).batches == 10
    skipped = skip_first_batches(prepared, 3)
    assert [b.flatten().tolist() for b in skipped] == got[3:]
    assert shmloader.stats(skipped).batches == 7


@needs_accelerate
def test_a_shmloader_loader_through_prepare_keeps_its_options(ring: None) -> None:
    from accelerate import Accelerator

    loader = shmloader.DataLoader(Range(40), batch_size=4, num_workers=2, slot_bytes=1 << 16,
                                  memory_budget="8MiB", max_worker_restarts=7)
    prepared = Accelerator(cpu=True).prepare(loader)
    assert [b.flatten().tolist() for b in prepared] == [list(range(i, i + 4)) for i in range(0, 40, 4)]
    assert (prepared.slot_bytes, prepared.memory_budget, prepared.max_worker_restarts) == (1 << 16, "8MiB", 7)
    assert shmloader.stats(prepared).batches == 10



def test_a_tensor_dataset_shared_with_torch_loaders_warns_once_and_then_uses_the_ring() -> None:
    # The registry keys datasets by identity: a tensor's elementwise == is never asked.
    data = torch.arange(64.0).reshape(16, 4)
    assert len(list(shmloader.DataLoader(data, batch_size=4, num_workers=2))) == 4
    with pytest.warns(UserWarning, match="will not use shmloader's ring") as caught:
        for _ in range(2):
            assert len(list(tud.DataLoader(data, batch_size=4, num_workers=2))) == 4
    assert len(caught) == 1
    with shmloader.installed():
        loader = tud.DataLoader(data, batch_size=4, num_workers=2)
        assert torch.equal(torch.cat(list(loader)), data)
        assert shmloader.stats(loader).batches == 4
