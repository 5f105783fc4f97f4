"""Workers killed at random points (mid-write included), under every start method: every
batch still arrives exactly once, in order, with its own contents; nothing is left in
/dev/shm (there are no named semaphores to leave)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from typing import Any, Callable

import pytest

import shmloader
from tests.datasets import Blocks, check_blocks


@pytest.fixture
def rng() -> random.Random:
    seed = random.randrange(2**32)
    print(f"random kill schedule seed: {seed}")  # shown on failure, to rerun the same schedule
    return random.Random(seed)


def kill_one(it: shmloader.main.iterator.RingIterator, rng: random.Random,
             signals: tuple[signal.Signals, ...] = (signal.SIGKILL, signal.SIGTERM)) -> bool:
    """Kill a live worker; False when none is alive: the loader replaces dead workers when it
    must wait, so batches already made can still come after every worker was killed.
    SIGSEGV only where the worker does not inherit pytest's faulthandler (its dump would
    fill the log): spawn and forkserver workers."""
    alive = [p for p in it._life.pool.procs if p.exitcode is None]
    if not alive:
        return False
    os.kill(rng.choice(alive).pid, rng.choice(signals))
    return True


def consume_blocks(loader: shmloader.DataLoader, after: Callable[[int, Any], None], mode: str) -> int:
    """Iterate a Blocks loader with ``for`` or ``async for``, checking every word of every batch;
    ``after(n, iterator)`` runs after the n-th batch. Returns the number of batches."""
    async def consume() -> int:
        n = 0
        it = aiter(loader)
        async for batch in it:
            check_blocks(batch, 8 * n)
            n += 1
            after(n, it)
        return n

    if mode == "async":
        return asyncio.run(consume())
    n = 0
    it = iter(loader)
    for n, batch in enumerate(it, 1):
        check_blocks(batch, 8 * (n - 1))
        after(n, it)
    return n


def test_random_kills_sync(rng: random.Random) -> None:
    loader = shmloader.DataLoader(Blocks(2400), batch_size=8, num_workers=2, prefetch_factor=3,
                                  max_worker_restarts=100)
    it = iter(loader)
    kills = 0
    for i, batch in enumerate(it):
        check_blocks(batch, 8 * i)
        if rng.random() < 0.08 and kill_one(it, rng):  # about every 12 batches, whatever the workers do
            kills += 1
    assert i == 299
    assert 5 < loader.stats().worker_restarts <= kills  # a kill may land after the last batch


def test_random_kills_async(rng: random.Random) -> None:
    loader = shmloader.DataLoader(Blocks(800), batch_size=8, num_workers=2, max_worker_restarts=100)

    def after(n: int, it: shmloader.main.iterator.RingIterator) -> None:
        if n % 10 == 5:
            kill_one(it, rng)

    assert consume_blocks(loader, after, "async") == 100
    assert 5 < loader.stats().worker_restarts <= 10


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_kills_are_recovered_under_spawn_and_forkserver(rng: random.Random, context: str, mode: str) -> None:
    # A replacement maps the ring through the segment's fd (its name is gone) and finds the
    # semaphores inside it. Each start costs seconds here, so three kills per run.
    loader = shmloader.DataLoader(Blocks(480), batch_size=8, num_workers=2, max_worker_restarts=10,
                                  multiprocessing_context=context)
    kill_at = sorted(rng.sample(range(3, 55), 3))

    def after(n: int, it: shmloader.main.iterator.RingIterator) -> None:
        if n in kill_at:
            kill_one(it, rng, (signal.SIGKILL, signal.SIGSEGV))

    assert consume_blocks(loader, after, mode) == 60
    assert 1 <= loader.stats().worker_restarts <= 3


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_an_iterable_dataset_with_state_resumes_its_shard_after_a_kill(rng: random.Random, context: str) -> None:
    # A replacement resumes its shard from the state after the last batch its predecessor
    # made that is kept: the epoch is torch's, exactly once and in order.
    import torch.utils.data as tud

    from tests.conftest import same
    from tests.datasets import StatefulShards

    want = [list(tud.DataLoader(StatefulShards(300), batch_size=4, num_workers=2)) for _ in range(2)]
    loader = shmloader.DataLoader(StatefulShards(300), batch_size=4, num_workers=2, persistent_workers=True,
                                  max_worker_restarts=20, multiprocessing_context=context)
    kills = 0
    for epoch in range(2):
        got = []
        it = iter(loader)
        for n, batch in enumerate(it, 1):
            got.append(batch)
            if n % 13 == 0 and kills < 4 and kill_one(it, rng, (signal.SIGKILL,)):  # type: ignore[arg-type]
                kills += 1
        same(got, want[epoch])
    assert 1 <= loader.stats().worker_restarts <= kills


def test_an_iterable_dataset_without_state_says_how_to_make_it_replaceable() -> None:
    from tests.datasets import Shards

    loader = shmloader.DataLoader(Shards(400), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    os.kill(it._life.pool.procs[0].pid, signal.SIGKILL)  # type: ignore[attr-defined]
    with pytest.raises(shmloader.WorkerDiedError, match="give the dataset state_dict\\(\\) and load_state_dict\\(\\)"):
        for _ in it:
            pass


def test_a_worker_killed_mid_epoch_is_replaced_said_once_and_counted_and_the_epoch_is_torch_s() -> None:
    import sys
    import warnings

    import torch

    data = torch.arange(96.0).view(48, 2)
    want = [b.clone() for b in torch.utils.data.DataLoader(data, batch_size=4)]
    loader = shmloader.DataLoader(data, batch_size=4, num_workers=2)
    it = iter(loader)
    got = [next(it).clone()]
    victim = it._life.pool.procs[1]
    os.kill(victim.pid, signal.SIGKILL)  # as the OOM killer sends it
    victim.join()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got += [b.clone() for b in it]; line = sys._getframe().f_lineno  # noqa: E702
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))
    said = [w for w in caught if "replaced" in str(w.message)]
    assert len(said) == 1 and said[0].category is shmloader.WorkerReplacedWarning
    assert (said[0].filename, said[0].lineno) == (__file__, line)
    message = str(said[0].message)
    assert message.startswith(f"DataLoader worker 1 (pid {victim.pid}) was killed by signal SIGKILL while producing batch ")
    assert message.endswith("; replaced (1 of max_worker_restarts=3): its batches are made again, in order. If it ran "
                            "out of memory, lower batch_size, num_workers or prefetch_factor.")
    assert shmloader.stats(loader).worker_restarts == 1


def test_a_death_past_the_restarts_names_its_batch_s_index_whole_or_how_much_is_left_out() -> None:
    from shmloader.main.dispatch import index_text

    assert index_text([3, 4, 5]) == "[3, 4, 5]"
    long = list(range(100_000, 100_100))
    text = index_text(long)
    shown = text.removeprefix("[").split(", ... and ")[0].split(", ")
    assert shown == [str(i) for i in long[:len(shown)]] and len(shown) >= 20 and len(text) <= 200
    assert text.endswith(f", ... and {100 - len(shown)} more: 100 in all]")
    assert len(index_text(["y" * 300, "z"])) == 200 and index_text(["y" * 300, "z"]).endswith(" ... (2 items, 309 characters)")


def test_a_replacement_warning_made_an_error_is_raised_once_and_the_loop_goes_on() -> None:
    import warnings

    import torch

    data = torch.arange(96.0).view(48, 2)
    want = [b.clone() for b in torch.utils.data.DataLoader(data, batch_size=4)]
    it = iter(shmloader.DataLoader(data, batch_size=4, num_workers=2))
    got, raised = [next(it).clone()], 0
    victim = it._life.pool.procs[0]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join()
    with warnings.catch_warnings():
        warnings.simplefilter("error", shmloader.WorkerReplacedWarning)  # (as -W error makes it)
        while True:
            try:
                got.append(next(it).clone())
            except shmloader.WorkerReplacedWarning:
                raised += 1
            except StopIteration:
                break
    assert raised == 1 and len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))
