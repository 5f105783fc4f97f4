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
from tests.conftest import same
from tests.datasets import Failing, Gated, Range, Rich

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
    gate = multiprocessing.get_context("fork").Event()
    loader = shmloader.DataLoader(Gated(4, gate), batch_size=2, num_workers=1)
    ticks_before_first_batch: list[int] = []

    async def main() -> list[Any]:
        ticks = 0
        first_batch = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not first_batch.is_set():
                ticks += 1
                if ticks == 20:
                    gate.set()  # only now may the workers produce
                await asyncio.sleep(0.001)

        task = asyncio.create_task(ticker())
        out = []
        async for batch in loader:
            if not first_batch.is_set():
                ticks_before_first_batch.append(ticks)
                first_batch.set()
            out.append(batch)
        await task
        return out

    out = run(main())
    assert ticks_before_first_batch[0] >= 20
    assert [b.tolist() for b in out] == [[[0], [1]], [[2], [3]]]


def test_async_worker_error(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    with pytest.raises(ValueError, match="sample 5 is broken"):
        run(collect(shmloader.DataLoader(Failing(20, bad=5), batch_size=2, num_workers=2)))


def test_async_timeout(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    gate = multiprocessing.get_context("fork").Event()
    loader = shmloader.DataLoader(Gated(4, gate), batch_size=2, num_workers=1, timeout=0.2)
    with pytest.raises(RuntimeError, match="timed out after 0.2 seconds"):
        run(collect(loader))
