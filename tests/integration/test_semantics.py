"""shmloader against torch's DataLoader: same batches, same order, same errors."""

from __future__ import annotations

import collections
import inspect
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import shmloader
from shmloader import _native
from tests.conftest import same
from tests.datasets import InitMarker, Noise, Range, Rich, Seeds, Shards, Sized, init_marker


def reference(dataset: Any, **kw: Any) -> list[Any]:
    kw.pop("num_workers", None)
    kw.pop("persistent_workers", None)
    kw.pop("in_order", None)
    kw.pop("multiprocessing_context", None)
    kw.pop("slot_bytes", None)
    return list(tud.DataLoader(dataset, num_workers=0, **kw))


def check_equal(dataset: Any, workers: int = 2, **kw: Any) -> list[Any]:
    got = list(shmloader.DataLoader(dataset, num_workers=workers, **kw))
    want = reference(dataset, **kw)
    same(got, want)
    return got


def test_is_a_torch_dataloader_with_torchs_signature() -> None:
    loader = shmloader.DataLoader(Range(4))
    assert isinstance(loader, tud.DataLoader)
    ours = inspect.signature(shmloader.DataLoader.__init__).parameters
    theirs = inspect.signature(tud.DataLoader.__init__).parameters
    for name, p in theirs.items():
        assert name in ours, name
        assert ours[name].default == p.default, name
        assert ours[name].kind == p.kind, name
    assert ours["slot_bytes"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize(
    "kw",
    [
        {"num_workers": -1},
        {"timeout": -1},
        {"prefetch_factor": 2},
        {"persistent_workers": True},
        {"num_workers": 2, "prefetch_factor": -1},
        {"num_workers": 2, "multiprocessing_context": "nope"},
        {"num_workers": 2, "multiprocessing_context": 3},
        {"multiprocessing_context": "fork"},
        {"batch_size": 2, "batch_sampler": [[0, 1]]},
        {"shuffle": True, "sampler": [0, 1]},
        {"batch_size": None, "drop_last": True},
    ],
)
def test_constructor_validation_matches_torch(kw: dict[str, Any]) -> None:
    with pytest.raises(Exception) as theirs:
        tud.DataLoader(Range(4), **kw)
    with pytest.raises(type(theirs.value)) as ours:
        shmloader.DataLoader(Range(4), **kw)
    assert str(ours.value) == str(theirs.value)


def test_slot_bytes_validation() -> None:
    with pytest.raises(ValueError, match="slot_bytes should be a positive int"):
        shmloader.DataLoader(Range(4), num_workers=1, slot_bytes=0)


def test_rich_nested_batches_equal_default_collate() -> None:
    check_equal(Rich(50), batch_size=8)


def test_num_workers_zero_is_torchs_loader() -> None:
    loader = shmloader.DataLoader(Rich(10), batch_size=3)
    # torch's own in-process iterator (a subclass that also says where it is, for state_dict())
    assert isinstance(iter(loader), torch.utils.data.dataloader._SingleProcessDataLoaderIter)
    same(list(loader), reference(Rich(10), batch_size=3))


def test_batch_size_none_converts_like_torch() -> None:
    check_equal(Rich(10), batch_size=None)


@pytest.mark.parametrize("workers", [1, 3])
def test_drop_last_and_len(workers: int) -> None:
    got = check_equal(Range(23), workers=workers, batch_size=5, drop_last=True)
    assert len(got) == len(shmloader.DataLoader(Range(23), batch_size=5, drop_last=True)) == 4


def test_shuffle_with_generator_gives_torchs_order() -> None:
    got = list(shmloader.DataLoader(Range(64), batch_size=4, shuffle=True, num_workers=2,
                                    generator=torch.Generator().manual_seed(7)))
    want = list(tud.DataLoader(Range(64), batch_size=4, shuffle=True, num_workers=2,
                               generator=torch.Generator().manual_seed(7)))
    same(got, want)


def test_sampler_and_variable_batch_sampler() -> None:
    check_equal(Range(20), sampler=[5, 3, 19, 0, 7], batch_size=2)
    sizes = [[0], [1, 2, 3], list(range(4, 20)), [3, 1]]
    check_equal(Range(20), batch_sampler=sizes, slot_bytes=1 << 16)


def test_variable_length_samples_within_slot() -> None:
    check_equal(Sized([1, 5, 2, 9, 3, 3, 0, 4]), batch_size=None)


def test_in_order_false_delivers_every_batch_exactly_once() -> None:
    got = list(shmloader.DataLoader(Range(97), batch_size=4, num_workers=3, in_order=False))
    values = sorted(int(v) for b in got for v in b.flatten())
    assert values == list(range(97))
    assert len(got) == 25


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_start_methods(context: str) -> None:
    check_equal(Range(30), workers=2, batch_size=4, multiprocessing_context=context)


def test_persistent_workers_survive_epochs_and_early_break() -> None:
    loader = shmloader.DataLoader(Range(40), batch_size=4, num_workers=2, persistent_workers=True,
                                  prefetch_factor=3)
    want = reference(Range(40), batch_size=4)
    same(list(loader), want)
    it = iter(loader)
    pids = [p.pid for p in it._life.pool.procs]
    segment = it.ring.segment
    for i, batch in enumerate(loader):
        if i == 2:
            break
    same(list(loader), want)
    again = iter(loader)
    assert again is it and [p.pid for p in it._life.pool.procs] == pids and it.ring.segment == segment
    del again, it
    loader._iterator._shutdown_workers()


def test_persistent_iterable_restarts_each_epoch() -> None:
    loader = shmloader.DataLoader(Shards(10), batch_size=3, num_workers=2, persistent_workers=True)
    first = [b.tolist() for b in loader]
    second = [b.tolist() for b in loader]
    assert first == second
    assert sorted(v for b in first for v in b) == list(range(10))
    loader._iterator._shutdown_workers()


def test_iterable_dataset_order_matches_torch() -> None:
    for kw in ({"batch_size": 3}, {"batch_size": 3, "drop_last": True}, {"batch_size": None}):
        got = [b.tolist() if isinstance(b, torch.Tensor) else b for b in
               shmloader.DataLoader(Shards(17), num_workers=2, **kw)]
        want = [b.tolist() if isinstance(b, torch.Tensor) else b for b in
                tud.DataLoader(Shards(17), num_workers=2, **kw)]
        assert got == want, kw


def test_worker_seeds_and_info_match_torch() -> None:
    got = list(shmloader.DataLoader(Seeds(), batch_size=2, num_workers=2,
                                    generator=torch.Generator().manual_seed(3)))
    want = list(tud.DataLoader(Seeds(), batch_size=2, num_workers=2,
                               generator=torch.Generator().manual_seed(3)))
    same(got, want)
    assert all(bool(b["same_info"].all()) for b in got)
    assert sorted({int(w) for b in got for w in b["worker"]}) == [0, 1]


def test_worker_init_fn_runs_in_each_worker() -> None:
    got = list(shmloader.DataLoader(InitMarker(), batch_size=1, num_workers=2, worker_init_fn=init_marker))
    assert sorted(b[0] for b in got) == ["init-0", "init-0", "init-1", "init-1"]


def test_empty_dataset() -> None:
    assert list(shmloader.DataLoader(Range(0), batch_size=4, num_workers=2)) == []
    assert list(shmloader.DataLoader(Shards(0), batch_size=4, num_workers=2)) == []


def test_pin_memory_without_accelerator_warns_like_torch() -> None:
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present")
    with pytest.warns(UserWarning, match="no accelerator is found"):
        got = list(shmloader.DataLoader(Range(6), batch_size=2, num_workers=1, pin_memory=True))
    same(got, reference(Range(6), batch_size=2))


def test_numpy_leaves_from_custom_collate_stay_numpy() -> None:
    def collate(samples: list[torch.Tensor]) -> dict[str, Any]:
        return {"np": np.stack([s.numpy() for s in samples]), "n": len(samples)}

    got = list(shmloader.DataLoader(Range(6), batch_size=3, num_workers=1, collate_fn=collate))
    assert [type(b["np"]) for b in got] == [np.ndarray, np.ndarray]
    assert got[1]["np"].ravel().tolist() == [3, 4, 5] and got[0]["n"] == 3


class IndexTypes(tud.Dataset):  # type: ignore[type-arg]
    """A batch is what ``__getitems__`` was given, spelled out: each index's type and value."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: Any) -> Any:
        raise AssertionError("__getitems__ is used")

    def __getitems__(self, index: Any) -> list[str]:
        return [f"{type(index).__name__}:{type(i).__name__}:{i!r}" for i in index]


@pytest.mark.parametrize("workers", [1, 2])
def test_the_dataset_gets_the_index_torch_gives_it(workers: int) -> None:
    # Lists of ints travel as int64 values, anything else pickled: each arrives as itself.
    batches = [[0, 1, 2], [7], [np.int64(3), 4], [True, 5], (6, 7), [2**40, -1], [], list(range(500)), [3.0]]
    want = list(tud.DataLoader(IndexTypes(), batch_sampler=batches, collate_fn=list, num_workers=workers))
    got = list(shmloader.DataLoader(IndexTypes(), batch_sampler=batches, collate_fn=list, num_workers=workers))
    assert got == want and got[2][0].startswith("list:int64:") and got[2][1] == "list:int:4"
    assert got[3][0] == "list:bool:True" and got[4][0] == "tuple:int:6"


class ManyIndexTypes(IndexTypes):
    def __len__(self) -> int:
        return 23


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("batch_size", [1, 5, 23, 64])
def test_a_sequential_sampler_gives_the_dataset_torchs_lists(batch_size: int, drop_last: bool) -> None:
    # torch's BatchSampler over its SequentialSampler: tasks carry ranges (no list is made in the
    # main process), and every batch, the first (sent to size the ring) too, is a list of ints.
    kw: dict[str, Any] = {"batch_size": batch_size, "drop_last": drop_last, "collate_fn": list}
    want = list(tud.DataLoader(ManyIndexTypes(), **kw))
    assert list(shmloader.DataLoader(ManyIndexTypes(), num_workers=2, **kw)) == want
    assert all(s.startswith("list:int:") for batch in want for s in batch)


class CountingSampler:
    """A batch sampler that counts the batches drawn from it: the tasks a loader dispatched."""

    def __init__(self, n: int, batch_size: int) -> None:
        self.inner = tud.BatchSampler(tud.SequentialSampler(range(n)), batch_size, drop_last=False)
        self.drawn = 0

    def __iter__(self) -> Any:
        for batch in self.inner:
            self.drawn += 1
            yield batch

    def __len__(self) -> int:
        return len(self.inner)


def ahead(make: Any, hold_previous: bool, prefetch_factor: int = 2) -> list[int]:
    """Batches drawn from the sampler beyond those handed out, after each of 12 next() calls,
    while the caller's step runs."""
    sampler = CountingSampler(400, 10)
    it = iter(make(Range(400), batch_sampler=sampler, num_workers=2, prefetch_factor=prefetch_factor))
    seen, batch = [], None
    for k in range(12):
        if not hold_previous:
            batch = None  # the step is done with the last batch before it asks for the next
        batch = next(it)
        seen.append(sampler.drawn - (k + 1))
    del batch, it
    return seen


@pytest.mark.parametrize("prefetch_factor", [1, 2, 3])
def test_tasks_prefetched_during_the_step_match_torch(prefetch_factor: int) -> None:
    # torch keeps num_workers * prefetch_factor indices dispatched while the caller's step runs.
    want = ahead(tud.DataLoader, False, prefetch_factor)
    assert want == [2 * prefetch_factor] * 12
    assert ahead(shmloader.DataLoader, False, prefetch_factor) == want
    # In `for batch in loader`, the loop variable still holds the previous batch (its slot)
    # while next() runs, so one task fewer is in flight until it is rebound (README).
    assert ahead(shmloader.DataLoader, True, prefetch_factor)[1:] == [2 * prefetch_factor - 1] * 11


def counted_lends(monkeypatch: Any) -> collections.Counter[str]:
    """What ``_native.lend_lone`` answered, from here on: "built" or "left" (to read_batch)."""
    calls: collections.Counter[str] = collections.Counter()
    lend_lone = _native.lend_lone

    def counted(slot: int, bases: dict[int, Any], lone: tuple[Any, ...]) -> Any:
        built = lend_lone(slot, bases, lone)
        calls["built" if built is not None else "left"] += 1
        return built

    monkeypatch.setattr(_native, "lend_lone", counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8, torch.bfloat16])
def test_one_tensor_batches_equal_torchs_whether_dropped_or_kept(dtype: torch.dtype, monkeypatch: Any) -> None:
    """The common batch, one tensor, is built and lent by one native call (``lend_lone``; bfloat16,
    which numpy lacks, by read_batch). Its batches equal torch's bit for bit and in order, over
    persistent epochs whose batches the loop drops (their slots come back) and one that keeps
    every batch (the ring's last slot then holds copies)."""
    calls = counted_lends(monkeypatch)
    dataset = Noise(203, (5, 7), dtype)
    want = list(tud.DataLoader(dataset, batch_size=8))
    loader = shmloader.DataLoader(dataset, batch_size=8, num_workers=2, persistent_workers=True)
    try:
        for _ in range(2):
            got = []
            for batch in loader:
                got.append(batch.clone())
                del batch
            same(got, want)
        same(list(loader), want)
    finally:
        loader._iterator._shutdown_workers()
    if dtype == torch.bfloat16:
        assert calls["built"] == 0 and calls["left"] > 0
    else:
        assert calls["built"] >= 2 * len(want)  # every dropped batch (the first of an epoch may come another way)


class _Pairs(tud.Dataset):  # type: ignore[type-arg]
    """(image, class) as torchvision's datasets return them: a tensor seeded by the index, an int."""

    def __len__(self) -> int:
        return 203

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.randint(0, 256, (3, 4, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)), i % 10


def test_pair_batches_equal_torchs_and_are_built_in_one_native_call(monkeypatch: Any) -> None:
    """(image, class) samples: torch's list of two tensors, bit for bit and in order, over
    persistent epochs; after the first batches (their skeleton learnt) each is built and lent by
    ``lend_lone``'s recipe, and made again in one step by its worker."""
    calls = counted_lends(monkeypatch)
    want = list(tud.DataLoader(_Pairs(), batch_size=8))
    loader = shmloader.DataLoader(_Pairs(), batch_size=8, num_workers=2, persistent_workers=True)
    try:
        for _ in range(2):
            got = [[t.clone() for t in batch] for batch in loader]
            assert all(type(b) is list for b in got)
            same(got, want)
    finally:
        loader._iterator._shutdown_workers()
    assert calls["built"] >= 2 * len(want) - 8  # (the first batch of each slot comes the general way)


def test_an_iterable_dataset_longer_than_its_len_warns_as_torchs_loader_does() -> None:
    """torch's warning, word for word, once per batch past ``len()``, at the caller's line."""

    class Longer(Shards):
        def __len__(self) -> int:
            return 4  # (torch compares it with the batches yielded: 6 of 2 samples)

    dataset = Longer(12)

    def warned(loader: Any) -> list[tuple[str, str]]:
        len(loader)  # (what makes torch's loader compare: _IterableDataset_len_called)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in loader:
                pass
        return [(str(w.message), w.filename) for w in caught if "Length of IterableDataset" in str(w.message)]

    theirs = warned(tud.DataLoader(dataset, batch_size=2, num_workers=2))
    ours = warned(shmloader.DataLoader(dataset, batch_size=2, num_workers=2))
    assert theirs and [m for m, _ in ours] == [m for m, _ in theirs]
    assert {f for _, f in ours} == {__file__}


def test_under_the_profiler_batches_and_snapshots_are_as_without_it() -> None:
    """With a profiler listening, ``next()`` runs in torch's record_function scope (named as
    torch names it), and the batches, and a state taken every n steps, are those of a run
    without it."""
    def run(profiled: bool) -> tuple[list[Any], Any, list[Any]]:
        loader = shmloader.DataLoader(Range(40), batch_size=2, num_workers=2, snapshot_every_n_steps=3)
        it = iter(loader)
        if profiled:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                got = [next(it) for _ in range(5)]
            names = {e.name for e in prof.events()}
            assert f"enumerate(DataLoader)#{type(it).__name__}.__next__" in names
        else:
            got = [next(it) for _ in range(5)]
        state = loader.state_dict()
        del it
        again = shmloader.DataLoader(Range(40), batch_size=2, num_workers=2, snapshot_every_n_steps=3)
        again.load_state_dict(state)
        # (torchdata's: the snapshot at step 3, two steps since)
        return got, (state["_snapshot"]["_snapshot_step"], state["_steps_since_snapshot"]), list(again)

    plain, profiled = run(False), run(True)
    same(profiled[0], plain[0])
    assert profiled[1] == plain[1] == (3, 2)
    same(profiled[2], plain[2])
