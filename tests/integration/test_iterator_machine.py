"""The iterator as a whole, driven through random sequences of ``next()``, ``async`` next,
batches dropped or released, workers killed, batches too large for their slot (overflow
memory, then a grown ring), epochs ended and begun, and checkpoints taken and resumed. After
every step each slot has exactly one owner, every batch still held is intact, and every
batch delivered is torch's batch of that position, in order (tests/slot_model.py holds the
slot table itself to its model; this holds the iterator around it to torch)."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import torch
import torch.utils.data as tud
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import shmloader
from shmloader.main.iterator import RingIterator
from shmloader.main.scheduler import SlotState
from tests.conftest import examples, same
from tests.datasets import Sized

# 24 batches of 2 samples a epoch; batches 5 and 6 and 13 are too large for the first slots.
SIZES = [16] * 10 + [4000] * 4 + [16] * 12 + [9000] * 2 + [16] * 20
BATCH = 2


def owners_are_unique(it: RingIterator) -> None:
    """Each slot has exactly one owner: the table says which state it is in (``check``), a LENT
    slot is the user's (a lease, or one released and not yet taken back) and nothing else
    claims it, and overflow grants and piped batches belong to slots that hold a task."""
    sched, delivery, scope = it._sched, it._delivery, it._life.scope
    sched.check()
    lent = {s for s in range(sched.num_slots) if sched.state(s) is SlotState.LENT}
    leased, released = set(scope.leases.bases), set(scope.leases.released)
    assert leased | released == lent and not leased & released, (lent, leased, released)
    with_task = set(sched.tasks())
    assert set(scope.grants) <= with_task and set(delivery.piped) <= with_task


class IteratorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.want = [b.clone() for b in tud.DataLoader(Sized(SIZES), batch_size=BATCH)]
        self.loader = self._loader()
        self.it: Any = iter(self.loader)
        self.k = 0  # position in the epoch
        self.held: dict[int, torch.Tensor] = {}  # batches the user keeps (position -> batch)

    def _loader(self) -> shmloader.DataLoader[Any]:
        return shmloader.DataLoader(Sized(SIZES), batch_size=BATCH, num_workers=2, prefetch_factor=2,
                                    persistent_workers=True, max_worker_restarts=1000)

    def _got(self, batch: Any) -> None:
        same(batch, self.want[self.k])
        self.held[self.k] = batch
        self.k += 1

    @precondition(lambda self: self.k < len(self.want))
    @rule()
    def next(self) -> None:
        self._got(next(self.it))

    @precondition(lambda self: self.k < len(self.want))
    @rule()
    def async_next(self) -> None:
        self._got(asyncio.run(asyncio.wait_for(self.it.__anext__(), timeout=60)))

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data(), release=st.booleans())
    def let_go(self, data: st.DataObject, release: bool) -> None:
        k = data.draw(st.sampled_from(sorted(self.held)))
        batch = self.held.pop(k)
        if release:
            self.loader.release(batch)  # (never read again)

    @precondition(lambda self: self.it.ring is not None)
    @rule(worker=st.integers(0, 1))
    def kill(self, worker: int) -> None:
        proc = self.it._life.pool.procs[worker]
        if proc.exitcode is None:
            os.kill(proc.pid, signal.SIGKILL)

    @rule()
    def end_the_epoch(self) -> None:
        for batch in self.it:
            self._got(batch)
        assert self.k == len(self.want)
        with __import__("pytest").raises(StopIteration):
            next(self.it)
        self.it = iter(self.loader)  # the next epoch, on the same workers and ring
        self.k = 0
        self.held = {}

    @precondition(lambda self: 0 < self.k < len(self.want))
    @rule()
    def checkpoint(self) -> None:
        state = self.loader.state_dict()
        fresh = self._loader()
        fresh.load_state_dict(state)
        resumed = iter(fresh)
        try:
            same(next(resumed), self.want[self.k])
        finally:
            resumed._shutdown_workers()

    @invariant()
    def consistent(self) -> None:
        if isinstance(self.it, RingIterator) and self.it.ring is not None:
            owners_are_unique(self.it)
        for k, batch in self.held.items():
            same(batch, self.want[k])

    def teardown(self) -> None:
        self.held = {}
        self.it._shutdown_workers()


TestIteratorMachine = IteratorMachine.TestCase
TestIteratorMachine.settings = settings(max_examples=examples(25), stateful_step_count=30, deadline=None)
