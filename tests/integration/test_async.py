"""async for: same batches as sync, on asyncio and uvloop, without blocking the loop."""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch
import uvloop

import shmloader
from tests.conftest import drain, same
from tests.datasets import Failing, Gated, MidBatch, Range, Rich

RUNNERS: dict[str, Callable[[Coroutine[Any, Any, Any]], Any]] = {
    "asyncio": asyncio.run,
    "uvloop": uvloop.run,
}


@pytest.fixture(params=sorted(RUNNERS))
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, Any]], Any]:
    return RUNNERS[request.param]


async def collect(loader: Any) -> list[Any]:
    return [batch async for batch in loader]


def test_async_equals_sync(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    loader = shmloader.DataLoader(Rich(40), batch_size=6, num_workers=2)
    same(run(collect(loader)), list(torch.utils.data.DataLoader(Rich(40), batch_size=6)))


def test_async_persistent_epochs_and_num_workers_zero(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    want = list(torch.utils.data.DataLoader(Range(20), batch_size=3))
    loader = shmloader.DataLoader(Range(20), batch_size=3, num_workers=2, persistent_workers=True)

    async def two_epochs() -> tuple[list[Any], list[Any]]:
        return await collect(loader), await collect(loader)

    first, second = run(two_epochs())
    same(first, want)
    same(second, want)
    loader._iterator._shutdown_workers()
    same(run(collect(shmloader.DataLoader(Range(20), batch_size=3))), want)


def test_the_loop_keeps_serving_other_tasks_while_the_loader_waits(
    run: Callable[[Coroutine[Any, Any, Any]], Any],
) -> None:
    # The worker is provably inside a batch (it set `started` and waits for the gate); only
    # the event loop opens the gate, after 20 ticks. A consumer that blocked the loop while
    # waiting would leave the gate shut: the worker's wait times out and says so in the batch.
    ctx = multiprocessing.get_context("fork")
    started, gate = ctx.Event(), ctx.Event()
    loader = shmloader.DataLoader(MidBatch(4, started, gate), batch_size=2, num_workers=1)

    async def main() -> tuple[list[Any], int]:
        ticks_mid_batch = 0

        async def ticker() -> None:
            nonlocal ticks_mid_batch
            while not started.is_set():
                await asyncio.sleep(0.001)
            while ticks_mid_batch < 20:  # a worker is inside __getitem__, waiting for the gate
                ticks_mid_batch += 1
                await asyncio.sleep(0.001)
            gate.set()

        task = asyncio.create_task(ticker())
        out = [batch async for batch in loader]
        await task
        return out, ticks_mid_batch

    out, ticks = run(main())
    assert ticks == 20
    assert [b.tolist() for b in out] == [[[0, 1], [1, 1]], [[2, 1], [3, 1]]]  # the gate opened mid-batch


def test_async_worker_error(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    with pytest.raises(ValueError, match="sample 5 is broken"):
        run(collect(shmloader.DataLoader(Failing(20, bad=5), batch_size=2, num_workers=2)))


def test_async_timeout(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    gate = multiprocessing.get_context("fork").Event()
    loader = shmloader.DataLoader(Gated(4, gate), batch_size=2, num_workers=1, timeout=0.2)

    async def timed_out_then_on() -> list[Any]:
        it = aiter(loader)
        with pytest.raises(RuntimeError, match="timed out after 0.2 seconds"):
            await anext(it)
        gate.set()  # as torch's, the iterator goes on: the next anext waits for the same batch
        return [batch async for batch in it]

    got = run(timed_out_then_on())
    same(got, list(torch.utils.data.DataLoader(Gated(4, gate), batch_size=2)))


async def cancelled_run(loader: Any, cancel_at: Callable[[int], bool]) -> tuple[list[Any], list[tuple[Any, ...]]]:
    """The epoch of ``async for`` whose ``n``-th wait (from 1) is cancelled where ``cancel_at(n)``:
    the wait is started, then cancelled as a timeout around ``anext`` would cancel it (or, done
    already, the task is cancelled as it resumes), and the loop goes on with the next ``anext``.
    Returns the batches and the requests of the cancelled waits."""
    it = aiter(loader)
    waiter = it._waiter
    wait = waiter.wait
    calls = 0
    cancelled: list[tuple[Any, ...]] = []

    async def wait_or_cancelled(request: tuple[Any, ...], check: Any, deadline: Any) -> None:
        nonlocal calls
        calls += 1
        if not cancel_at(calls):
            return await wait(request, check, deadline)
        cancelled.append(request)
        inner = asyncio.ensure_future(wait(request, check, deadline))
        await asyncio.sleep(0)  # it registers its readers and waits
        inner.cancel()
        try:
            await inner
        except asyncio.CancelledError:
            pass
        raise asyncio.CancelledError

    waiter.wait = wait_or_cancelled
    out = []
    while True:
        try:
            out.append(await anext(it))
        except asyncio.CancelledError:
            continue
        except StopAsyncIteration:
            return out, cancelled


def cancel_job() -> dict[str, Any]:
    return dict(dataset=Rich(24), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))


def test_a_cancelled_anext_loses_nothing_at_any_wait_of_start_up_or_steady_state(
        run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    want = list(torch.utils.data.DataLoader(**cancel_job()))
    kinds = set()
    k = 1
    while True:  # the k-th wait of the epoch cancelled, for every k the epoch has
        got, cancelled = run(cancelled_run(shmloader.DataLoader(**cancel_job(), num_workers=2), lambda n: n == k))
        same(got, want)
        if not cancelled:
            break
        kinds.add(cancelled[0].kind)
        k += 1
    assert {"conns", "ready"} <= kinds, kinds  # start-up's waits (probe, attach) and steady state's
    got, cancelled = run(cancelled_run(shmloader.DataLoader(**cancel_job(), num_workers=2), lambda n: n % 2 == 1))
    same(got, want)  # every other wait cancelled
    assert cancelled


@pytest.mark.parametrize("cut", ["timeout", "cancel"])
def test_a_start_cut_short_then_a_new_epoch_of_persistent_workers_is_whole(
        run: Callable[[Coroutine[Any, Any, Any]], Any], cut: str) -> None:
    # The first epoch's probe is still being made when a timeout (or a cancel) cuts its start
    # short; the user begins the next epoch. Its answer, for the epoch left, must not pass for
    # the new epoch's first batch.
    gate = multiprocessing.get_context("fork").Event()
    loader = shmloader.DataLoader(Gated(8, gate), batch_size=2, num_workers=2, persistent_workers=True,
                                  timeout=0.3 if cut == "timeout" else 0)

    async def cut_then_epochs() -> list[list[Any]]:
        it = aiter(loader)
        if cut == "timeout":
            with pytest.raises(RuntimeError, match="timed out after 0.3 seconds"):
                await anext(it)
        else:
            waited = asyncio.ensure_future(anext(it))
            await asyncio.sleep(0)  # it runs to its first wait: the probe sent, its answer awaited
            waited.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waited
        gate.set()
        return [await drain(loader) for _ in range(2)]  # (no async comprehension inside a comprehension: 3.10)

    epochs = run(cut_then_epochs())
    want = list(torch.utils.data.DataLoader(Gated(8, gate), batch_size=2))
    for got in epochs:
        same(got, want)
    loader._iterator._shutdown_workers()


def test_a_sync_start_timed_out_then_a_new_epoch_of_persistent_workers_is_whole() -> None:
    gate = multiprocessing.get_context("fork").Event()
    loader = shmloader.DataLoader(Gated(8, gate), batch_size=2, num_workers=2, persistent_workers=True, timeout=0.3)
    with pytest.raises(RuntimeError, match="timed out after 0.3 seconds"):
        next(iter(loader))
    gate.set()
    want = list(torch.utils.data.DataLoader(Gated(8, gate), batch_size=2))
    for _ in range(2):
        same(list(loader), want)
    loader._iterator._shutdown_workers()
