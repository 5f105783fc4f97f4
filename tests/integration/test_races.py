"""Interleavings that once lost a batch, hung, leaked a segment or raised the wrong error, each
forced where it can be: by a hook in the worker (a fork child runs the test's code), a fake
that raises at the moment in question, or state set behind the iterator's back."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from torch.utils.data import Dataset

import shmloader
from shmloader import _native
from shmloader._errors import ShmLoaderError
from shmloader.main import iterator as _consume
from shmloader.main import lifecycle as _lifecycle
from shmloader.main import pool as _pool
from shmloader.main import wait as _wait
from shmloader.wire import ring as _ring
from shmloader.wire.layout import DONE, Field
from shmloader.wire.messages import Attached
from tests.conftest import same
from tests.datasets import Sized
from tests.fakes import FakeStream, fake_device

FORK = multiprocessing.get_context("fork")


# ------------------------------------------------------------------ the doorbell
def test_the_doorbell_is_never_written_after_it_is_closed() -> None:
    # room_freed rings it from whatever thread drops an overflow batch; shutdown closes it. A
    # write after the close could land on a descriptor opened since under the same number.
    bell = _ring.Doorbell()
    number = bell.fd
    bell.close()
    reused = os.eventfd(0, os.EFD_NONBLOCK)  # the lowest free number: the bell's, in practice
    try:
        bell.ring()
        bell.close()  # idempotent
        if reused == number:
            with pytest.raises(BlockingIOError):
                os.eventfd_read(reused)  # nothing was written to the descriptor that took its number
    finally:
        os.close(reused)


def test_closing_the_doorbell_waits_for_a_ring_in_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    # The interleaving forced: a ring is inside its write when close is called from another
    # thread. The write goes to the open bell, and the close happens after it.
    import threading

    bell = _ring.Doorbell()
    order: list[str] = []
    real_write = os.eventfd_write
    closer = threading.Thread(target=lambda: (bell.close(), order.append("closed")))

    def write(fd: int, value: int) -> None:
        closer.start()  # close() now runs in another thread, while this write is under way
        closer.join(timeout=0.5)  # (it cannot finish: the bell's lock is held)
        real_write(fd, value)
        order.append("written")

    monkeypatch.setattr(os, "eventfd_write", write)
    bell.ring()
    closer.join()
    assert order == ["written", "closed"]


# ------------------------------------------------- an error staged in an old epoch
def test_an_epoch_left_with_an_error_pending_does_not_raise_it_in_the_next(fake_cuda: FakeStream) -> None:
    loader = fake_device(shmloader.DataLoader(Sized([2] * 16), batch_size=2, num_workers=2, persistent_workers=True))
    want = list(tud.DataLoader(Sized([2] * 16), batch_size=2))
    it = iter(loader)
    next(it)
    # What _round keeps when a batch's error comes behind batches already staged for the
    # device: the loop left the epoch before it was raised.
    it._pending_error = ValueError("batch 5 of the epoch before")
    for batch, expected in zip(loader, want, strict=True):  # (the same iterator, reset)
        same(batch, expected)
    it._shutdown_workers()


# ----------------------------------------------------------- the ring growing
def _grow_next_epoch(loader: shmloader.DataLoader[Any]) -> Any:
    """A persistent loader whose next epoch begins by growing its ring (as a batch too large
    for its slot asks), after one full epoch."""
    it = iter(loader)
    list(it)
    it._broker.grow_to = 2 * it.ring.geometry.data_bytes
    return it


def _rings_made(monkeypatch: pytest.MonkeyPatch) -> list[_ring.Ring]:
    made: list[_ring.Ring] = []

    class Recorded(_ring.Ring):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(_lifecycle, "Ring", Recorded)
    return made


def test_async_for_cancelled_while_the_ring_grows_goes_on_on_the_new_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _rings_made(monkeypatch)
    sizes = [4] * 32
    want = list(tud.DataLoader(Sized(sizes), batch_size=4))
    loader = shmloader.DataLoader(Sized(sizes), batch_size=4, num_workers=2, persistent_workers=True)
    it = _grow_next_epoch(loader)
    wait = _wait.Waiter.wait
    cancelled = []

    async def cancel_once(self: Any, request: Any, *args: Any) -> None:
        if request.kind == "conns" and self.life.started and not cancelled:  # waiting for workers to attach
            cancelled.append(request)
            raise asyncio.CancelledError  # as a timeout around the step would cancel it here
        await wait(self, request, *args)

    monkeypatch.setattr(_wait.Waiter, "wait", cancel_once)
    # Each worker's first look after the ring grew finds no answer yet, however fast it came: the
    # step then waits for the workers to attach (a busy machine could otherwise find every answer in)
    from multiprocessing.connection import Connection

    poll, looked = Connection.poll, set()

    def first_look_misses(self: Any, *args: Any) -> bool:
        if len(made) == 2 and id(self) not in looked:
            looked.add(id(self))
            return False
        return poll(self, *args)

    monkeypatch.setattr(Connection, "poll", first_look_misses)

    async def epoch() -> list[Any]:
        epoch_it = loader.__aiter__()
        with pytest.raises(asyncio.CancelledError):
            await epoch_it.__anext__()
        return [batch async for batch in epoch_it]  # the caller goes on with the same epoch

    got = asyncio.run(asyncio.wait_for(epoch(), timeout=60))
    assert cancelled and len(got) == len(want)
    for batch, expected in zip(got, want):
        same(batch, expected)
    assert it.ring is made[-1] and it._sched.num_slots == it.ring.geometry.num_slots
    assert made[0].fd == -1  # the old ring is closed
    assert loader.stats().ring_growths == 1
    it._shutdown_workers()


def test_an_error_while_the_ring_grows_leaves_no_ring_open(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _rings_made(monkeypatch)
    loader = shmloader.DataLoader(Sized([4] * 32), batch_size=4, num_workers=2, persistent_workers=True)
    it = _grow_next_epoch(loader)
    check = _consume.RingIterator._check

    def failing_check(self: Any) -> None:
        if len(made) == 2:  # the grown ring exists: its workers are attaching
            raise RuntimeError("a worker check failed while the workers attach")
        check(self)

    monkeypatch.setattr(_consume.RingIterator, "_check", failing_check)
    with pytest.raises(RuntimeError, match="while the workers attach"):
        next(iter(loader))
    assert len(made) == 2 and all(ring.fd == -1 for ring in made)
    assert it.shut_down


# ------------------------------------------------------ connections and deaths
def _worker_connection() -> Any:
    """In a worker (fork): its end of the loader's connection, from the worker loop's frame."""
    frame = sys._getframe()
    while frame.f_code.co_name not in ("_worker_loop", "_serve"):
        frame = frame.f_back  # type: ignore[assignment]
    return frame.f_locals.get("conn") or frame.f_locals["mailbox"].conn


class BreaksItsPipe(Dataset):  # type: ignore[type-arg]
    """Worker 0's first sample puts a pipe where its connection to the loader was: the loader's
    end reads EOF while the worker lives on, waiting for a message that cannot come."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 0:
            conn = _worker_connection()
            read_end, write_end = os.pipe()
            os.dup2(write_end, conn.fileno())
        return torch.tensor([i])


def test_a_broken_connection_to_a_live_worker_is_an_error_not_a_death(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pool, "DEATH_GRACE_S", 0.5)  # how long it is given to exit (it never does)
    loader = shmloader.DataLoader(BreaksItsPipe(), batch_size=2, num_workers=2, multiprocessing_context=FORK)
    it = iter(loader)
    with pytest.raises(ShmLoaderError, match=r"the connection to DataLoader worker 0 \(pid \d+\) broke .* while the "
                                             r"worker still runs"):
        next(it)
    assert it.shut_down and loader.stats().worker_restarts == 0


class DiesBetweenDoneAndPost(Dataset):  # type: ignore[type-arg]
    """Sample 4 (worker 0's) is published DONE by a worker that dies before it posts the ready
    semaphore; sample 5 (worker 1's, dispatched after it) is published right after that, so its
    token is the one the consumer finds both slots DONE with."""

    def __init__(self, done: Any) -> None:
        self.done = done

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 4 and not self.done.is_set():
            done = self.done

            def publish_and_die(ring: Any, slot: int, results: tuple[int, ...]) -> bool:
                header = ring.headers[slot]
                for k, value in enumerate(results):
                    header[Field.STATUS + k] = int(value)
                _native.store_release(ring.mm, ring.state_offsets[slot], DONE)
                done.set()
                os.kill(os.getpid(), signal.SIGKILL)  # before its post
                return False

            _ring.AttachedRing.publish = publish_and_die  # type: ignore[method-assign]
        if i == 5:
            self.done.wait(30)
        return torch.full((4,), i)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_worker_that_dies_between_done_and_its_post_loses_no_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each token stands for "look for DONE slots": the dead worker's slot, found with the next
    # worker's token, left that worker's slot without one. The epoch must still end.
    monkeypatch.setattr(_wait, "CHECK_S", 5.0)  # (the death is seen after the token came)
    dataset = DiesBetweenDoneAndPost(FORK.Event())
    loader = shmloader.DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context=FORK,
                                  timeout=60)
    got = [b.tolist() for b in loader]
    assert got == [[i] * 4 for i in range(12)]
    assert loader.stats().worker_restarts == 1


class DiesProbing(Dataset):  # type: ignore[type-arg]
    """The first worker to make sample 0 (the probe that sizes the ring) dies doing it."""

    def __init__(self, died: Any) -> None:
        self.died = died

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 0 and not self.died.is_set():
            self.died.set()
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.tensor([i])


def test_a_worker_that_dies_probing_the_first_batch_is_replaced() -> None:
    loader = shmloader.DataLoader(DiesProbing(FORK.Event()), batch_size=4, num_workers=2,
                                  multiprocessing_context=FORK)
    assert [b.flatten().tolist() for b in loader] == [list(range(i, i + 4)) for i in range(0, 16, 4)]
    assert loader.stats().worker_restarts == 1


def test_a_worker_that_dies_attaching_to_the_ring_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    died = FORK.Event()
    by_fd = _ring.AttachedRing.by_fd

    def dies_once(geometry: Any, fd: int, worker_id: int) -> Any:  # (fork: the workers run this)
        if worker_id == 1 and not died.is_set():
            died.set()
            os.kill(os.getpid(), signal.SIGKILL)
        return by_fd(geometry, fd, worker_id)

    monkeypatch.setattr(_ring.AttachedRing, "by_fd", staticmethod(dies_once))
    loader = shmloader.DataLoader(Sized([2] * 16), batch_size=4, num_workers=2, multiprocessing_context=FORK)
    want = list(tud.DataLoader(Sized([2] * 16), batch_size=4))
    got = list(loader)
    assert died.is_set() and loader.stats().worker_restarts == 1
    for batch, expected in zip(got, want, strict=True):
        same(batch, expected)


def test_startup_deaths_count_against_max_worker_restarts() -> None:
    loader = shmloader.DataLoader(DiesProbing(FORK.Event()), batch_size=4, num_workers=2,
                                  multiprocessing_context=FORK, max_worker_restarts=0)
    with pytest.raises(shmloader.WorkerDiedError, match=r"killed by signal SIGKILL before it answered for the first "
                                                        r"batch.*0 of max_worker_restarts=0"):
        list(loader)


def test_a_wrong_reply_to_a_new_ring_is_an_error_even_under_python_O(monkeypatch: pytest.MonkeyPatch) -> None:
    recv = _pool.WorkerPool.recv

    def garbled(self: Any, wid: int, raw: bool = False) -> Any:
        reply = recv(self, wid, raw)
        return ("attached?",) if isinstance(reply, Attached) else reply

    monkeypatch.setattr(_pool.WorkerPool, "recv", garbled)
    loader = shmloader.DataLoader(Sized([2] * 8), batch_size=2, num_workers=2)
    with pytest.raises(ShmLoaderError, match=r"answered \('attached\?',\) to a new ring, expected Attached\(\)"):
        next(iter(loader))


# ---------------------------------------------------------------- timeouts
class Stalls(Dataset):  # type: ignore[type-arg]
    """Makes no batch until its gate opens: its worker waits in the dataset."""

    def __init__(self, gate: Any) -> None:
        self.gate = gate

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        self.gate.wait()
        return torch.tensor([i])


@pytest.mark.parametrize("phase", ["probe", "steady"])
def test_a_timed_out_wait_never_sleeps_past_the_timeout(phase: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every sleep of a sync next() ends by the user's deadline (they once slept CHECK_S past it),
    # and the timeout is raised at once: the workers are not stopped first (that took 0.5 s
    # more, joining a worker stuck in the dataset), as torch's iterator goes on after one.
    import time

    gate = FORK.Event()
    loader = shmloader.DataLoader(Stalls(gate), batch_size=1, num_workers=1, timeout=0.6,
                                  multiprocessing_context=FORK, slot_bytes=4096 if phase == "steady" else None)
    overslept = []
    sleep_s = _wait.Waiter.sleep_s

    def checked(self: Any, deadline: float | None) -> float:
        seconds: float = sleep_s(self, deadline)
        if deadline is not None and time.monotonic() + seconds > deadline + 1e-3:
            overslept.append(seconds)
        return seconds

    monkeypatch.setattr(_wait.Waiter, "sleep_s", checked)
    it = iter(loader)
    with pytest.raises(RuntimeError, match=r"DataLoader timed out after 0.6 seconds"):
        next(it)
    assert overslept == []
    assert not it.shut_down  # torch's: the iterator goes on, and the next next() waits again
    gate.set()
    same(list(it), list(torch.utils.data.DataLoader(Stalls(gate), batch_size=1)))


# ---------------------------------------------------------- interpreter exit
@pytest.mark.slow
def test_a_persistent_loader_alive_at_exit_says_nothing(tmp_path: Any) -> None:
    # A module holding the loader (a framework's trainer, say) is torn down after the modules
    # the iterator's last words need.
    script = tmp_path / "alive_at_exit.py"
    script.write_text(textwrap.dedent("""
        import json
        import shmloader
        loader = shmloader.DataLoader(list(range(20)), batch_size=4, num_workers=2, persistent_workers=True)
        for batch in loader:
            pass
        json.kept = loader  # held by another module until the interpreter clears it
        it = iter(loader)
        held = next(it)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          cwd=os.getcwd())
    assert (done.returncode, done.stderr) == (0, "")
