"""Workers killed at random points (mid-write included): every batch still arrives exactly
once, in order, with its own contents."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest

import shmloader
from tests.datasets import Blocks, check_blocks


@pytest.fixture
def rng() -> random.Random:
    seed = random.randrange(2**32)
    print(f"random kill schedule seed: {seed}")  # shown on failure, to rerun the same schedule
    return random.Random(seed)


def kill_one(it: shmloader._consume.RingIterator, rng: random.Random) -> None:
    victim = rng.choice([p for p in it._pool.procs if p.exitcode is None])
    os.kill(victim.pid, rng.choice([signal.SIGKILL, signal.SIGSEGV, signal.SIGTERM]))


def test_random_kills_sync(rng: random.Random) -> None:
    loader = shmloader.DataLoader(Blocks(2400), batch_size=8, num_workers=2, prefetch_factor=3,
                                  max_worker_restarts=100)
    it = iter(loader)
    kills = 0
    for i, batch in enumerate(it):
        check_blocks(batch, 8 * i)
        if rng.random() < 0.08:  # about every 12 batches, at whatever the workers are doing
            kill_one(it, rng)
            kills += 1
    assert i == 299
    assert 5 < loader.stats().worker_restarts <= kills  # a kill may land after the last batch


def test_random_kills_async(rng: random.Random) -> None:
    loader = shmloader.DataLoader(Blocks(800), batch_size=8, num_workers=2, max_worker_restarts=100)

    async def consume() -> int:
        n = 0
        it = aiter(loader)
        async for batch in it:
            check_blocks(batch, 8 * n)
            n += 1
            if n % 10 == 5:
                kill_one(it, rng)  # type: ignore[arg-type]
        return n

    assert asyncio.run(consume()) == 100
    assert 5 < loader.stats().worker_restarts <= 10
