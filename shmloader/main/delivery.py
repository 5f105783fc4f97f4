"""Delivery (main process): from a taken slot to the user's batch, and the batch's way back.

``Delivery`` builds each batch from the current ring (``main.scope.RingScope``: its leases,
the view ``_native.lend_lone`` builds one-tensor batches with, overflow grants, the device
stager) and keeps the batches that came pickled over a worker's pipe. A batch is, in order of
preference:

- one tensor in its slot, or a list, tuple or dict of them whose skeleton ``read_batch`` learnt
  (``lease.RECIPES``): built and lent in one native call (``lend_lone``);
- views of its slot (``read_batch``), lent until its last view dies or ``release()``;
- views of its own overflow memory: the slot is free at once, the memory once the batch dies;
- a copy, when lending the slot would leave a worker without a slot (the user holds the rest
  of the ring: ``list(loader)``, a replay buffer), or when it came over the pipe; while
  the user holds the ring, the batches after such a copy are copied too when it was small
  (``COPY_HELD_UNDER``), else written into memory of their own (views, as overflow batches);
- on a device: copied on a side stream ahead of the consumer (``DeviceStager``); its slot
  returns once the copy has completed.

For an IterableDataset, or a dataset with a state of its own, it also keeps each worker's
snapshot after its last delivered batch (or end of shard): where a replacement resumes, and
what a checkpoint saves; for an ``in_order=False`` epoch, which tasks were consumed.
"""

from __future__ import annotations

import pickle
from typing import Any

from shmloader import _native
from shmloader._state_layout import Plan, Progress
from shmloader._stats import Counters
from shmloader.main import device as _device
from shmloader.main.lease import copy_leaf, read_batch, read_dataset_state
from shmloader.main.overflow import OverflowBroker
from shmloader.main.scheduler import Scheduler, SlotState
from shmloader.main.scope import RingScope
from shmloader.wire.layout import Field

# A held batch (the user holds every slot a worker can spare: most_lent) under this many bytes is
# copied out of its slot in the main process, and so are the next ones while the ring stays held;
# a larger one has the next ones made in memory of their own (OWN tasks: a memfd each, zero-copy).
# Why a MiB: the copy costs the main process its bytes once (~0.3 µs a KiB with its pages);
# memory of its own ~200 µs of the main process a batch whatever its size (a memfd made,
# zero-filled and handed over, the batch made privately and copied in, a round trip per batch),
# and as much again in its worker. From about 700 KiB the copy costs the training process more,
# and the workers less; a MiB splits the difference (`shmloader bench --workloads hold`; the
# figures are in bench/RESULTS.md).
COPY_HELD_UNDER = 1 << 20


class ConsumedSeqs:
    """The tasks of an ``in_order=False`` epoch that were consumed, by their seq in the epoch (as
    first dispatched): every seq below ``below``, and those in ``ahead``. A resumed iterator
    dispatches only the others, in order: its own k-th task is the epoch's ``original(k)``."""

    __slots__ = ("below", "ahead", "base", "skipped")

    def __init__(self, below: int = 0, ahead: tuple[int, ...] = ()) -> None:
        self.below = below
        self.ahead = set(ahead)
        self.base, self.skipped = below, sorted(ahead)  # (what this iterator's dispatch skips)

    def original(self, k: int) -> int:
        seq = self.base + k
        for skipped in self.skipped:
            if skipped > seq:
                break
            seq += 1
        return seq

    def add(self, k: int) -> None:
        """This iterator's task ``k`` was consumed."""
        seq = self.original(k)
        if seq != self.below:
            self.ahead.add(seq)
            return
        self.below += 1
        while self.below in self.ahead:
            self.ahead.discard(self.below)
            self.below += 1


class Delivery:
    def __init__(self, sched: Scheduler, broker: OverflowBroker, counters: Counters, noting: bool,
                 seqs: bool = False) -> None:
        """``noting``: each delivered batch's worker and snapshot are recorded (an IterableDataset,
        or a dataset with a state of its own); ``seqs``: which tasks were consumed (``in_order=False``)."""
        self.sched = sched
        self.broker = broker
        self.counters = counters
        self.noting = noting
        self.piped: dict[int, bytes] = {}  # slot -> its (batch, dataset state), pickled over the pipe
        # worker -> its snapshot after its last delivered batch or end of shard, and that epoch
        # (kept across epochs: a persistent worker's dataset carries on from it)
        self.dataset_states: dict[int, tuple[bytes, int]] = {}
        self.last_worker: int | None = None  # worker of the last delivered batch
        self.ended: set[int] = set()  # workers whose shard ended in this epoch (an end of shard taken)
        self.consumed = ConsumedSeqs() if seqs else None

    def new_epoch(self, scope: RingScope | None) -> None:
        """Results the new epoch dropped (their slots FREE) take their piped payloads along."""
        self.piped = {s: p for s, p in self.piped.items() if self.sched.state_of(s) != SlotState.FREE}
        self.last_worker = None
        self.ended = set()
        if self.consumed is not None:
            self.consumed = ConsumedSeqs()
        if scope is not None and scope.stager is not None:
            scope.stager.drain()

    # ------------------------------------------------------------ batches
    def deliver(self, scope: RingScope, slot: int) -> Any:
        """The batch of ``slot``, just taken (LENT)."""
        if scope.lone is not None:  # (it checks the header: a piped or overflow batch is left alone)
            built = _native.lend_lone(slot, scope.leases.bases, scope.lone)  # one tensor, or a recipe's: one call
            if built is not None:
                if self.consumed is not None:
                    self.delivered(self.note(scope, slot))
                counters = self.counters
                counters.batches += 1
                counters.bytes += built[1]
                return built[0]
        ring = scope.ring
        piped = self.piped.pop(slot, None)
        if piped is not None:
            hdr = ring.headers[slot]
            worker, seq = int(hdr[Field.WORKER]), int(hdr[Field.R_SEQ])
            self.sched.give_back(slot)
            batch, state = pickle.loads(piped)
            self.delivered((worker, state, seq))
            self.counters.batches += 1
            self.counters.copies += 1
            return batch
        self.delivered(self.note(scope, slot))
        where = scope.where(slot)
        if where is not None:
            # The batch lies in its own overflow memory: the slot is free once it is read (it
            # may hold the batch's description), the memory once the batch's last view is dropped.
            try:
                batch, base, nbytes = read_batch(ring, slot, None, where)
            except BaseException:
                scope.drop(slot)
                raise
            finally:
                self.sched.give_back(slot)
            scope.take(slot, base)
            self.counters.overflow_batches += 1
            if self.sched.own and scope.leases.viewed_count() < scope.most_lent() - 1:
                self.sched.set_own(False)  # the user let go of the ring: batches go into slots again
        else:
            # Never lend a worker's last slot: a caller that keeps every batch (list(loader), a
            # replay buffer) would leave the workers nowhere to write, or one slot to take
            # turns on. Copy this one out of its slot (a large tensor into a memfd of its own). A
            # batch under COPY_HELD_UNDER bytes costs less copied than in memory of its own, so
            # the next ones are copied too while the user holds the ring; larger ones have the
            # next ones written into memory of their own (the overflow path: zero-copy views, as
            # torch's batches are, each its own segment).
            leases = scope.leases
            last = scope.most_lent()  # lent slots before this one that leave a worker without one
            copy = len(leases.bases) >= last and leases.viewed_count() >= last
            try:
                batch, base, nbytes = read_batch(ring, slot, copy_leaf if copy else None)
            except BaseException:
                self.sched.give_back(slot)
                raise
            if copy:
                self.counters.copies += 1
                del base
                self.sched.give_back(slot)
                if nbytes >= COPY_HELD_UNDER and self.broker.room_beside(ring, nbytes):
                    self.sched.set_own(True)  # (under a memory_budget with no room for that, they stay copies)
            else:
                leases.lend(slot, base)
        self.counters.batches += 1
        self.counters.bytes += nbytes
        return batch

    def piped_in(self, scope: RingScope, slot: int) -> None:
        """``slot``'s batch comes pickled over its worker's connection (published ``Region.PIPE``:
        memory_budget had no room while the user held it): read now, in the pipe's order, and
        the slot READY. A worker that died mid-send leaves it IN_FLIGHT: dispatched again."""
        task = self.sched.task_of(slot)
        assert task is not None
        payload = scope.pool.recv(task.worker, raw=True)
        if payload is None:
            self.sched.bank_token()  # (the token stays: the slot's next publication is its)
        elif self.sched.done(slot):
            self.piped[slot] = payload

    def stage(self, scope: RingScope, slot: int) -> None:
        """Start the device copy of ``slot``'s batch (just taken); it is handed over by
        ``pop_staged`` in its turn, and the slot returns once the copy completed
        (``RingScope.reap``)."""
        assert scope.stager is not None
        where = scope.where(slot)
        self.counters.overflow_batches += where is not None
        self.counters.bytes += scope.stager.stage(scope.ring, slot, self.note(scope, slot), where)

    def pop_staged(self, stager: _device.DeviceStager) -> Any:
        batch, note = stager.pop()
        self.delivered(note)
        self.counters.batches += 1
        return batch

    # ------------------------------------ worker snapshots, consumed tasks
    def note(self, scope: RingScope, slot: int) -> tuple[int, bytes, int] | None:
        """Which worker made this batch, its snapshot after it (when noting), and the task's seq;
        None when neither is kept."""
        if not self.noting and self.consumed is None:
            return None
        hdr = scope.ring.headers[slot]
        state = read_dataset_state(scope.ring, slot, scope.where(slot)) if self.noting else b""
        return int(hdr[Field.WORKER]), state, int(hdr[Field.R_SEQ])

    def delivered(self, note: tuple[int, bytes, int] | None) -> None:
        if note is not None:
            self.last_worker = note[0]
            if note[1]:
                self.dataset_states[note[0]] = (note[1], self.sched.epoch)
            if self.consumed is not None:
                self.consumed.add(note[2])

    def shard_ended(self, worker: int, snapshot: bytes) -> None:
        """``worker``'s shard ended, its dataset then as ``snapshot`` (b"": none carried)."""
        self.ended.add(worker)
        if snapshot:
            self.dataset_states[worker] = (snapshot, self.sched.epoch)

    # ---------------------------------------------------------- checkpoints
    def resume_from(self, plan: Plan, keeps_position: bool) -> bool:
        """A resumed iterator's first epoch: each worker's snapshot (that of a worker that has not
        delivered since is saved again as it was loaded), the last worker that delivered, the
        tasks already consumed. False: the plan holds no position in this epoch (its epoch ended,
        or it is produced again from its start)."""
        self.dataset_states = {w: (state, -1 if plan.done(w) else 0) for w, state in plan.workers.items()}
        if plan.finished or not keeps_position:
            return False
        self.last_worker = plan.last_worker
        if self.consumed is not None:
            self.consumed = ConsumedSeqs(plan.below, plan.ahead)
        return True

    def progress(self, consumed: int, finished: bool, pulled: int, drained: bool,
                 sampler_states: tuple[Any, Any]) -> Progress:
        """The epoch's ``Progress``: what the iterator says (batches consumed, StopIteration raised,
        batches of indices drawn, whether the sampler ended, a stateful sampler's states) with what
        delivery kept."""
        seqs = self.consumed
        epoch = self.sched.epoch
        return Progress(
            consumed, finished, pulled, {w: state for w, (state, _) in self.dataset_states.items()}, self.last_worker,
            sampler_states, -1 if seqs is None else seqs.below, () if seqs is None else tuple(sorted(seqs.ahead)),
            ended=frozenset(self.ended),
            earlier=frozenset(w for w, (_, at) in self.dataset_states.items() if at != epoch),
            drained=drained)

    def shard_state(self, scope: RingScope, wid: int) -> tuple[bytes, bool]:
        """Where a replacement of worker ``wid`` resumes: the snapshot its dataset stored after the
        last batch it made that is kept (ready, staged, or delivered), or at its shard's end (b"":
        none, the shard's start). And whether that snapshot is of an earlier epoch (the
        replacement then begins this one anew)."""
        sched = self.sched
        kept = [(task.seq, slot) for slot in sched.ready() if (task := sched.task_of(slot)) and task.worker == wid]
        if kept:
            slot = max(kept)[1]
            piped = self.piped.get(slot)
            if piped is not None:
                state: bytes = pickle.loads(piped)[1]
                return state, False
            return read_dataset_state(scope.ring, slot, scope.where(slot)), False
        stager = scope.stager
        staged = [note for note in ([] if stager is None else stager.notes()) if note and note[0] == wid]
        if staged:
            return staged[-1][1], False
        saved = self.dataset_states.get(wid)
        if saved is None:
            return b"", False
        return saved[0], saved[1] != sched.epoch
