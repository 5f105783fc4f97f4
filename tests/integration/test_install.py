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
from shmloader.main.iterator import RingIterator
from tests.conftest import same
from tests.datasets import Augmented, Range, Tokens, pad_collate
from tests.integration.test_errors import job, outcomes

needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None or importlib.util.find_spec("torchdata") is None,
    reason="accelerate and torchdata are not installed",
)


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
    with pytest.raises(ValueError, match="has not used a shmloader ring: it has num_workers=0"):
        shmloader.stats(plain)
    own = shmloader.DataLoader(Range(8), batch_size=2, num_workers=2, max_worker_restarts=9)
    list(own)
    assert own.max_worker_restarts == 9 and shmloader.stats(own).batches == 4


class PreparedLoader(tud.DataLoader):  # type: ignore[type-arg]
    """What Ray Train's ``prepare_data_loader`` returns (ray.train.torch's _WrappedDataLoader):
    a DataLoader subclass with a copy of the loader's attributes as they were when it was
    wrapped, which iterates the wrapped loader (ray is not a test dependency)."""

    def __init__(self, base: tud.DataLoader) -> None:  # type: ignore[type-arg]
        self.__dict__.update(getattr(base, "__dict__", {}))
        self._dataloader = base

    def __len__(self) -> int:
        return len(self._dataloader)

    def __iter__(self) -> Any:
        yield from self._dataloader


def test_stats_find_the_ring_through_a_wrapper(ring: None) -> None:
    prepared = PreparedLoader(tud.DataLoader(Range(8), batch_size=2, num_workers=2))
    assert [b.tolist() for b in prepared] == [[[0], [1]], [[2], [3]], [[4], [5]], [[6], [7]]]
    assert shmloader.stats(prepared).batches == 4
    idle = PreparedLoader(tud.DataLoader(Range(8), batch_size=2, num_workers=2))
    with pytest.raises(ValueError, match=r"test_install.PreparedLoader wrapping torch.utils.data.dataloader.DataLoader "
                                         r"has not used a shmloader ring: it has not been iterated under"):
        shmloader.stats(idle)
    with pytest.raises(ValueError, match=r"builtins.list has not used a shmloader ring: it is not a DataLoader"):
        shmloader.stats([1, 2])


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



Log = list[tuple[list[int], float]]


def accelerate_job(stateful: bool) -> tuple[Any, Any]:
    """What an Accelerate training script builds, the same in the first run and in the resumed
    one: a seeded Accelerator (seedable sampler, so the epoch's shuffle follows set_epoch) and a
    shuffled torch DataLoader with workers, prepared."""
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import set_seed

    set_seed(0)
    config = DataLoaderConfiguration(use_seedable_sampler=True, use_stateful_dataloader=stateful)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = tud.DataLoader(Range(40), batch_size=4, shuffle=True, num_workers=2)
    return accelerator, accelerator.prepare(model, optimizer, loader)[2]


def train(loader: Any, log: Log, steps: int | None = None) -> None:
    """Up to ``steps`` batches, each followed by a draw from torch's global RNG (dropout's)."""
    for i, batch in enumerate(loader):
        log.append((batch.flatten().tolist(), torch.rand(()).item()))
        if i + 1 == steps:
            return


def accelerate_resume(stateful: bool, checkpoint: Any) -> tuple[Log, Log, Any]:
    """Epochs 0-2 uninterrupted; then again, saved with save_state after 3 batches of epoch 1
    and resumed by a fresh script with load_state: Accelerate's stateful-loader recipe, or its
    skip_first_batches one. Returns both logs and the resumed loader."""
    from accelerate import skip_first_batches

    _, loader = accelerate_job(stateful)
    want: Log = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        train(loader, want)

    accelerator, loader = accelerate_job(stateful)
    got: Log = []
    train(loader, got)
    loader.set_epoch(1)
    train(loader, got, steps=3)
    accelerator.save_state(checkpoint)

    torch.manual_seed(1234)  # the resumed script's RNG starts anywhere: load_state sets it
    accelerator, loader = accelerate_job(stateful)
    accelerator.load_state(checkpoint)
    loader.set_epoch(1)
    train(loader if stateful else skip_first_batches(loader, 3), got)
    loader.set_epoch(2)
    train(loader, got)
    return want, got, loader


@needs_accelerate
@pytest.mark.parametrize("stateful", [True, False], ids=["use_stateful_dataloader", "skip_first_batches"])
def test_accelerate_save_state_load_state_resume_mid_epoch_exactly(stateful: bool, tmp_path: Any) -> None:
    with shmloader.installed(stateful_dataloader=True):
        want, got, loader = accelerate_resume(stateful, tmp_path / "ring")
        assert shmloader.stats(loader).batches > 0
    assert [b for b, _ in got] == [b for b, _ in want]
    if stateful:
        # The loader's state brings the RNG back to where it was saved: the training's own
        # draws after the resume are the uninterrupted run's too.
        assert got == want
    # The same job through torch's own DataLoader (no ring; resumed with skip_first_batches).
    # Not torchdata's iterator: under Accelerate it starts epoch 0 before prepare() installs the
    # seedable sampler (its state_dict() in DataLoaderShard's constructor starts the iterator),
    # so its epoch 0 is not the configured shuffle.
    torch_want, torch_got, _ = accelerate_resume(False, tmp_path / "torch")
    assert [b for b, _ in torch_want] == [b for b, _ in want]
    assert [b for b, _ in torch_got] == [b for b, _ in got]


@needs_accelerate
def test_a_stateful_dataloader_is_left_alone_unless_opted_in(ring: None) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(Range(8), batch_size=2, num_workers=2)
    assert [b.flatten().tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    torchdata_state = loader.state_dict()
    assert not isinstance(loader._iterator, RingIterator) and "_snapshot" in torchdata_state
    del loader
    with shmloader.installed(stateful_dataloader=True):
        opted = StatefulDataLoader(Range(8), batch_size=2, num_workers=2)
        it = iter(opted)
        assert [next(it).flatten().tolist() for _ in range(2)] == [[0, 1], [2, 3]]
        state = opted.state_dict()
        assert isinstance(it, RingIterator) and state["_snapshot"]["_snapshot_step"] == 2
        with pytest.raises(ValueError, match="taken by torchdata's own StatefulDataLoader iterator"):
            opted.load_state_dict(torchdata_state)  # one taken by torchdata's own iterator: refused, clearly
        del it
        resumed = StatefulDataLoader(Range(8), batch_size=2, num_workers=2)
        resumed.load_state_dict(state)
        assert [b.flatten().tolist() for b in resumed] == [[4, 5], [6, 7]]
    assert StatefulDataLoader.state_dict.__module__.startswith("torchdata")  # given back



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
