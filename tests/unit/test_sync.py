"""The native synchronisation in the segment (native/_sync.c): process-shared semaphores,
release/acquire publication, and the wake a publication posts for a sleeping consumer."""

from __future__ import annotations

import mmap
import os
import signal
import threading

import numpy as np
import pytest

from shmloader import _native
from shmloader.wire.layout import Region, RingGeometry, Status
from shmloader.wire.ring import AttachedRing, Ring


def test_semaphore_counts_times_out_and_wakes_a_waiter() -> None:
    mm = mmap.mmap(-1, 4096)
    _native.sem_init(mm, 64)
    assert _native.sem_wait(mm, 64, 0) is False and _native.sem_wait(mm, 64, 0.01) is False
    _native.sem_post(mm, 64)
    _native.sem_post(mm, 64)
    assert _native.sem_wait(mm, 64, 0) and _native.sem_wait(mm, 64, 0.01)
    assert _native.sem_wait(mm, 64, 0) is False
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(_native.sem_wait(mm, 64, 30.0)))
    waiter.start()  # blocks with the GIL released until the post below
    _native.sem_post(mm, 64)
    waiter.join()
    assert woke == [True]


def test_semaphore_works_across_processes() -> None:
    mm = mmap.mmap(-1, 4096)  # MAP_SHARED anonymous: shared with a forked child
    _native.sem_init(mm, 0)
    _native.sem_init(mm, 64)
    pid = os.fork()
    if pid == 0:
        ok = _native.sem_wait(mm, 0, 30.0)  # the parent's post
        _native.sem_post(mm, 64)
        os._exit(0 if ok else 1)
    _native.sem_post(mm, 0)
    assert _native.sem_wait(mm, 64, 30.0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def test_a_signal_during_a_wait_reaches_python() -> None:
    mm = mmap.mmap(-1, 4096)
    _native.sem_init(mm, 0)

    class Alarm(Exception):
        pass

    def handler(signum: int, frame: object) -> None:
        raise Alarm

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Alarm):
            _native.sem_wait(mm, 0, 30.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_release_store_and_acquire_load() -> None:
    mm = mmap.mmap(-1, 4096)
    _native.store_release(mm, 8, -5)
    assert _native.load_acquire(mm, 8) == -5
    assert np.frombuffer(mm, np.int64)[1] == -5  # the plain int64 the header views read


def test_publication_across_processes_is_never_torn() -> None:
    # A child writes 4 KiB of data, then publishes its round number with a release store;
    # the parent spins on acquire loads and checks every byte the round promises.
    mm = mmap.mmap(-1, 3 * 4096)
    data = np.frombuffer(mm, np.uint8, count=4096, offset=4096)
    rounds = 2000
    pid = os.fork()
    if pid == 0:
        for r in range(1, rounds + 1):
            while _native.load_acquire(mm, 8) != r - 1:  # the parent has checked round r - 1
                pass
            data[:] = r % 251
            _native.store_release(mm, 0, r)
        os._exit(0)
    for r in range(1, rounds + 1):
        while _native.load_acquire(mm, 0) != r:
            pass
        assert int(data.min()) == int(data.max()) == r % 251, f"round {r} was read torn"
        _native.store_release(mm, 8, r)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


@pytest.mark.parametrize("call", [
    lambda mm: _native.sem_init(mm, 4096 - 8),
    lambda mm: _native.sem_post(mm, 3),
    lambda mm: _native.load_acquire(mm, 4),
    lambda mm: _native.store_release(mm, -8, 1),
    lambda mm: _native.sem_wait(mm, 4096, 0),
    lambda mm: _native.yield_wait(mm, 4096 - 32, 1),
    lambda mm: _native.yield_wait_timed(mm, 4096 - 32, 1, 0),
])
def test_offsets_outside_the_buffer_or_misaligned_are_refused(call: object) -> None:
    mm = mmap.mmap(-1, 4096)
    with pytest.raises(ValueError, match="do not fit a 4096-byte buffer"):
        call(mm)  # type: ignore[operator]


def test_a_read_only_buffer_is_refused() -> None:
    with pytest.raises(BufferError):
        _native.sem_post(b"\0" * 64, 0)


def test_a_publication_posts_the_wake_semaphore_only_for_what_a_sleeper_must_act_on() -> None:
    # The ready semaphore gets a token per publication; the wake semaphore, which a sleeping
    # sync next() waits on, only when the awaited word names the result (its seq) or any, or
    # when the result asks the consumer for something (memory) while it sleeps.
    geometry = RingGeometry(num_workers=1, num_slots=3, data_bytes=4096)
    ring = Ring(geometry)
    worker = AttachedRing(geometry, ring.mm, 0)

    def publish(slot: int, seq: int, status: Status = Status.OK) -> tuple[bool, bool]:
        """(a ready token came, a wake token came)"""
        worker.publish(slot, (status, 0, 0, 0, 0, 0, 0, 0, seq, 0, 0, Region.SLOT))
        return ring.take_ready(0), _native.sem_wait(ring.mm, ring.wake_sem, 0)

    try:
        assert publish(0, 0) == (True, False)  # nothing awaited: a fresh segment's word
        assert publish(0, 0, Status.NEED_MEMORY) == (True, False)  # nobody sleeps
        ring.await_result(2)
        assert publish(1, 1) == (True, False)  # a batch ahead of the one awaited wakes nobody
        assert publish(1, 1, Status.NEED_MEMORY) == (True, True)  # a request does
        assert publish(2, 2) == (True, True)
        ring.await_result(None)
        assert publish(0, 7) == (True, True)  # any
        ring.stop_awaiting()
        assert publish(1, 8) == (True, False)
        ring.await_result(None)
        worker.publish(2, (Status.OK, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, Region.SLOT))  # its wake token left behind
        ring.await_result(3)  # takes it: a stale token never ends the next sleep
        assert ring.sleep_awaited(0) is False
    finally:
        ring.close()
