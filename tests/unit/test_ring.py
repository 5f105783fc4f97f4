"""A ring's segment has no name once it exists: only its fd reaches the workers, so a kill at
any moment (during start-up, or while the ring grows and workers re-attach) cannot leave it
in /dev/shm."""

from __future__ import annotations

import os
import pickle
from typing import Any

import pytest

from shmloader.main.scheduler import Scheduler
from shmloader.wire.layout import Field, RingGeometry
from shmloader.wire.ring import AttachedRing, Ring


class Poster:
    """The main process's side of a ring's task queues: a scheduler attached to it (the queues'
    one writer in the main process), posting any task into any slot."""

    def __init__(self, ring: Ring, epoch: int) -> None:
        g = ring.geometry
        self.sched = Scheduler(g.num_slots, g.num_workers, epoch=epoch)
        self.sched.attach(ring.mm, ring.header_offsets, ring.data_offsets, ring.data_bytes, ring.queue_offsets,
                          ring.queue_len, tuple(ring.task_sems), ring.ready_sem)

    def post_task(self, worker: int, slot: int, epoch: int, seq: int, index: Any, pickled: bool = False,
                  own: bool = False) -> int:
        assert epoch == self.sched.epoch
        self.sched.redispatch(slot, worker, seq, index)  # (the table's task: seq and worker)
        self.sched.set_own(own)
        try:
            return self.sched.post_index(slot, index, pickled)
        finally:
            self.sched.orphans(worker)  # FREE again: the next post may take the slot

    def push_task(self, worker: int, entry: int) -> None:
        self.sched.push(worker, entry)


def test_the_segment_has_no_name_and_attaches_through_its_fd() -> None:
    ring = Ring(RingGeometry(num_workers=2, num_slots=5, data_bytes=4096))
    try:
        assert ring.segment.lstrip("/") not in os.listdir("/dev/shm")
        worker = AttachedRing.by_fd(ring.geometry, os.dup(ring.fd), 1)
        ring.headers[3][2] = 12345  # the same memory, seen from the worker's mapping
        assert worker.headers[3][2] == 12345
        Poster(ring, 0).push_task(1, -1)  # STOP_TASK
        assert worker.take_task(0.0) == -1
    finally:
        ring.close()


def test_a_task_reads_back_as_the_index_it_was_posted_with() -> None:
    ring = Ring(RingGeometry(num_workers=2, num_slots=3, data_bytes=4096))
    main = Poster(ring, 7)
    try:
        worker = AttachedRing(ring.geometry, ring.mm, 1)
        assert worker.take_task(0.0) is None  # nothing queued: no wait with timeout 0
        indices: list[Any] = [list(range(5, 512 + 5)), [-(2**63), 2**63 - 1, 0], [], (1, 2), [True, 2], {"k": [1.5]},
                              [b"x"], list(range(600))]  # the last: 4,800 bytes packed, more than the slot holds
        for seq, index in enumerate(indices):
            own = seq % 2 == 1  # (the batch into memory of its own: the consumer holds the ring)
            posted = main.post_task(1, seq % 3, 7, seq, index, own=own)
            if posted < 0:  # not a list of ints: pickled, as the loader sends it
                posted = main.post_task(1, seq % 3, 7, seq, pickle.dumps(index), True, own)
            if index == list(range(600)):
                assert posted == 0  # does not fit: nothing was queued (the loader uses the connection)
                continue
            assert posted == 1
            slot, epoch, got_seq, got, got_own = worker.take_task(0.0)  # type: ignore[misc]
            got = pickle.loads(got) if type(got) is bytes else got
            assert (slot, epoch, got_seq, got_own) == (seq % 3, 7, seq, own)
            assert got == index and type(got) is type(index) and [type(v) for v in got] == [type(v) for v in index]
        assert main.post_task(1, 0, 7, 99, [1, 2**63]) == -1  # past int64: pickled instead
        assert main.post_task(1, 0, 7, 99, [1, 2.0]) == -1
        assert worker.take_task(0.0) is None  # none of those was queued
        # A range stands for the list of its ints (a sequential batch sampler's batches)
        for seq, rng in enumerate([range(64, 128), range(10, -11, -3), range(5, 5), range(2**63 - 3, 2**63)]):
            assert main.post_task(1, seq % 3, 7, seq, rng) == 1
            assert worker.take_task(0.0)[3] == list(rng)  # type: ignore[index]
        assert main.post_task(1, 0, 7, 99, range(2**63 - 3, 2**63 + 1)) == -1  # past int64: pickled instead
        assert main.post_task(1, 0, 7, 99, range(-(2**63) - 1, 0)) == -1
        assert main.post_task(1, 0, 7, 99, range(0, 10**18)) == 0  # does not fit (and is not walked)
        assert main.post_task(1, 0, 7, 99, range(0, 2**70)) == -1  # no length: pickled (and refused there)
        assert worker.take_task(0.0) is None
        ring.headers[2][Field.TASK_LEN] = -1  # the index comes over the connection
        main.push_task(1, 2)
        assert worker.take_task(0.0)[3] is None  # type: ignore[index]
        ring.headers[2][Field.TASK_LEN] = -2 - 10**6  # a count past the slot: clamped to what it holds
        main.push_task(1, 2)
        assert len(worker.take_task(0.0)[3]) == ring.data_bytes // 8  # type: ignore[arg-type, index]
        main.push_task(1, 3)  # not a slot of the ring
        with pytest.raises(ValueError, match="queue entry 3 is not a slot of 3"):
            worker.take_task(0.0)
    finally:
        ring.close()


def test_a_worker_yields_for_a_task_before_it_sleeps_and_yields_less_after_each_miss(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from shmloader import _native
    from shmloader.wire import ring as _ring
    ring = Ring(RingGeometry(num_workers=2, num_slots=3, data_bytes=4096))
    main = Poster(ring, 7)
    try:
        worker = AttachedRing(ring.geometry, ring.mm, 1)
        real = _native.yield_wait

        def fast(buffer: Any, sem: int, bound: int, slow_ns: int) -> tuple[int, bool]:
            return real(buffer, sem, bound), False  # (real yields, never slow: a busy machine's could be)

        monkeypatch.setattr(_ring._native, "yield_wait_timed", fast)
        bounds = []
        for _ in range(6):  # nothing comes: yields, then the timed wait; the bound halves down to its floor
            bounds.append(worker.yields.bound)
            assert worker.take_task(0.01) is None
        assert bounds == [64, 32, 16, 8, 4, 4]
        seen = []

        def post_then_yield(buffer: Any, sem: int, bound: int, slow_ns: int) -> tuple[int, bool]:
            seen.append(bound)
            assert main.post_task(1, 2, 7, 41, [3, 4, 5]) == 1  # the main process posts while the worker yields
            return real(buffer, sem, bound), False

        monkeypatch.setattr(_ring._native, "yield_wait_timed", post_then_yield)
        assert worker.take_task(5.0) == (2, 7, 41, [3, 4, 5], False)  # taken by the yields, then read at once
        assert seen == [4] and worker.yields.bound == 64  # a task that came while yielding restores the bound
        monkeypatch.setattr(_ring._native, "yield_wait_timed", fast)
        assert main.post_task(1, 0, 7, 42, [6]) == 1
        assert worker.take_task(5.0) == (0, 7, 42, [6], False)  # queued already: no yields at all
        assert worker.yields.bound == 64
        assert worker.take_task(0.0) is None and worker.yields.bound == 64  # timeout 0 never yields
    finally:
        ring.close()
