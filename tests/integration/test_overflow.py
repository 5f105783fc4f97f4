"""Batches of any size: jobs whose batches vary (dynamic padding, detection boxes, raw
strings, a small first batch) give torch's batches, bit for bit and in order, over several
epochs; oversized batches arrive zero-copy through overflow memory; the ring grows; a
memory budget is never exceeded; killed workers lose nothing."""

from __future__ import annotations

import asyncio
import gc
import os
import pickle
import random
import signal
from typing import Any, Callable

import pytest
import torch
import torch.utils.data as tud
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmloader
from tests.conftest import drain, examples, raw, same
from tests.datasets import Detection, Planned, Sized, SizedDicts, Tokens, pad_collate, zip_collate

JOBS: dict[str, Callable[[], dict[str, Any]]] = {
    # dynamic padding with the raw strings; the first batches are the shortest
    "padding": lambda: dict(dataset=Tokens(96, first_small=8), batch_size=8, collate_fn=pad_collate),
    # detection: k in [0, 50] boxes per image, torchvision's zip collate
    "detection": lambda: dict(dataset=Detection(96), batch_size=8, collate_fn=zip_collate),
    # the padding collate's raw strings, every 7th of them 100 KB: the skeleton overflows
    "strings": lambda: dict(dataset=Tokens(96, big_every=7), batch_size=4, collate_fn=pad_collate),
    # a bucketing batch_sampler (equal sizes within a batch) whose first batch is the smallest
    "first_small": lambda: dict(dataset=Sized([1] * 2 + [n for i in range(16) for n in [random.Random(i).randint(2, 30_000)] * 6]),
                                batch_sampler=[[0, 1]] + [list(range(i, i + 6)) for i in range(2, 98, 6)]),
    # default collate of dicts whose leaves are written in two orders: stacked first, then pickled
    "dicts": lambda: dict(dataset=SizedDicts([1] * 2 + [n for i in range(16) for n in [random.Random(i).randint(2, 30_000)] * 6]),
                          batch_sampler=[[0, 1]] + [list(range(i, i + 6)) for i in range(2, 98, 6)]),
}


def torch_epochs(job: dict[str, Any], epochs: int, **kw: Any) -> list[list[Any]]:
    loader = tud.DataLoader(**job, **kw)
    return [list(loader) for _ in range(epochs)]


def canonical(batch: Any) -> bytes:
    """A batch as bytes (types, dtypes, shapes and contents), to compare unordered epochs."""
    def plain(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("tensor", str(x.dtype), tuple(x.shape), raw(x))
        if isinstance(x, dict):
            return ("dict", [(k, plain(v)) for k, v in x.items()])
        if isinstance(x, (list, tuple)):
            return (type(x).__name__, [plain(v) for v in x])
        return x
    return pickle.dumps(plain(batch))


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("name", list(JOBS))
def test_varying_batches_equal_torch(name: str, persistent: bool, in_order: bool) -> None:
    job = JOBS[name]()
    generator = torch.Generator().manual_seed(7) if "batch_sampler" not in job else None
    shuffle = {"shuffle": True} if generator is not None else {}
    # torch with the same workers: a persistent loader draws its base seed from the generator once
    want = torch_epochs(job, 3, generator=torch.Generator().manual_seed(7) if generator else None, num_workers=2,
                        persistent_workers=persistent, **shuffle)
    loader = shmloader.DataLoader(**job, num_workers=2, persistent_workers=persistent, in_order=in_order,
                                  generator=generator, **shuffle)
    for epoch in range(3):
        got = list(loader)
        if in_order:
            same(got, want[epoch])
        else:
            assert sorted(map(canonical, got)) == sorted(map(canonical, want[epoch]))
    stats = loader.stats()
    assert stats.overflow_batches >= 1, "the job should exercise the overflow path"
    assert stats.ring_growths >= 1


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("name", ["padding", "strings"])
def test_varying_batches_equal_torch_under_spawn(name: str, persistent: bool) -> None:
    job = JOBS[name]()
    want = torch_epochs(job, 2)
    loader = shmloader.DataLoader(**job, num_workers=2, persistent_workers=persistent, multiprocessing_context="spawn")
    for epoch in range(2):
        same(list(loader), want[epoch])
    assert loader.stats().overflow_batches >= 1


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("name", list(JOBS))
def test_varying_batches_equal_torch_async(name: str, loop: str) -> None:
    if loop == "uvloop" and name != "padding":
        pytest.skip("one job is enough to cover uvloop")
    job = JOBS[name]()
    want = torch_epochs(job, 2)
    loader = shmloader.DataLoader(**job, num_workers=2, persistent_workers=True)

    async def consume() -> list[list[Any]]:
        return [await drain(loader) for _ in range(2)]  # (no async comprehension inside a comprehension: 3.10)

    got = asyncio.run(consume()) if loop == "asyncio" else uvloop.run(consume())
    same(got, want)
    assert loader.stats().overflow_batches >= 1


def mapped_by_us() -> dict[str, int]:
    """Bytes of every distinct shared mapping of ours in this process: the ring segments and
    overflow memory (by inode, each counted once, at its largest extent)."""
    sizes: dict[str, int] = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) < 6 or "shmloader" not in parts[5] or not parts[5].startswith(("/dev/shm/", "/memfd:")):
                continue  # (not shared memory: the extension's own file lies under shmloader/)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            key = f"{parts[3]}:{parts[4]}:{parts[5]}"
            sizes[key] = max(sizes.get(key, 0), int(parts[2], 16) + end - start)
    return sizes


def test_overflow_batches_are_views_of_shared_memory_not_copies() -> None:
    sizes = [10] * 4 + [50_000] * 4
    loader = shmloader.DataLoader(Sized(sizes), batch_size=2, num_workers=1, prefetch_factor=2)
    it = iter(loader)
    small = [next(it), next(it)]
    big = next(it)  # 400 KB into an 8 KiB-ish slot: overflow
    assert loader.stats().overflow_batches == 1
    ptr = big.untyped_storage().data_ptr()
    with open("/proc/self/maps") as maps:
        where = [line.split()[-2] for line in maps
                 if int(line.split("-")[0], 16) <= ptr < int(line.split()[0].split("-")[1], 16)]
    assert where == ["/memfd:shmloader-overflow"], where  # "(deleted)" follows: it never had a name
    same([*small, big, *list(it)], list(tud.DataLoader(Sized(sizes), batch_size=2)))


def test_memory_budget_covers_ring_and_overflow_and_never_deadlocks() -> None:
    # Batches of up to 400 KB in random order; the budget leaves room for about two large ones
    # beside the ring, so oversized batches wait for room (and the ring cannot grow).
    rng = random.Random(3)
    sizes = [8] * 4 + [n for _ in range(49) for n in [rng.randint(1, 25_000)] * 4]
    budget = 1_200_000
    loader = shmloader.DataLoader(Sized(sizes), batch_size=4, num_workers=2, prefetch_factor=2,
                                  memory_budget=budget)
    want = list(tud.DataLoader(Sized(sizes), batch_size=4))
    peak = 0
    for i, batch in enumerate(loader):
        peak = max(peak, sum(mapped_by_us().values()))
        same(batch, want[i])
    assert i == len(want) - 1
    assert 0 < peak <= budget, peak
    assert loader.stats().overflow_batches > 10


def test_one_batch_larger_than_the_budget_allows_is_a_clear_error() -> None:
    loader = shmloader.DataLoader(Sized([10] * 4 + [400_000] * 4), batch_size=2, num_workers=1,
                                  memory_budget=1_000_000)
    with pytest.raises(shmloader.MemoryBudgetError, match=r"batch 2 needs 3,20\d,\d+ bytes, more than memory_budget=1,000,000 leaves beside the ring .* Raise memory_budget to at least"):
        list(loader)


@pytest.mark.parametrize("in_order", [True, False])
def test_holding_every_oversized_batch_under_a_budget_gives_copies_not_a_hang(in_order: bool) -> None:
    sizes = [1] * 2 + [30_000] * 30
    loader = shmloader.DataLoader(Sized(sizes), batch_size=2, num_workers=2, memory_budget=700_000,
                                  in_order=in_order)
    held = []
    peak = 0
    for batch in loader:  # a replay buffer: nothing is ever dropped
        held.append(batch)
        peak = max(peak, sum(mapped_by_us().values()))
    want = list(tud.DataLoader(Sized(sizes), batch_size=2))
    if in_order:
        same(held, want)
    else:
        assert sorted(map(canonical, held)) == sorted(map(canonical, want))
    assert peak <= 700_000
    assert loader.stats().copies >= 10  # all but the batches that fit the budget


def test_an_index_larger_than_its_slot_travels_too() -> None:
    # 4096 samples of one byte: the batch fits a page, its pickled index does not.
    class Bytes(tud.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 8192

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.tensor(i % 251, dtype=torch.uint8)

    sampler = [list(range(0, 4096)), list(range(4096, 8192)), list(range(8192 - 3, 8192))]
    got = list(shmloader.DataLoader(Bytes(), batch_sampler=sampler[::-1], num_workers=2))
    same(got, list(tud.DataLoader(Bytes(), batch_sampler=sampler[::-1])))
    # The same from a sequential sampler, whose tasks carry ranges: the list goes over the pipe
    got = list(shmloader.DataLoader(Bytes(), batch_size=4096, num_workers=2))
    same(got, list(tud.DataLoader(Bytes(), batch_size=4096)))


@pytest.fixture
def rng() -> random.Random:
    seed = random.randrange(2**32)
    print(f"random kill schedule seed: {seed}")  # shown on failure, to rerun the same schedule
    return random.Random(seed)


@pytest.mark.parametrize("budget", [None, 1_500_000])
def test_random_kills_with_overflow_in_flight(rng: random.Random, budget: int | None) -> None:
    # Sizes vary 1..200 KB per batch; under the budget the ring cannot grow, so oversized
    # batches (and workers waiting for their memory) are in flight all epoch.
    sizes = [4] * 4 + [n for i in range(99) for n in [random.Random(i).randint(1, 12_500)] * 4]
    want = list(tud.DataLoader(Sized(sizes), batch_size=4))
    loader = shmloader.DataLoader(Sized(sizes), batch_size=4, num_workers=2, prefetch_factor=3,
                                  max_worker_restarts=100, memory_budget=budget)
    it = iter(loader)
    kills = 0
    n = 0
    for n, batch in enumerate(it, 1):
        same(batch, want[n - 1])
        if rng.random() < 0.1:
            victim = rng.choice([p for p in it._life.pool.procs if p.exitcode is None])
            os.kill(victim.pid, signal.SIGKILL)
            kills += 1
    assert n == len(want)
    assert loader.stats().overflow_batches >= 1
    assert loader.stats().worker_restarts <= kills


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["holding", "waiting"])
def test_loader_killed_with_overflow_memory_out_leaves_nothing(tmp_path: Any, moment: str) -> None:
    from tests.integration.test_failures import child, kill_and_check_nothing_is_left

    # "holding": the loader holds overflow batches; "waiting": a worker also waits for memory
    # that the budget cannot grant while the loader holds them.
    proc = child(tmp_path, """
        budget = None if sys.argv[1] == "holding" else 800_000
        loader = shmloader.DataLoader(Sized([1] * 4 + [20_000] * 28), batch_size=4, num_workers=2,
                                      memory_budget=budget)
        it = iter(loader)
        held = [next(it) for _ in range(3)]
        assert loader.stats().overflow_batches >= 1
        print(json.dumps([p.pid for p in it._life.pool.procs]), flush=True)
        signal.pause()
    """, moment)
    kill_and_check_nothing_is_left(proc)


batch_plans = st.lists(
    st.tuples(st.integers(1, 6), st.integers(0, 20_000), st.sampled_from([0, 10, 30_000]),
              st.sampled_from([torch.uint8, torch.int64, torch.float32, torch.bool])),
    min_size=1, max_size=10,
)


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=batch_plans, in_order=st.booleans())
def test_property_random_batch_sizes_equal_torch(plan: list[tuple[int, int, int, torch.dtype]], in_order: bool) -> None:
    dataset = Planned(plan)
    want = list(tud.DataLoader(dataset, batch_sampler=dataset.batches))
    got = list(shmloader.DataLoader(dataset, batch_sampler=dataset.batches, num_workers=2, in_order=in_order))
    if in_order:
        same(got, want)
    else:
        assert sorted(map(canonical, got)) == sorted(map(canonical, want))


# Every batch but the first overflows; the budget holds about three of them beside the ring and
# cannot hold a grown ring.
OVERFLOWING = [1] * 4 + [20_000] * 60


def _break_off(loader: Any, want: list[Any]) -> None:
    """One epoch of ``loader``, checked against torch's batches, broken off after its 4th."""
    for i, batch in enumerate(loader):
        same(batch, want[i])
        if i == 3:
            break


def test_breaking_off_epochs_returns_their_overflow_memory_to_the_budget() -> None:
    # Batches granted, then dropped by a new epoch, must give their memory back, or the later
    # epochs would run out of budget.
    loader = shmloader.DataLoader(Sized(OVERFLOWING), batch_size=4, num_workers=2, persistent_workers=True,
                                  memory_budget=1_100_000)
    want = list(tud.DataLoader(Sized(OVERFLOWING), batch_size=4))
    for _ in range(6):
        _break_off(loader, want)
    same([b.clone() for b in loader], want)
    assert loader.stats().ring_growths == 0 and loader.stats().copies == 0


def test_an_epoch_broken_off_with_memory_granted_leaves_none_counted() -> None:
    # Tasks hold overflow memory granted and not yet delivered when a broken-off epoch stops its
    # workers (in most epochs: when the next batch's request came before the break): once its
    # batches are gone too, the loader counts no memory (memory_budget would otherwise shrink
    # with each such epoch).
    loader = shmloader.DataLoader(Sized(OVERFLOWING), batch_size=4, num_workers=2, memory_budget=1_100_000)
    want = list(tud.DataLoader(Sized(OVERFLOWING), batch_size=4))
    for _ in range(8):
        _break_off(loader, want)  # (its batches die with the helper's frame)
        gc.collect()
        assert loader._shm_memory.in_use == 0, (loader._shm_memory.rings, loader._shm_memory.overflow)


@pytest.mark.timeout(60)
def test_a_worker_dead_unseen_when_the_ring_grows_is_replaced_on_the_new_ring() -> None:
    # Liveness is checked before the consumer sleeps, so a worker can be dead, unseen, when
    # the ring grows at the start of an epoch. Its replacement must attach to the new ring
    # and the epoch go on: not WorkerDiedError (a message sent to it), not a wait for it to
    # attach (a replacement on the new ring never reads the old ring's resize task).
    sizes = [4] * 64
    want = list(tud.DataLoader(Sized(sizes), batch_size=4))
    loader = shmloader.DataLoader(Sized(sizes), batch_size=4, num_workers=2, persistent_workers=True)
    it = iter(loader)
    for batch, expected in zip(it, want, strict=True):
        same(batch, expected)
    victim = it._life.pool.procs[0]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join()
    it._broker.grow_to = 2 * it.ring.geometry.data_bytes  # what a batch too large for its slot asks for
    for batch, expected in zip(loader, want, strict=True):
        same(batch, expected)
    assert loader.stats().ring_growths == 1 and loader.stats().worker_restarts == 1
    it._shutdown_workers()
