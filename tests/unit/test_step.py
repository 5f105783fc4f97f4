"""``Scheduler.step``, the per-batch path, is exactly the model's sequence of transitions
(tests/slot_model.py): over random rings (results published, torn, asking for memory, piped,
errors, ends of shards, tokens posted late), leases dropped, epochs, worker sets and indices
(lists of ints, ranges, lists that are not all int64 ints, indices too long for a slot), each
call answers what the model answers and leaves the table, the lease table, the unposted tasks,
the segment's bytes and every semaphore as the model does on a twin ring. Seeds are printed."""

from __future__ import annotations

import copy
import random
from typing import Any, Iterator

import pytest

from shmloader import _native
from shmloader.main.scheduler import Scheduler, SlotState, Step
from shmloader.wire.layout import DONE, Field, Region, RingGeometry, Status
from shmloader.wire.ring import Ring
from tests.slot_model import ModelTable, same

WORKERS, DATA = 3, 4096  # a slot's data holds 512 int64 values


def indices(rng: random.Random, n: int) -> list[Any]:
    out: list[Any] = []
    for _ in range(n):
        kind = rng.randrange(6)
        if kind == 0:
            out.append([rng.randrange(-2**63, 2**63) for _ in range(rng.randrange(0, 40))])
        elif kind == 1:
            start = rng.randrange(0, 10**6)
            out.append(range(start, start + rng.randrange(0, 600), rng.choice((1, 1, 3, -2))))
        elif kind == 2:
            out.append([rng.randrange(100) for _ in range(rng.randrange(500, 530))])  # fits, or just not
        elif kind == 3:
            out.append([1, 2, rng.choice(("3", 3.0, 2**63, None))])  # not all int64 ints
        elif kind == 4:
            out.append((1, 2, 3))  # not a list: the caller pickles it
        else:
            out.append([rng.randrange(10**9)])
    return out


def publish(rings: list[Ring], slot: int, model: ModelTable, rng: random.Random) -> None:
    """A worker's result for ``slot``'s task, in both rings: usually a batch, sometimes twisted."""
    task = model.tasks[slot]
    fields = {Field.R_SEQ: task.seq, Field.R_EPOCH: task.epoch, Field.STATUS: Status.OK, Field.REGION: Region.SLOT}
    twist = rng.random()
    if twist < 0.04:
        fields[Field.R_SEQ] = task.seq + 1  # torn
    elif twist < 0.1:
        fields[Field.STATUS] = Status.NEED_MEMORY
    elif twist < 0.15:
        fields[Field.REGION] = Region.PIPE
    elif twist < 0.2:
        fields[Field.STATUS] = rng.choice([Status.STOP, Status.ERROR])
    elif twist < 0.25:
        fields[Field.REGION] = Region.OVERFLOW
    for ring in rings:
        for f, v in fields.items():
            ring.headers[slot][f] = int(v)
        _native.store_release(ring.mm, ring.state_offsets[slot], DONE)


def plain(rings: list[Ring], slot: int, model: ModelTable) -> None:
    """What the general path makes of a twisted result: here, the plain batch it stands for."""
    task = model.tasks[slot]
    for ring in rings:
        hdr = ring.headers[slot]
        hdr[Field.R_SEQ], hdr[Field.R_EPOCH], hdr[Field.STATUS], hdr[Field.REGION] = task.seq, task.epoch, 0, 0


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("seed", range(20))
def test_step_is_the_models_sequence_of_transitions(seed: int, in_order: bool) -> None:
    rng = random.Random(seed)
    print(f"seed {seed}")
    slots = rng.choice([2, 5, 7])
    cap = rng.randrange(1, slots + 1)
    geometry = RingGeometry(num_workers=WORKERS, num_slots=slots, data_bytes=DATA)
    native_ring, model_ring = Ring(geometry), Ring(geometry)
    rings = [native_ring, model_ring]
    try:
        native = Scheduler(slots, WORKERS, cap, in_order=in_order)
        model = ModelTable(slots, WORKERS, cap, in_order=in_order)
        native.attach(native_ring.mm, native_ring.header_offsets, native_ring.data_offsets, native_ring.data_bytes,
                      native_ring.queue_offsets, native_ring.queue_len, tuple(native_ring.task_sems),
                      native_ring.ready_sem)
        feed = indices(rng, rng.randrange(20, 200))
        native_sampler, model_sampler = iter(feed), iter(copy.deepcopy(feed))
        bases: dict[int, Any] = {}  # the lease table the step reads
        model_bases: dict[int, Any] = {}
        held: dict[int, Any] = {}  # what the user still holds
        late = 0  # tokens not yet posted for DONE slots
        for step in range(250):
            # Random events between two steps.
            for slot in [s for s in model.tasks if model.state[s] is SlotState.IN_FLIGHT]:
                if native_ring.headers[slot][Field.STATE] != DONE and rng.random() < 0.4:
                    publish(rings, slot, model, rng)
                    if rng.random() < 0.15:
                        late += 1  # its token comes later: DONE is seen first
                    else:
                        for ring in rings:
                            _native.sem_post(ring.mm, ring.ready_sem)
            while late and rng.random() < 0.4:
                late -= 1
                for ring in rings:
                    _native.sem_post(ring.mm, ring.ready_sem)
            for slot in list(held):
                if rng.random() < 0.4:
                    del held[slot]
            if rng.random() < 0.05:
                ended = rng.randrange(WORKERS)  # that worker's shard ended (its STOP taken)
                native.end_shard(ended)
                model.end_shard(ended)
            if rng.random() < 0.02:
                native.new_epoch()
                model.new_epoch()
            dispatch, take = rng.random() < 0.9, rng.random() < 0.9
            alive = {s: s in held for s in model_bases}
            want, want_event = model.step(model_ring, model_bases, alive, model_sampler, dispatch, take)
            got = native.step(bases, native_sampler, dispatch, take)
            assert got == want, (step, got, want)
            if got < 0 and got != Step.NOT_READY:
                assert native.event == want_event, step
            same(native, model)
            assert native.take_unposted() == model.unposted, step
            model.unposted = []
            assert sorted(bases) == sorted(model_bases)
            assert native_ring.mm[:] == model_ring.mm[:], step
            # What the general path does with each answer, in both.
            if got >= 0:
                base = object()
                bases[got], model_bases[got], held[got] = base, base, base
                del base
            elif got == Step.NEED_MEMORY:
                slot = want_event
                waiting = model.overflowed(slot, 4096)
                assert native.overflowed(slot, 4096) == waiting
                if waiting:
                    plain(rings, slot, model)
                    for ring in rings:
                        _native.store_release(ring.mm, ring.state_offsets[slot], 0)
                    native.granted(slot)
                    model.granted(slot)
            elif got == Step.PIPE:
                assert native.done(want_event) == model.done(want_event)
            elif got == Step.TORN:
                plain(rings, want_event, model)
                native.bank_token()  # (its token: not taken)
                model.bank_token()
            elif got == Step.RESULT:
                native.give_back(want_event)
                model.give_back(want_event)
            same(native, model)
    finally:
        native_ring.close()
        model_ring.close()


def test_a_sampler_error_propagates_with_nothing_dispatched() -> None:
    geometry = RingGeometry(num_workers=2, num_slots=3, data_bytes=DATA)
    ring = Ring(geometry)
    try:
        sched = Scheduler(3, 2, 2)
        sched.attach(ring.mm, ring.header_offsets, ring.data_offsets, ring.data_bytes, ring.queue_offsets,
                     ring.queue_len, tuple(ring.task_sems), ring.ready_sem)

        def failing() -> Iterator[Any]:
            raise KeyError("the sampler's own error")
            yield

        with pytest.raises(KeyError, match="the sampler's own error"):
            sched.step({}, failing(), True, True)
        assert (sched.n_tasks, sched.n_free, sched.send_seq, sched.tails) == (0, 3, 0, (0, 0))
        sched.check()
        with pytest.raises(TypeError, match="lease dict"):
            sched.step([], iter([]), True, True)
        with pytest.raises(RuntimeError, match="no ring is attached"):
            Scheduler(3, 2).step({}, iter([]), True, True)
        with pytest.raises(ValueError, match="an offset lies outside the ring"):
            sched.attach(ring.mm, (len(ring.mm),) * 3, ring.data_offsets, ring.data_bytes, ring.queue_offsets,
                         ring.queue_len, tuple(ring.task_sems), ring.ready_sem)
        with pytest.raises(ValueError, match="header_offsets must be a tuple of 3"):
            sched.attach(ring.mm, ring.header_offsets[:2], ring.data_offsets, ring.data_bytes, ring.queue_offsets,
                         ring.queue_len, tuple(ring.task_sems), ring.ready_sem)
        assert sched.step({}, iter([[1, 2]]), True, True) == Step.NOT_READY and sched.n_tasks == 1
    finally:
        ring.close()
