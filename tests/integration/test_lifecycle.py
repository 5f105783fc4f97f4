"""Slots: lent zero-copy, returned when dropped or released, copied when the user holds the ring;
errors: worker exceptions, oversize batches, timeouts, dead workers, a full /dev/shm."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import signal
import sys
from typing import Any

import pytest
import torch

import shmloader
from shmloader import _native
from shmloader.main import delivery as _delivery
from shmloader.main import wait as _wait
from shmloader.main.lease import slot_of
from shmloader.main.scheduler import SlotState
from shmloader.wire import ring as _ring
from shmloader.wire.layout import DONE
from tests.conftest import same
from tests.datasets import (
    Blocks,
    Failing,
    Gated,
    IndexPid,
    Pid,
    Range,
    Rich,
    Shards,
    Sized,
    Tokens,
    check_blocks,
    pad_collate,
)


def test_batches_are_views_of_the_ring_and_return_when_dropped() -> None:
    loader = shmloader.DataLoader(Range(64), batch_size=4, num_workers=2)
    it = iter(loader)
    a = next(it)
    ring = it.ring
    base = ring.bytes.__array_interface__["data"][0]
    ptr = a.untyped_storage().data_ptr()
    assert base <= ptr < base + ring.geometry.total_bytes
    assert it.held_count() == 1
    view = a[1:]  # a view keeps the slot too
    del a
    assert it.held_count() == 1
    del view
    assert it.held_count() == 0
    rest = [b.clone() for b in it]
    assert len(rest) == 15


def test_release_returns_a_slot_now() -> None:
    loader = shmloader.DataLoader(Range(64), batch_size=4, num_workers=2)
    it = iter(loader)
    batch = next(it)
    assert it.held_count() == 1
    assert loader.release({"x": [batch]}) == 1
    assert it.held_count() == 0
    with pytest.raises(ValueError, match=r"this batch was already released .*slot 0.*release a batch once"):
        loader.release(batch)
    assert loader.release(torch.zeros(3)) == 0  # not ours
    del batch, it


def test_a_second_release_never_takes_a_later_batchs_slot() -> None:
    # The slot of a released batch is lent again at once; releasing the old batch again must not
    # free it under the new holder (found by address, it would be).
    loader = shmloader.DataLoader(Blocks(256, words=64), batch_size=4, num_workers=2)
    it = iter(loader)
    first = next(it)
    assert loader.release(first) == 1
    for n in range(1, 6):  # until a batch arrives in first's slot (the fifth: 4 were in flight)
        later = next(it)
        if slot_of(it.ring, later) == 0:
            break
    assert slot_of(it.ring, later) == 0 and slot_of(it.ring, first) == 0
    for _ in range(2):
        with pytest.raises(ValueError, match="already released"):
            loader.release(first)
        with pytest.raises(ValueError, match="already released"):
            loader.release([first[1:], later])  # a view of it counts; nothing else in the call is released
    assert it.held_count() == 1
    check_blocks(later, 4 * n)
    rest = [next(it) for _ in range(8)]  # the workers write on: the held batch stays as it was
    for k, batch in enumerate([later, *rest]):
        check_blocks(batch, 4 * (n + k))
    del it


def test_release_from_another_thread_while_batches_are_lent() -> None:
    # A training thread keeps every other batch; another thread releases the rest, each twice.
    # Every second release is refused, and every kept batch is intact to the last word.
    import queue
    import threading

    loader = shmloader.DataLoader(Blocks(800, words=256), batch_size=4, num_workers=2, prefetch_factor=4)
    handed: queue.Queue[Any] = queue.Queue()
    lent: list[int] = []
    refused: list[int] = []

    def releaser() -> None:
        while (batch := handed.get()) is not None:
            if loader.release(batch) == 0:  # a copy (the ring was all held): nothing to release
                continue
            lent.append(1)
            try:
                loader.release(batch)
            except ValueError:
                refused.append(1)

    thread = threading.Thread(target=releaser)
    thread.start()
    kept = []
    try:
        for n, batch in enumerate(loader):
            check_blocks(batch, 4 * n)
            if n % 2:
                kept.append((4 * n, batch))
                del kept[:-3]  # the last three, their slots lent again and again around them
            else:
                handed.put(batch)
            del batch
            for first, old in kept:
                check_blocks(old, first)
    finally:
        handed.put(None)
        thread.join()
    assert n == 199 and len(refused) == len(lent) > 50


def test_release_finds_tensors_wherever_the_batch_holds_them() -> None:
    # Walked, not pickled: a lambda beside the tensor (unpicklable) used to hide it.
    import itertools
    import types

    loader = shmloader.DataLoader(Range(64), batch_size=4, num_workers=2)
    it = iter(loader)
    batches = [next(it) for _ in range(3)]
    assert it.held_count() == 3
    holder = types.SimpleNamespace(fn=lambda: 0, inner={"pair": (1, [batches[0]])})
    assert loader.release(holder) == 1
    assert loader.release({"set": {batches[1]}, "text": "x", "n": 3}) == 1
    with pytest.raises(TypeError, match=r"cannot look inside itertools.count at batch\['it'\].*pass those tensors"):
        loader.release({"it": itertools.count(), "x": batches[2]})
    assert it.held_count() == 1
    assert loader.release(batches[2]) == 1
    del batches, holder, it


@pytest.mark.parametrize("in_order", [True, False])
def test_holding_every_small_batch_never_deadlocks_and_the_rest_are_copied(in_order: bool) -> None:
    # A replay buffer of small batches: list(loader). The ring is never lent whole (the workers
    # need a slot); the batch that finds it held is copied out of its slot, and so is every one
    # after it (under COPY_HELD_UNDER, a copy costs less than memory of its own): the workers
    # go on writing into slots, which come back at once.
    from tests.integration.test_overflow import mapped_by_us

    loader = shmloader.DataLoader(Range(200), batch_size=2, num_workers=2, prefetch_factor=2, in_order=in_order)
    it = iter(loader)
    kept = [next(it) for _ in range(60)]
    want = [[[2 * i], [2 * i + 1]] for i in range(100)]
    assert [b.tolist() for b in kept] == want[:60] if in_order else set(map(str, (b.tolist() for b in kept))) <= set(map(str, want))
    slots = 2 * 2 + 1
    lent_most = slots - 2  # every worker keeps a slot to write into
    assert it.held_count() == lent_most
    stats = loader.stats()
    assert stats.copies == 60 - lent_most and stats.overflow_batches == 0 and stats.ring_growths == 0
    copied = [b for b in kept if slot_of(it.ring, b) is None]  # type: ignore[arg-type]
    assert len(copied) == 60 - lent_most
    maps = [(lo, hi) for lo, hi, name in _shared_maps() if name.startswith(("/dev/shm/", "/memfd:"))]
    assert maps  # (the ring is among them)
    for batch in copied:  # private memory: neither the ring nor a memfd of the loader's
        ptr = batch.untyped_storage().data_ptr()
        assert not any(lo <= ptr < hi for lo, hi in maps), batch
    assert not [k for k in mapped_by_us() if "overflow" in k]
    del copied, batch
    kept.clear()  # the user lets go of the ring: the rest of the epoch is lent from its slots again
    gc.collect()
    lent = []
    for b in it:
        kept.append(b.tolist())
        lent.append(slot_of(it.ring, b) is not None)  # type: ignore[arg-type]
    assert all(lent) and len(lent) == 40
    if in_order:
        assert kept == want[60:]
    assert loader.stats().copies == 60 - lent_most


@pytest.mark.parametrize("in_order", [True, False])
def test_holding_every_batch_of_a_mib_never_deadlocks_and_the_rest_come_in_memory_of_their_own(
        in_order: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # A replay buffer of batches of COPY_HELD_UNDER bytes and more (lowered here to the test's
    # small batches): the batch that finds the ring held is copied, and every one after it is
    # written into memory of its own (the overflow path): views of shared memory, as torch's
    # batches are, freed when dropped.
    from tests.integration.test_overflow import mapped_by_us

    monkeypatch.setattr(_delivery, "COPY_HELD_UNDER", 16)

    loader = shmloader.DataLoader(Range(200), batch_size=2, num_workers=2, prefetch_factor=2, in_order=in_order)
    it = iter(loader)
    kept = list(it)
    want = [[[2 * i], [2 * i + 1]] for i in range(100)]
    assert [b.tolist() for b in kept] == want if in_order else sorted(b.tolist() for b in kept) == want
    slots = 2 * 2 + 1  # num_workers * prefetch_factor, and one for the batch in hand
    lent_most = slots - 2  # every worker keeps a slot to write into
    assert it.held_count() == lent_most
    stats = loader.stats()
    copies = slots - lent_most  # the batch that found the ring held, and the one in flight beside it
    assert stats.copies == copies and stats.overflow_batches == 100 - lent_most - copies
    own = [b for b in kept if slot_of(it.ring, b) is None]  # type: ignore[arg-type]
    assert len(own) == 100 - lent_most
    maps = [(lo, hi, name) for lo, hi, name in _shared_maps()]
    for batch in own[copies:]:  # (the first ones are the copies)
        ptr = batch.untyped_storage().data_ptr()
        assert any(lo <= ptr < hi and name.startswith("/memfd:shmloader-overflow") for lo, hi, name in maps), batch
    del own, batch, kept
    gc.collect()
    assert not [k for k in mapped_by_us() if "overflow" in k]  # freed with the batches
    del it


class MiB(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Samples of exactly COPY_HELD_UNDER bytes (1 MiB of float32)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((_delivery.COPY_HELD_UNDER // 4,), float(i))


@pytest.mark.parametrize("prefetch_factor", [2, None])
@pytest.mark.parametrize("job", ["dynamic padding", "every leaf type"])
def test_a_replay_buffer_of_real_batches_equals_torchs(job: str, prefetch_factor: int | None) -> None:
    # A loop that keeps every batch of a shuffled epoch, on batches that are not fixed-size ready
    # tensors: padded tokens of varying length with masks and raw strings (some batches past
    # 64 KiB, copied into pages of their own, the others cloned), or every leaf default_collate
    # handles. Same batches, same order, same seeded shuffle as torch's loader.
    if job == "dynamic padding":
        dataset: Any = Tokens(320)
        kwargs: dict[str, Any] = {"batch_size": 32, "collate_fn": pad_collate}
    else:
        dataset, kwargs = Rich(120), {"batch_size": 4}

    want = list(torch.utils.data.DataLoader(dataset, shuffle=True, generator=torch.Generator().manual_seed(7),
                                            **kwargs))
    loader = shmloader.DataLoader(dataset, shuffle=True, generator=torch.Generator().manual_seed(7), num_workers=2,
                                  prefetch_factor=prefetch_factor, **kwargs)
    held = list(loader)
    same(held, want)
    stats = loader.stats()
    if prefetch_factor is not None:  # a ring of 5, which the loop holds early: (without it, the depth's ring)
        assert stats.copies >= 1, stats  # the copy path was taken (batches that outgrew a slot: overflow, growth)
        assert stats.copies + stats.overflow_batches + 3 * (1 + stats.ring_growths) >= len(want), stats
    del held, loader


def test_held_batches_of_a_mib_by_default_come_in_memory_of_their_own() -> None:
    loader = shmloader.DataLoader(MiB(), batch_size=1, num_workers=2, prefetch_factor=2)
    kept = list(loader)
    same(kept, list(torch.utils.data.DataLoader(MiB(), batch_size=1)))
    stats = loader.stats()
    # 3 lent (every worker keeps a slot), the one that found the ring held and the one in flight
    # beside it copied, then OWN
    assert stats.copies == 2 and stats.overflow_batches == 12 - 3 - 2
    del kept, loader


def _shared_maps() -> list[tuple[int, int, str]]:
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) >= 6:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, parts[5]))
    return out


def test_a_worker_exception_keeps_its_type_and_traceback_and_the_loader_goes_on() -> None:
    loader = shmloader.DataLoader(Failing(40, bad=13), batch_size=4, num_workers=2)
    it = iter(loader)
    with pytest.raises(ValueError) as info:
        for _ in it:
            pass
    text = str(info.value)
    assert "Caught ValueError in DataLoader worker process" in text
    assert "sample 13 is broken" in text and "Traceback" in text and "__getitem__" in text
    assert not it.shut_down  # as torch's: the next next() goes on with the following batch
    assert [b.flatten().tolist() for b in it] == [list(range(i, i + 4)) for i in range(16, 40, 4)]
    assert it.shut_down and all(p.exitcode is not None for p in it._life.pool.procs)


def test_a_worker_exception_in_the_first_batch() -> None:
    with pytest.raises(KeyError, match="sample 0 is broken"):
        list(shmloader.DataLoader(Failing(8, bad=0, exc=KeyError), batch_size=2, num_workers=2))


def test_collate_fn_exception() -> None:
    def collate(batch: list[torch.Tensor]) -> torch.Tensor:
        if int(batch[0]) == 4:
            raise ZeroDivisionError("bad batch")
        return torch.cat(batch)

    with pytest.raises(ZeroDivisionError, match="bad batch"):
        list(shmloader.DataLoader(Range(12), batch_size=2, num_workers=1, collate_fn=collate))


def test_worker_init_fn_exception() -> None:
    def init(worker_id: int) -> None:
        raise OSError(f"init {worker_id} failed")

    with pytest.raises(OSError, match="init 0 failed"):
        list(shmloader.DataLoader(Range(12), batch_size=2, num_workers=1, worker_init_fn=init))


def test_batches_larger_than_the_first_are_delivered_and_the_ring_grows() -> None:
    sizes = [1] * 8 + [100_000] * 8
    loader = shmloader.DataLoader(Sized(sizes), batch_size=4, num_workers=2)
    got = [b.clone() for b in loader]
    same(got, list(torch.utils.data.DataLoader(Sized(sizes), batch_size=4)))
    stats = loader.stats()
    assert stats.overflow_batches >= 1 and stats.ring_growths == 1


def test_slot_bytes_is_a_hint_not_a_limit() -> None:
    got = list(shmloader.DataLoader(Sized([5000] * 4), batch_size=2, num_workers=1, slot_bytes=4096))
    same(got, list(torch.utils.data.DataLoader(Sized([5000] * 4), batch_size=2)))


def test_timeout() -> None:
    import multiprocessing

    gate = multiprocessing.get_context("fork").Event()
    loader = shmloader.DataLoader(Gated(4, gate), batch_size=2, num_workers=1, timeout=0.3)
    with pytest.raises(RuntimeError, match=r"DataLoader timed out after 0.3 seconds"):
        list(loader)


@pytest.mark.parametrize("workers", [1, 2])
def test_after_a_timeout_the_iterator_goes_on_as_torchs_does(workers: int) -> None:
    # The same sequence through both loaders: next() times out while the dataset stalls, the
    # dataset moves on, and the rest of the epoch comes from the same iterator.
    import multiprocessing

    def after_a_timeout(cls: Any) -> tuple[str, list[list[int]]]:
        gate = multiprocessing.get_context("fork").Event()
        it = iter(cls(Gated(6, gate), batch_size=2, num_workers=workers, timeout=0.3))
        with pytest.raises(RuntimeError) as raised:
            next(it)
        gate.set()
        rest = [b.flatten().tolist() for b in it]
        del it
        return str(raised.value), rest

    assert after_a_timeout(shmloader.DataLoader) == after_a_timeout(torch.utils.data.DataLoader)


def test_a_killed_worker_is_replaced_and_its_batches_still_arrive_once_in_order() -> None:
    loader = shmloader.DataLoader(IndexPid(), batch_size=1, num_workers=2)
    it = iter(loader)
    index, killed = next(it)[0].tolist()
    assert index == 0
    os.kill(killed, signal.SIGKILL)
    rest = [b[0].tolist() for b in it]
    assert [i for i, _ in rest] == list(range(1, 16))  # every batch once, in order
    makers = [pid for _, pid in rest]
    # When it was killed, batches 1 to 4 were in flight (num_workers * prefetch_factor): it may
    # have finished its two (2 and 4) first, and made none after them.
    assert killed not in makers[4:]
    assert len(set(makers) - {killed}) == 2  # the other worker, and the replacement that made the rest of its share
    assert loader.stats().worker_restarts == 1


def test_past_max_worker_restarts_the_error_names_pid_signal_and_task() -> None:
    loader = shmloader.DataLoader(Pid(), batch_size=1, num_workers=2, max_worker_restarts=0)
    it = iter(loader)
    pid = int(next(it)[0])
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(shmloader.WorkerDiedError, match=rf"worker \d \(pid {pid}\) was killed by signal SIGKILL( while producing batch \d+ \(index \[\d+\]\))?; 0 of max_worker_restarts=0"):
        for _ in it:
            pass


def test_iterable_workers_are_not_replaced() -> None:
    from tests.datasets import PidStream

    it = iter(shmloader.DataLoader(PidStream(), batch_size=1, num_workers=2))
    pid = int(next(it)[0])
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(shmloader.WorkerDiedError, match="IterableDataset worker cannot be replaced"):
        for _ in it:
            pass


def test_garbage_collected_mid_epoch_stops_workers() -> None:
    loader = shmloader.DataLoader(Range(100), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    procs = list(it._life.pool.procs)
    del it
    gc.collect()
    assert all(p.exitcode is not None for p in procs)


def test_many_epochs_leave_nothing_behind() -> None:
    loader = shmloader.DataLoader(Range(10), batch_size=3, num_workers=2)
    for _ in range(5):
        same(list(loader), list(torch.utils.data.DataLoader(Range(10), batch_size=3)))


def test_slot_bytes_need_not_be_a_page_multiple() -> None:
    got = list(shmloader.DataLoader(Range(9), batch_size=2, num_workers=2, slot_bytes=5000))
    same(got, list(torch.utils.data.DataLoader(Range(9), batch_size=2)))


def test_an_error_larger_than_its_slot_arrives_trimmed() -> None:
    loader = shmloader.DataLoader(Failing(8, bad=2, exc=LookupError), batch_size=1, num_workers=1,
                                  slot_bytes=4096, collate_fn=_explode_collate)
    with pytest.raises(LookupError, match="characters of the traceback cut so that the error fits its ring slot"):
        list(loader)


def _explode_collate(batch: list[torch.Tensor]) -> torch.Tensor:
    raise LookupError("x" * 100_000)


def test_a_worker_error_comes_after_the_batches_before_it() -> None:
    got = []
    with pytest.raises(ValueError, match="sample 13 is broken"):
        for batch in shmloader.DataLoader(Failing(40, bad=13), batch_size=4, num_workers=2):
            got.append(batch.flatten().tolist())
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_idle_workers_keep_running_under_every_start_method(
    context: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Workers check for a dead loader whenever they are idle; check every millisecond so
    # that they surely do, and under forkserver (whose workers are not our children) too.
    monkeypatch.setattr(shmloader.main.iterator, "PARENT_CHECK_S", 0.001)
    loader = shmloader.DataLoader(Range(60), batch_size=2, num_workers=2, multiprocessing_context=context)
    same(list(loader), list(torch.utils.data.DataLoader(Range(60), batch_size=2)))


def test_parent_watch() -> None:
    import multiprocessing

    from shmloader.worker.loop import ParentWatch

    assert ParentWatch(os.getpid()).alive()
    child = multiprocessing.get_context("fork").Process(target=os.getpid)
    child.start()
    watch = ParentWatch(child.pid)  # type: ignore[arg-type]
    child.join()
    assert not watch.alive()


def exit_zero(worker_id: int) -> None:
    sys.exit(0)


def interrupt(worker_id: int) -> None:
    raise KeyboardInterrupt


def stop_iteration(worker_id: int) -> None:
    raise StopIteration("no shard for this worker")


def hard_exit(worker_id: int) -> None:
    os._exit(3)


class ExitsAt5(Range):
    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 5:
            sys.exit(7)
        return super().__getitem__(i)


@pytest.mark.parametrize("init, error, message", [
    (exit_zero, RuntimeError, r"worker_init_fn raised SystemExit\(0\) \(sys.exit\?\) in worker \d: a DataLoader worker "
                              r"cannot exit on its own"),
    (interrupt, RuntimeError, r"worker_init_fn raised KeyboardInterrupt"),
    (stop_iteration, RuntimeError, r"worker_init_fn raised StopIteration in worker \d: a DataLoader worker's set-up "
                                   r"cannot end an epoch"),
    (hard_exit, shmloader.WorkerDiedError, r"exited with code 3 on its own \(sys.exit, os._exit or SystemExit"),
])
def test_a_worker_init_fn_that_exits_is_said_as_such(init: Any, error: type[BaseException], message: str) -> None:
    loader = shmloader.DataLoader(Range(16), batch_size=2, num_workers=2, worker_init_fn=init, max_worker_restarts=0)
    with pytest.raises(error, match=message):
        list(loader)


def test_a_dataset_that_exits_is_said_as_such_without_the_memory_hint() -> None:
    loader = shmloader.DataLoader(ExitsAt5(16), batch_size=2, num_workers=2, max_worker_restarts=0)
    with pytest.raises(shmloader.WorkerDiedError, match=r"exited with code 7 on its own .* while producing batch 2") as e:
        list(loader)
    assert "ran out of memory" not in str(e.value)


@pytest.fixture
def timed_out(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The sync waits on the wake semaphore that run out, with the heartbeat at 20 s."""
    monkeypatch.setattr(_wait, "CHECK_S", 20.0)
    out: list[float] = []
    sleep_awaited = _ring._Views.sleep_awaited

    def counted(self: Any, timeout: float) -> bool:
        got = sleep_awaited(self, timeout)
        if timeout > 0 and not got:
            out.append(timeout)
        return got

    monkeypatch.setattr(_ring._Views, "sleep_awaited", counted)
    return out


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("iterable", [False, True])
def test_no_wait_ends_by_its_timeout(timed_out: list[float], persistent: bool, iterable: bool) -> None:
    # A sync next() that sleeps on the wake semaphore wakes when its batch is published; its
    # timeout (CHECK_S) is only a heartbeat for dead workers. A wait that ran out in a healthy
    # epoch (its start, its end, a partial last batch, an exhausted shard, an epoch broken
    # off) would mean the consumer slept for nothing to come. With the heartbeat at 20 s,
    # count the waits that ran out: none.
    dataset = Shards(203) if iterable else Range(203)
    kw: dict[str, Any] = dict(batch_size=4, num_workers=2, persistent_workers=persistent)
    want = [b.tolist() for b in torch.utils.data.DataLoader(dataset, **kw)]
    loader = shmloader.DataLoader(dataset, **kw)
    for epoch in range(3):
        if epoch == 1:
            it = iter(loader)
            assert next(it).tolist() == want[0]
            del it  # broken off after one batch
        assert [b.tolist() for b in loader] == want
    assert timed_out == []


@pytest.mark.parametrize("persistent", [False, True])
def test_no_wait_ends_by_its_timeout_while_batches_overflow(timed_out: list[float], persistent: bool) -> None:
    # Dynamic padding whose batches outgrow the ring (long texts, the ring sized from a small
    # first batch): workers ask the consumer for overflow memory while it sleeps for an earlier
    # batch, and the ring grows. A request wakes it whatever batch it named; none of its waits
    # may run out.
    kw: dict[str, Any] = dict(batch_size=4, num_workers=2, collate_fn=pad_collate, persistent_workers=persistent)
    dataset = Tokens(96, first_small=8, big_every=7)
    want = list(torch.utils.data.DataLoader(dataset, **kw))
    loader = shmloader.DataLoader(dataset, **kw)
    for _ in range(2):
        got = list(loader)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            same(a, b)
        del got
    assert timed_out == []


def every_task_published(it: Any) -> None:
    """Return once every task in flight is published (a condition on the ring, not a sleep), so
    the consumer's next round finds all of them at once."""
    ring, sched = it.ring, it._sched
    while any(sched.state_of(s) == SlotState.IN_FLIGHT and _native.load_acquire(ring.mm, ring.state_offsets[s]) != DONE
              for s in sched.tasks()):
        os.sched_yield()


@pytest.mark.parametrize("in_order", [False, True])
def test_the_round_that_takes_the_last_shards_end_ends_the_epoch(timed_out: list[float], in_order: bool) -> None:
    # The shards run out; the round that takes the last live worker's end of shard takes every
    # task still dispatched with it (all published). Nothing is in flight then, and only a
    # dispatch finds that no worker is left: the round must do it, not sleep for nothing.
    kw: dict[str, Any] = dict(batch_size=4, num_workers=2)
    want = sorted(b.tolist() for b in torch.utils.data.DataLoader(Shards(90), **kw))
    it = iter(shmloader.DataLoader(Shards(90), in_order=in_order, **kw))
    got = []
    while True:
        if it.ring is not None:
            every_task_published(it)
        try:
            got.append(next(it).tolist())
        except StopIteration:
            break
    assert sorted(got) == want and timed_out == []


def test_async_for_ends_the_epoch_when_the_last_shard_ends() -> None:
    # The same round under async for, whose wait has no heartbeat: it would never end.
    async def run() -> list[Any]:
        it = aiter(shmloader.DataLoader(Shards(90), batch_size=4, num_workers=2))
        got = []
        while True:
            if it.ring is not None:
                every_task_published(it)
            try:
                got.append((await asyncio.wait_for(anext(it), 60)).tolist())  # a guard: it hung
            except StopAsyncIteration:
                return got

    want = [b.tolist() for b in torch.utils.data.DataLoader(Shards(90), batch_size=4, num_workers=2)]
    assert asyncio.run(run()) == want


def test_shutdown_after_its_connections_were_finalized() -> None:
    # Collected in a reference cycle, the iterator's finalizer may run after those of its
    # pipes to the workers, which close their fds but keep their handles: stopping the
    # workers must not fail on those (EBADF), and must still stop them.
    loader = shmloader.DataLoader(Range(40), batch_size=4, num_workers=2, persistent_workers=True)
    it = iter(loader)
    assert next(it).flatten().tolist() == [0, 1, 2, 3]
    for conn in it._life.pool.conns:
        conn.__del__()  # what the garbage collector may run first
    it._shutdown_workers()
    assert not [c for c in multiprocessing.active_children() if c.name.startswith("shmloader-worker")]
