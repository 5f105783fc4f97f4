"""state_dict / load_state_dict: a resumed run equals the uninterrupted one, batch for batch."""

from __future__ import annotations

import json
import multiprocessing
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch

import shmloader
from tests.datasets import Range, Shards, StatefulShards

EPOCHS = 3
N, BS = 22, 4  # 6 batches an epoch, the last one short


def factory(kind: str, persistent: bool, workers: int = 2) -> Callable[[], shmloader.DataLoader]:
    def make() -> shmloader.DataLoader:
        kw: dict[str, Any] = {"batch_size": BS, "num_workers": workers, "persistent_workers": persistent and workers > 0}
        if kind == "shuffle-generator":
            return shmloader.DataLoader(Range(N), shuffle=True, generator=torch.Generator().manual_seed(5), **kw)
        if kind == "shuffle-global":
            return shmloader.DataLoader(Range(N), shuffle=True, **kw)
        if kind == "sequential":
            return shmloader.DataLoader(Range(N), **kw)
        if kind == "iterable-stateful":
            return shmloader.DataLoader(StatefulShards(N), **kw)
        return shmloader.DataLoader(Shards(N), **kw)
    return make


def epochs_of(loader: shmloader.DataLoader, n: int) -> list[list[list[int]]]:
    return [[b.flatten().tolist() for b in loader] for _ in range(n)]


def close(loader: shmloader.DataLoader) -> None:
    if loader._iterator is not None:
        loader._iterator._shutdown_workers()


@pytest.mark.parametrize("kind", ["shuffle-generator", "shuffle-global", "sequential", "iterable", "iterable-stateful"])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("cut", [(0, 0), (0, 3), (1, 5), (1, 6)])
def test_resume_equals_uninterrupted(kind: str, persistent: bool, cut: tuple[int, int]) -> None:
    make = factory(kind, persistent)
    torch.manual_seed(0)
    reference = make()
    want = epochs_of(reference, EPOCHS)
    close(reference)

    torch.manual_seed(0)
    first = make()
    cut_epoch, k = cut
    before = epochs_of(first, cut_epoch)
    it = iter(first)
    head = [next(it).flatten().tolist() for _ in range(k)]
    state = pickle.loads(pickle.dumps(first.state_dict()))  # it must survive a checkpoint file
    program_rng = torch.get_rng_state()  # checkpointed with it, as Accelerate, Lightning and Trainer do
    del it
    close(first)

    torch.manual_seed(1234)  # the resumed process's global RNG is somewhere else entirely...
    torch.set_rng_state(program_rng)  # ...until the program restores its own
    resumed = make()
    resumed.load_state_dict(state)
    rest = [b.flatten().tolist() for b in resumed]  # (k == 6: taken after the last batch, before the
    got = before + [head + rest] + epochs_of(resumed, EPOCHS - cut_epoch - 1)  # StopIteration: the empty rest)
    close(resumed)
    assert got == want


def train(loader: shmloader.DataLoader, steps: int | None, log: list[tuple[list[int], float]]) -> None:
    """Up to ``steps`` batches of one epoch (then ``break``: a non-persistent iterator is
    dropped before the state is taken), each followed by a draw of the program's own from
    torch's global RNG (as dropout makes)."""
    for i, batch in enumerate(loader):
        log.append((batch.flatten().tolist(), torch.rand(()).item()))
        if i + 1 == steps:
            break


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("k", [0, 3])
def test_the_programs_own_draws_continue_after_a_resume(workers: int, persistent: bool, k: int) -> None:
    # Without a generator the loader shares torch's global RNG with the program, which
    # checkpoints and restores it: resuming remakes the epoch's draws without moving it, so the
    # program's own draws after the resume, and the next epoch's shuffle, are the
    # uninterrupted run's.
    make = factory("shuffle-global", persistent, workers)
    torch.manual_seed(0)
    reference = make()
    want: list[tuple[list[int], float]] = []
    for _ in range(2):
        train(reference, None, want)
    close(reference)

    torch.manual_seed(0)
    first = make()
    got: list[tuple[list[int], float]] = []
    if k:
        train(first, k, got)
    else:
        it = iter(first)  # noqa: F841 (kept: an epoch started, nothing taken yet)
    state, program_rng = first.state_dict(), torch.get_rng_state()
    close(first)
    torch.manual_seed(1234)
    torch.set_rng_state(program_rng)
    resumed = make()
    resumed.load_state_dict(state)
    for _ in range(2):
        train(resumed, None, got)
    close(resumed)
    assert got == want


@pytest.mark.parametrize("k", [0, 2, 5])
def test_resume_without_workers(k: int) -> None:
    make = factory("shuffle-generator", persistent=False, workers=0)
    want = epochs_of(make(), 2)
    first = make()
    it = iter(first)
    head = [next(it).flatten().tolist() for _ in range(k)]
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert head + [b.flatten().tolist() for b in resumed] == want[0]
    assert epochs_of(resumed, 1) == want[1:]


def test_state_before_iterating_and_bad_states() -> None:
    loader = factory("shuffle-generator", persistent=False)()
    state = loader.state_dict()
    assert state["_snapshot"]["_snapshot_step"] == 0 and len(state["_snapshot"]["_worker_snapshots"]) == 2
    fresh = factory("shuffle-generator", persistent=False)()
    fresh.load_state_dict(state)
    assert epochs_of(fresh, 1) == epochs_of(factory("shuffle-generator", persistent=False)(), 1)
    with pytest.raises(ValueError, match="not a StatefulDataLoader state dict"):
        loader.load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="version 99 is not supported"):
        loader.load_state_dict({**state, "_shmloader": {**state["_shmloader"], "version": 99}})


def test_taking_a_state_does_not_disturb_the_epoch() -> None:
    loader = factory("shuffle-generator", persistent=False)()
    want = epochs_of(factory("shuffle-generator", persistent=False)(), 1)[0]
    got = []
    for batch in loader:
        got.append(batch.flatten().tolist())
        loader.state_dict()
    assert got == want


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("k", [1, 3, 5, 6])
def test_a_stateful_iterable_dataset_resumes_from_its_own_state(workers: int, k: int) -> None:
    make = factory("iterable-stateful", persistent=False, workers=workers)
    want = epochs_of(make(), 2)
    first = make()
    it = iter(first)
    head = [next(it).flatten().tolist() for _ in range(min(k, len(want[0])))]
    state = pickle.loads(pickle.dumps(first.state_dict()))
    snapshots = list(state["_snapshot"]["_worker_snapshots"].values()) if workers else [state]
    assert any(s["dataset_state"] is not None for s in snapshots)
    del it
    close(first)
    resumed = make()
    resumed.load_state_dict(state)
    rest = [b.flatten().tolist() for b in resumed]
    assert head + rest == want[0]
    if workers:
        assert resumed.stats().batches == len(rest)  # nothing was produced again and dropped
    assert epochs_of(resumed, 1) == want[1:]
    close(resumed)


class SlowOne(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Item 3 waits for ``gate``: with in_order=False the batches after it come first."""

    def __init__(self, n: int, gate: Any) -> None:
        self.n, self.gate = n, gate

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == 3:
            self.gate.wait(60)
        return i


@pytest.mark.parametrize("k", [4, 9])
def test_an_out_of_order_epoch_resumes_exactly(k: int) -> None:
    # The batches consumed are not a prefix of the sampler's: the state says which tasks were,
    # and the resumed epoch makes exactly the others, each once; and so again after a second
    # state taken in the resumed epoch (whose tasks skip the consumed ones).
    gate = multiprocessing.Event()
    first = shmloader.DataLoader(SlowOne(24, gate), batch_size=None, num_workers=2, in_order=False)
    it = iter(first)
    head = [int(next(it)) for _ in range(k)]
    assert 3 not in head
    state = json.loads(json.dumps(first.state_dict()))
    gate.set()
    del it
    close(first)
    again = shmloader.DataLoader(SlowOne(24, gate), batch_size=None, num_workers=2, in_order=False)
    again.load_state_dict(state)
    it = iter(again)
    middle = [int(next(it)) for _ in range(5)]
    state = json.loads(json.dumps(again.state_dict()))
    del it
    close(again)
    resumed = shmloader.DataLoader(SlowOne(24, gate), batch_size=None, num_workers=2, in_order=False)
    resumed.load_state_dict(state)
    rest = [int(b) for b in resumed]
    assert sorted(head + middle + rest) == list(range(24))


def _through_json(state: dict[str, Any], tmp: Any, template: dict[str, Any]) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(json.dumps(state))
    return loaded


def _through_torch_save(state: dict[str, Any], tmp: Any, template: dict[str, Any]) -> dict[str, Any]:
    torch.save(state, tmp / "state.pt")
    loaded: dict[str, Any] = torch.load(tmp / "state.pt", weights_only=True)  # (nothing but plain values)
    return loaded


def _through_dcp(state: dict[str, Any], tmp: Any, template: dict[str, Any]) -> dict[str, Any]:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # (a single process, as here)
        dcp.save(state, checkpoint_id=tmp / "dcp")
        dcp.load(template, checkpoint_id=tmp / "dcp")  # (in place, into a fresh loader's state)
    return template


@pytest.mark.parametrize("through", [_through_json, _through_torch_save, _through_dcp], ids=["json", "torch.save", "dcp"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_travels_through_json_torch_save_and_distributed_checkpoint(through: Any, workers: int,
                                                                           tmp_path: Any) -> None:
    make = factory("shuffle-global", persistent=False, workers=workers)
    torch.manual_seed(0)
    want = epochs_of(make(), 2)
    torch.manual_seed(0)
    first = make()
    it = iter(first)
    head = [next(it).flatten().tolist() for _ in range(2)]
    state = first.state_dict()
    del it
    close(first)
    torch.manual_seed(99)  # (a new process: the state brings the sampling RNG back)
    resumed = make()
    resumed.load_state_dict(through(state, tmp_path, resumed.state_dict()))
    assert [head + [b.flatten().tolist() for b in resumed]] + epochs_of(resumed, 1) == want
    close(resumed)
