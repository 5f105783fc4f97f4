"""torch's error semantics, measured against torch's DataLoader on the same jobs: a batch's
exception is raised for that batch and the next ``next()`` goes on with the following one
(a loop that catches errors loses no data); what makes going on impossible ends the
loader, and every later ``next()`` says why."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import pickle
import re
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.utils.data as tud

import shmloader
from tests.datasets import BadBatches, BadSamples, BadStream, Tokens, pad_collate

BAD = (3, 17, 18, 40, 63)  # 17 and 18 fall in one batch of 4


def said(exc: BaseException) -> tuple[str, str, str]:
    lines = str(exc).splitlines()
    return type(exc).__name__, lines[0], lines[-1]


def outcomes(loader: Any, epochs: int = 1, batch: Callable[[Any], Any] = lambda b: b.flatten().tolist(),
             error: Callable[[BaseException], Any] = said) -> list[list[tuple[str, Any]]]:
    """Per epoch, every ``next()`` in order: ("batch", ``batch`` of what it returned) or ("error",
    ``error`` of what it raised); by default the batch's values, and the error's type, first
    line and last line."""
    out = []
    for _ in range(epochs):
        it = iter(loader)
        epoch: list[tuple[str, Any]] = []
        while True:
            try:
                got = next(it)
            except StopIteration:
                break
            except Exception as exc:
                epoch.append(("error", error(exc)))
                # torch's ExceptionWrapper.reraise() leaves a cycle through its frame up to the
                # iterator; broken here, torch's iterator stops when it is dropped, not in the
                # next gc pass (where its persistent spawn workers take 10 s to be joined)
                exc.__traceback__ = None
            else:
                epoch.append(("batch", batch(got)))
        out.append(epoch)
    return out


async def async_outcomes(loader: Any) -> list[tuple[str, Any]]:
    it = aiter(loader)
    epoch: list[tuple[str, Any]] = []
    while True:
        try:
            batch = await anext(it)
        except StopAsyncIteration:
            return epoch
        except Exception as exc:
            lines = str(exc).splitlines()
            epoch.append(("error", (type(exc).__name__, lines[0], lines[-1])))
        else:
            epoch.append(("batch", batch.flatten().tolist()))


def unordered(epochs: list[list[tuple[str, Any]]]) -> list[list[str]]:
    """Each epoch as a multiset. With in_order=False torch sends a task to whichever worker has
    room, so which worker raised depends on timing (in torch too): that number is left out."""
    return [sorted(re.sub(r"worker process \d+", "worker process N", repr(o)) for o in epoch) for epoch in epochs]


def job(shuffle: bool, **kw: Any) -> dict[str, Any]:
    return dict(dataset=BadSamples(80, BAD), batch_size=4, shuffle=shuffle,
                generator=torch.Generator().manual_seed(5) if shuffle else None, **kw)


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("shuffle", [False, True])
def test_caught_errors_lose_no_batch_like_torch(shuffle: bool, in_order: bool, workers: int, persistent: bool) -> None:
    kw = dict(num_workers=workers, persistent_workers=persistent, in_order=in_order)
    want = outcomes(tud.DataLoader(**job(shuffle, **kw)), epochs=2)
    got = outcomes(shmloader.DataLoader(**job(shuffle, **kw)), epochs=2)
    assert sum(kind == "error" for kind, _ in want[0]) == 4 and len(want[0]) == 20
    if in_order:
        assert got == want
    else:
        assert unordered(got) == unordered(want)


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True])
def test_caught_errors_lose_no_batch_under_spawn(persistent: bool) -> None:
    kw = dict(num_workers=2, persistent_workers=persistent, multiprocessing_context="spawn")
    assert outcomes(shmloader.DataLoader(**job(True, **kw))) == outcomes(tud.DataLoader(**job(True, **kw)))


@pytest.mark.parametrize("in_order", [True, False])
def test_caught_errors_lose_no_batch_async(in_order: bool) -> None:
    kw = dict(num_workers=2, in_order=in_order)
    want = outcomes(tud.DataLoader(**job(True, **kw)))
    got = [asyncio.run(async_outcomes(shmloader.DataLoader(**job(True, **kw))))]
    assert (got if in_order else unordered(got)) == (want if in_order else unordered(want))


def test_an_error_in_the_first_batch_then_the_rest() -> None:
    kw = dict(num_workers=2)
    loader = shmloader.DataLoader(BadSamples(12, (0,)), batch_size=2, **kw)
    assert outcomes(loader) == outcomes(tud.DataLoader(BadSamples(12, (0,)), batch_size=2, **kw))


STOPS = (5, 22)  # samples that raise StopIteration: batches 1 and 5 of 10


def loops(loader: Any, count: int) -> list[list[list[int]]]:
    """What ``count`` for loops over one iterator see: a worker's StopIteration ends a loop there
    (torch's loader raises it from next()), and the next loop goes on after it."""
    it = iter(loader)
    return [[b.flatten().tolist() for b in it] for _ in range(count)]


async def async_loops(loader: Any, count: int) -> list[list[list[int]]]:
    it = aiter(loader)
    out = []
    for _ in range(count):
        out.append([b.flatten().tolist() async for b in it])
    return out


@pytest.mark.parametrize("path", ["steady", "timeout", "unordered", "async"])
@pytest.mark.parametrize("workers", [1, 2])
def test_a_datasets_stopiteration_ends_the_loop_like_torch(path: str, workers: int) -> None:
    kw: dict[str, Any] = dict(batch_size=4, num_workers=workers, in_order=path != "unordered",
                              timeout=30 if path == "timeout" else 0)
    want = loops(tud.DataLoader(BadSamples(40, STOPS, StopIteration), **kw), 4)
    shm = shmloader.DataLoader(BadSamples(40, STOPS, StopIteration), **kw)
    got = asyncio.run(async_loops(shm, 4)) if path == "async" else loops(shm, 4)
    if path == "unordered":  # where a loop ends depends on timing, in torch too
        everything = sorted(b for loop in want for b in loop)
        assert len(everything) == 8 and sorted(b for loop in got for b in loop) == everything
        assert got[-1] == want[-1] == []
    else:
        assert [len(loop) for loop in want] == [1, 3, 4, 0]
        assert got == want


def stop_at_8(batch: list[torch.Tensor]) -> torch.Tensor:
    if int(batch[0]) == 8:
        raise StopIteration("no batch of 8")
    return torch.cat(batch)


def test_a_collate_fns_stopiteration_ends_the_loop_like_torch() -> None:
    kw: dict[str, Any] = dict(batch_size=4, num_workers=2, collate_fn=stop_at_8)
    want = loops(tud.DataLoader(BadSamples(20, ()), **kw), 3)
    assert [len(loop) for loop in want] == [2, 2, 0]
    assert loops(shmloader.DataLoader(BadSamples(20, ()), **kw), 3) == want


def pad_or_stop(batch: list[tuple[torch.Tensor, str]]) -> dict[str, Any]:
    if any(int(t[0]) == 37 for t, _ in batch):
        raise StopIteration("sample 37's batch")
    return pad_collate(batch)


@pytest.mark.parametrize("persistent", [False, True])
def test_a_stopiteration_in_a_dynamic_padding_job_ends_the_loop_like_torch(persistent: bool) -> None:
    # variable-size dict batches (the general read path) around the batch that stops, shuffled
    def loops_of(make: Any) -> list[list[tuple[list[list[int]], list[int]]]]:
        loader = make(Tokens(96), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(11),
                      num_workers=2, persistent_workers=persistent, collate_fn=pad_or_stop)
        it = iter(loader)
        return [[(b["input_ids"].tolist(), [len(t) for t in b["text"]]) for b in it] for _ in range(3)]

    want = loops_of(tud.DataLoader)
    assert len(want[0]) + len(want[1]) == 11 and want[2] == []
    assert loops_of(shmloader.DataLoader) == want


def test_a_datasets_stopiteration_says_what_torchs_says() -> None:
    kw: dict[str, Any] = dict(batch_size=4, num_workers=2)
    said_by = []
    for make in (tud.DataLoader, shmloader.DataLoader):
        it = iter(make(BadSamples(40, STOPS, StopIteration), **kw))
        next(it)
        with pytest.raises(StopIteration) as stop:
            next(it)
        said_by.append(said(stop.value))
        assert next(it).flatten().tolist() == [8, 9, 10, 11]  # and goes on
        stop.value.__traceback__ = None
        del it
    assert said_by[1] == said_by[0]
    assert said_by[0][:2] == ("StopIteration", "Caught StopIteration in DataLoader worker process 1.")


def test_a_collate_error_is_one_batch_too() -> None:
    def collate(batch: list[torch.Tensor]) -> torch.Tensor:
        if int(batch[0]) == 8:
            raise KeyError("no collate for 8")
        return torch.cat(batch)

    kw: dict[str, Any] = dict(batch_size=4, num_workers=2, collate_fn=collate)
    assert outcomes(shmloader.DataLoader(BadSamples(20, ()), **kw)) == outcomes(tud.DataLoader(BadSamples(20, ()), **kw))


def test_checkpoint_after_a_caught_error_resumes_exactly() -> None:
    def make() -> shmloader.DataLoader:
        return shmloader.DataLoader(**job(True, num_workers=2))

    whole = outcomes(make())[0]
    loader = make()
    it = iter(loader)
    seen: list[tuple[str, Any]] = []
    while len(seen) < 8:  # past the first error (batch of sample 3) and a few more
        try:
            seen.append(("batch", next(it).flatten().tolist()))
        except ValueError as exc:
            lines = str(exc).splitlines()
            seen.append(("error", (type(exc).__name__, lines[0], lines[-1])))
    assert any(kind == "error" for kind, _ in seen)
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    del it
    resumed = make()
    resumed.load_state_dict(state)
    assert seen + outcomes(resumed)[0] == whole


class FailingInit:
    """worker_init_fn that fails in the workers given (a shard list it cannot open)."""

    def __init__(self, failing: tuple[int, ...]) -> None:
        self.failing = failing

    def __call__(self, worker_id: int) -> None:
        if worker_id in self.failing:
            raise ValueError(f"cannot open shard list for worker {worker_id}")


def outcomes_of(it: Any, calls: int = 30) -> list[Any]:
    """What a loop that catches errors and goes on sees: batches, error types, END."""
    out: list[Any] = []
    for _ in range(calls):
        try:
            out.append(next(it).tolist())
        except StopIteration:
            out.append("END")
            break
        except Exception as exc:
            out.append(type(exc).__name__)
    return out


@pytest.mark.parametrize("failing", [(1,), (0,), (0, 1, 2)], ids=["worker 1", "worker 0 (the probe's)", "all"])
@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("persistent", [False, True], ids=["", "persistent"])
def test_a_failing_worker_init_fn_fails_that_worker_s_batches_and_the_epoch_ends_as_torch_s(
        failing: tuple[int, ...], workers: int, persistent: bool) -> None:
    def make(cls: Any) -> Any:
        return cls(torch.arange(16.0), batch_size=2, num_workers=workers, worker_init_fn=FailingInit(failing),
                   persistent_workers=persistent)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's: more workers than this machine's suggested maximum)
        theirs_loader, ours_loader = make(torch.utils.data.DataLoader), make(shmloader.DataLoader)
        epochs = []
        for _ in range(2 if persistent else 1):  # (persistent: the next epoch's workers are the same)
            # torch raises the init error once, then an UnboundLocalError of its own for that worker's batches
            theirs = ["ValueError" if o == "UnboundLocalError" else o for o in outcomes_of(iter(theirs_loader))]
            assert outcomes_of(iter(ours_loader)) == theirs
            epochs.append(theirs)
    if persistent:
        ours_loader._iterator._shutdown_workers()
        theirs_loader._iterator._shutdown_workers()
    assert epochs[0][-1] == "END" and epochs[0].count("ValueError") == sum(b % workers in failing for b in range(8))
    assert all(e == [[2.0 * b, 2.0 * b + 1] for b in range(8)] + ["END"] for e in epochs[1:])  # (torch's workers
    # run their later epochs: a persistent worker whose init failed makes its batches from then on)


class Shard(torch.utils.data.IterableDataset[int]):
    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        return iter(range(info.id * 100, info.id * 100 + 4))


def test_an_iterable_dataset_s_failed_worker_raises_once_then_its_shard_ends() -> None:
    it = iter(shmloader.DataLoader(Shard(), batch_size=2, num_workers=2, worker_init_fn=FailingInit((1,))))
    # torch's raises, then UnboundLocalError without end: its failed shard never ends
    assert outcomes_of(it) == [[0, 1], "ValueError", [2, 3], "END"]


def test_a_death_beyond_max_worker_restarts_ends_the_epoch_with_a_reason() -> None:
    import os
    import signal

    loader = shmloader.DataLoader(BadSamples(400, ()), batch_size=2, num_workers=2, max_worker_restarts=0)
    it = iter(loader)
    next(it)
    os.kill(it._life.pool.procs[0].pid, signal.SIGKILL)  # type: ignore[attr-defined]
    with pytest.raises(shmloader.WorkerDiedError):
        for _ in it:
            pass
    with pytest.raises(RuntimeError, match="stopped after an earlier error \\(WorkerDiedError"):
        next(it)


@pytest.mark.parametrize("workers", [1, 2])
def test_an_iterable_datasets_error_like_torch(workers: int) -> None:
    kw: dict[str, Any] = dict(batch_size=3, num_workers=workers)
    want = outcomes(tud.DataLoader(BadStream(40, (7, 30)), **kw), epochs=2)
    # a generator that raised is over: its worker's shard ends there (one error per worker)
    assert [kind for kind, _ in want[0]].count("error") == workers
    assert outcomes(shmloader.DataLoader(BadStream(40, (7, 30)), **kw), epochs=2) == want


def test_a_getitems_error_like_torch() -> None:
    kw: dict[str, Any] = dict(batch_size=4, num_workers=2)
    want = outcomes(tud.DataLoader(BadBatches(40, (5, 22)), **kw))
    assert [kind for kind, _ in want[0]].count("error") == 2
    assert outcomes(shmloader.DataLoader(BadBatches(40, (5, 22)), **kw)) == want


@pytest.mark.parametrize("bad", [0, 9])  # the first batch (the probe) and a later one
def test_an_unpicklable_exception_arrives_as_text_naming_its_type(bad: int) -> None:
    from tests.datasets import RaisesUnpicklable

    got = outcomes(shmloader.DataLoader(RaisesUnpicklable(20, bad), batch_size=2, num_workers=2))[0]
    errors = [detail for kind, detail in got if kind == "error"]
    assert len(errors) == 1 and len(got) == 10  # and the other nine batches arrive
    name, first, last = errors[0]
    assert name == "RuntimeError" and first.startswith("Caught RuntimeError (raised as tests.datasets.")
    assert first.endswith("DiskOnFire, which cannot be pickled) in DataLoader worker process 0.")
    assert last.endswith(f"DiskOnFire: sample {bad}: disk on fire")


@pytest.mark.parametrize("persistent", [False, True])
def test_a_caught_batch_error_does_not_keep_the_loader_alive(persistent: bool) -> None:
    # torch's ExceptionWrapper.reraise() leaves the exception it raised in its own frame, a
    # reference cycle through the traceback and every frame up to the iterator: caught and
    # dropped, the error would still keep the iterator, its workers and its ring until the
    # garbage collector ran. Dropping the loader stops its workers at once.
    gc.disable()
    try:
        loader = shmloader.DataLoader(BadSamples(24, (5,)), batch_size=4, num_workers=2, persistent_workers=persistent)
        assert [kind for kind, _ in outcomes(loader)[0]] == ["batch", "error"] + ["batch"] * 4
        del loader
        assert not [c for c in multiprocessing.active_children() if c.name.startswith("shmloader-worker")]
    finally:
        gc.enable()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # torch's refused iterator's __del__
def test_a_prefetch_factor_torch_refuses_is_refused_not_waited_on() -> None:
    # torch's loader takes 0 (a negative one it refuses when built), and its iterator refuses it;
    # a ring given no task would wait forever
    said_by = []
    for make in (tud.DataLoader, shmloader.DataLoader):
        loader = make(BadSamples(8, ()), batch_size=2, num_workers=2, prefetch_factor=0)
        with pytest.raises(AssertionError) as refused:
            iter(loader)
        said_by.append(str(refused.value))
        with pytest.raises(ValueError, match="prefetch_factor option should be non-negative"):
            make(BadSamples(8, ()), batch_size=2, num_workers=2, prefetch_factor=-1)
    assert said_by[1] == said_by[0] == "prefetch_factor must be greater than 0 for MultiProcessingDataLoaderIter"
    with pytest.raises(AssertionError, match="prefetch_factor must be greater than 0"):
        aiter(shmloader.DataLoader(BadSamples(8, ()), batch_size=2, num_workers=2, prefetch_factor=0))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # torch's refused iterator's __del__
def test_a_generator_that_is_not_one_is_a_type_error_like_torchs() -> None:
    for make in (tud.DataLoader, shmloader.DataLoader):
        loader = make(BadSamples(8, ()), batch_size=2, shuffle=True, num_workers=2, generator=3)
        with pytest.raises(TypeError):
            next(iter(loader))
    with pytest.raises(TypeError, match="generator must be a torch.Generator or None, not int"):
        next(iter(shmloader.DataLoader(BadSamples(8, ()), batch_size=2, shuffle=True, num_workers=2, generator=3)))
