"""The main process's iterator: start-up, waiting (sync and async), ordering, errors.

One generator, ``_steps``, holds all the logic of producing the next batch; it
yields a *wait request* whenever nothing is ready. Each of its passes is ``_round``,
which never waits; when the batch is ready at once, ``next()`` runs one ``_round``
without the generator. ``__next__`` fulfils requests by blocking on the ready
semaphore in short timed waits (so worker deaths and timeouts are noticed);
``__anext__`` fulfils them by awaiting the doorbell eventfd (workers write it only
while the doorbell flag in the segment says an ``async for`` waits) and the workers'
process sentinels on the running event loop: no helper thread. A CUDA copy has no fd:
``async for`` with ``device=`` queries its event from the loop at growing intervals.

Slot state lives in ``_slots.SlotTable`` (free / in flight / waiting for overflow
memory / ready / lent); this module holds the policy: which task goes where, when
overflow memory is granted, when the ring grows, waiting and errors.

Invariants:
- a worker sets DONE before it posts the ready semaphore, so every token stands for a
  DONE slot when posted; a token is banked until a DONE slot is found for it (after a
  worker is replaced, a token of a re-dispatched slot stays banked: a token means "look
  for DONE slots", never "this slot is done");
- a result whose epoch is not the current one is discarded and its slot freed;
- overflow memory granted to a slot (``_overflow``) is freed exactly once: when the
  delivered batch's last view dies, when its device copy completed, or when its task is
  dropped (stale epoch, dead worker, error);
- the ring is replaced (grown) only when no slot is in flight, waiting or ready and no
  device copy reads it.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import os
import pickle
import time
import warnings
import weakref
from multiprocessing import connection as mp_connection
from typing import Any, Callable, Generator

import torch
import torch.autograd.profiler as _profiler
from torch.utils.data.dataloader import _BaseDataLoaderIter, _DatasetKind

from . import _checkpoint, _device, _native
from ._dispatch import Dispatcher, as_list, batches_of
from ._errors import CorruptSlotError, MemoryBudgetError, ShmLoaderError, StopCarrier, WorkerDiedError, raise_worker_error
from ._budget import plan_ring
from ._layout import DONE, IDLE, N_FIELDS, PAGE, RESIZE_TASK, Counter, Field, Region, RingGeometry, Status, grown_slot_bytes, round_up
from ._lease import Leases, Where, copy_leaf, leaves_of, lone_args, read_batch, read_dataset_state, read_pickled, slot_of
from ._overflow import OverflowArena
from ._pool import WorkerPool
from ._ring import NOT_INTS, POSTED, Doorbell, Ring, YieldWait
from ._slots import SlotState, SlotTable, Task
from ._stats import Counters, RingOccupancy
from ._worker import WorkerConfig

_IN_FLIGHT = SlotState.IN_FLIGHT
_R_SEQ, _R_EPOCH, _STATUS, _NEEDED, _REGION = Field.R_SEQ, Field.R_EPOCH, Field.STATUS, Field.NEEDED, Field.REGION
_OK, _NEED_MEMORY, _PIPE = int(Status.OK), int(Status.NEED_MEMORY), int(Region.PIPE)
CHECK_S = 0.25  # how often a blocked sync wait checks worker liveness
PARENT_CHECK_S = 0.5  # how often an idle worker checks that this process lives
# What _native.steady_take needs to know of the slot table and the headers, and its answers.
_STEADY = (SlotState.FREE, SlotState.IN_FLIGHT, SlotState.READY, SlotState.LENT, DONE, int(Status.OK),
           int(Status.NEED_MEMORY), int(Region.PIPE), Field.STATE, Field.STATUS, Field.REGION, Field.R_EPOCH,
           Field.R_SEQ, N_FIELDS)
_NOT_READY, _GENERAL = -1, -2  # steady_take's answers other than a slot
_DISPATCH = (SlotState.FREE, SlotState.IN_FLIGHT, Task)  # what _native.dispatch_next needs of the slot table
# Private answers of the iterator's steps, never a user's value (a batch may be None, 0, [] ...)
_NOTHING = object()  # nothing ready yet
_END = object()  # the epoch has ended
_GROW = object()  # the ring must grow before anything else is dispatched
_COPY = ("copy",)  # wait for the oldest device copy to complete
_READY = ("ready",)


_live: weakref.WeakSet[RingIterator] = weakref.WeakSet()  # iterators whose workers may run


@atexit.register
def _stop_at_exit() -> None:
    """At interpreter exit, before modules are torn down (an iterator a module still holds,
    a persistent one most often, would otherwise be collected after the modules it needs):
    stop every live iterator's workers; its last words (its progress, for a checkpoint) are
    not wanted any more."""
    for it in list(_live):
        it.last_words = None
        it._shutdown_workers()


class RingIterator(_BaseDataLoaderIter):
    """Iterator over a DataLoader with ``num_workers > 0`` (sync and async)."""

    def __init__(self, loader: Any) -> None:
        super().__init__(loader)
        if not loader.prefetch_factor > 0:  # no task could ever be dispatched: next() would wait forever
            raise AssertionError("prefetch_factor must be greater than 0 for MultiProcessingDataLoaderIter")  # torch's
        # Called with this iterator when it is collected (set by _checkpoint: its progress).
        self.last_words: Callable[[RingIterator], None] | None = None
        if loader._shm_resume_seed is not None:
            # Resuming an epoch that reused persistent workers: their base seed, and the
            # sampler RNG as that epoch found it (creating this iterator drew from it).
            self._base_seed, rng = loader._shm_resume_seed
            _checkpoint.set_rng_state(loader.generator, rng)
            self._sampler_iter = iter(self._index_sampler)
        self._loader = weakref.ref(loader)
        self._in_order: bool = loader.in_order
        self._prefetch_factor: int = loader.prefetch_factor
        self._slot_bytes: int | None = loader.slot_bytes
        self._batch_bytes: int | None = loader._shm_batch_bytes
        self._memory_budget: int | None = loader._shm_memory_budget
        self._counters: Counters = loader._shm_counters
        self._max_restarts: int = loader.max_worker_restarts
        self._iterable = self._dataset_kind == _DatasetKind.Iterable
        self._shutdown = True  # until the workers exist
        self._ring: Ring | None = None
        self._lone: tuple[Any, ...] | None = None  # _native.lend_lone's view of the ring (see _steady)
        self._started = False
        self._deadline: float | None = None
        self._banked = 0
        self.yields = YieldWait()  # a sync next()'s, before it sleeps on the ready semaphore
        wanted = self._num_workers * self._prefetch_factor  # memory_budget may lower it
        self._table = SlotTable(wanted, self._num_workers)
        self._dispatcher = Dispatcher(self._num_workers, self._iterable, self._in_order)
        self._leases = Leases()
        self._arena = OverflowArena()
        self._overflow: dict[int, tuple[Any, int]] = {}  # slot -> (mapping, bytes) granted to its task
        self._piped: dict[int, bytes] = {}  # slot -> its (batch, dataset state), pickled over the pipe
        self._grow_to: int | None = None  # a larger slot size, taken up once the ring drains
        self._attaching: dict[int, Any] = {}  # workers sent a new ring, not yet attached: worker -> its process
        self._growth_declined = False  # memory_budget had no room to grow; overflow carries large batches
        self._awaiting_room = False  # a grant waits for memory_budget: frees ring the doorbell
        self.pinned = False  # the ring is page-locked (pin_memory=True or device= on CUDA)
        self._device: torch.device | None = loader._shm_device
        self._device_prefetch: int = loader.device_prefetch
        self._stager: _device.DeviceStager | None = None  # made with the ring, after the fork
        self._pending_error: Exception | None = None  # a batch's error, raised after the batches staged before it
        self._raising_batch_error = False  # the exception on its way out is one batch's: the loader goes on
        self._failed_batches = 0  # batches of this epoch that raised instead (a checkpoint counts them consumed)
        self._fatal: BaseException | None = None  # what stopped the workers before the epoch ended
        resume: _checkpoint.IterableResume | None = loader._shm_resume_iterable
        ctx = loader.multiprocessing_context or torch.multiprocessing
        self._doorbell = Doorbell()
        configs = [
            WorkerConfig(
                worker_id=i,
                num_workers=self._num_workers,
                dataset=self._dataset,
                iterable=self._iterable,
                auto_collation=self._auto_collation,
                collate_fn=self._collate_fn,
                drop_last=self._drop_last,
                base_seed=int(self._base_seed),
                worker_init_fn=loader.worker_init_fn,
                parent_pid=os.getpid(),
                parent_check_s=PARENT_CHECK_S,
                dataset_state=b"" if resume is None else resume.dataset_states.get(i, b""),
            )
            for i in range(self._num_workers)
        ]
        try:
            self._pool = WorkerPool(ctx, configs, self._doorbell.fd)
        except BaseException:
            self._doorbell.close()
            raise
        self._shutdown = False
        _live.add(self)
        me = weakref.ref(self)

        def room_freed() -> None:  # (any thread: the one that dropped an overflow batch)
            it = me()
            if it is not None and it._awaiting_room:
                it._doorbell.ring()  # (a no-op once shut down: the bell is closed)

        self._arena.on_free = room_freed
        self._reset(loader, first_iter=True)
        if resume is not None:  # continue the round-robin where the checkpointed epoch was
            self._dispatcher.active = list(resume.active)
            if resume.last_worker is not None:
                self._dispatcher.skip_to(resume.last_worker + 1)

    # ---------------------------------------------------------------- epochs
    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        super()._reset(loader, first_iter)
        self._sampler_iter = batches_of(self._index_sampler)
        self._failed_batches = 0
        self._pending_error = None  # (an error staged behind batches of an epoch left early is that epoch's)
        self._raising_batch_error = False
        if not first_iter:
            self._table.new_epoch()
            for slot in [s for s in self._overflow if self._table.state[s] is SlotState.FREE]:
                self._drop_overflow(slot)  # ready, never delivered: the new epoch dropped it
            self._piped = {s: p for s, p in self._piped.items() if self._table.state[s] is not SlotState.FREE}
            self._growth_declined = False
        self.dataset_states: dict[int, bytes] = {}  # worker -> state after its last delivered batch
        self.last_worker: int | None = None  # worker of the last delivered batch
        if self._stager is not None:
            self._stager.drain()
        self._send_seq = 0
        self._rcvd_seq = 0
        self._sampler_done = False
        self._dispatcher.reset()

    @property
    def shut_down(self) -> bool:
        return self._shutdown

    # ----------------------------------------------------------------- logic
    def _steps(self, looked: bool = False) -> Generator[tuple[Any, ...], None, Any]:
        """The logic of one ``next()``; ``looked``: a ``_round`` just ran and found nothing ready
        (the steady-state fast path), so the first wait comes without another."""
        if self._stager is not None and self._stager.staged:
            return self._pop_staged()  # batches staged before an error or shutdown come first
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            self._raising_batch_error = True
            raise error
        if self._shutdown:
            if self._fatal is not None:  # never a silent end of the epoch
                raise RuntimeError(
                    f"this DataLoader iterator stopped after an earlier error ({type(self._fatal).__name__}: "
                    f"{self._fatal}); start a new epoch with iter(loader)"
                ) from self._fatal
            return _END
        if not looked:  # (a sync next() that looked first set it before)
            self._deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        if not self._started and not self._sampler_done:
            yield from self._start()
        if self._attaching:  # a grown ring's wait, cancelled in an async for: before any connection is read
            yield from self._await_attached()
        while True:
            result = _NOTHING if looked else self._round()
            looked = False
            if result is _GROW:
                yield from self._grow()
                continue
            if result is not _NOTHING and result is not _COPY:
                return result
            stager = self._stager
            if result is _COPY or (stager is not None and stager.copying and not self._table.free):
                # Every slot is copying or staged (or the epoch ends with copies running): only
                # a copy's completion moves on. Waited for without blocking an event loop.
                self._check()
                yield _COPY
                continue
            yield _READY  # whoever waits checks dead workers and the timeout before it blocks

    def _round(self) -> Any:
        """One pass that never waits: take back returned slots, collect published ones, grant
        overflow memory, dispatch tasks, and deliver the next batch if it is ready. Returns
        the batch, ``_END``, ``_GROW`` (the ring must grow first) or ``_NOTHING`` (nothing yet)."""
        stager = self._stager
        if self._ring is not None:
            table = self._table
            self._give_back_returned()
            if stager is not None:
                self._copied(stager.reap())
            self._collect()
            if table.waiting_count:
                self._grant()
            else:
                self._awaiting_room = False
            if self._grow_to is not None and not table.busy() and not (stager and stager.copying):
                return _GROW
            self._dispatch()
            if stager is None:
                slot = self._take_next()
                # The batch taken left the tasks: dispatch the next one now, as torch's loader
                # does, so W*P tasks stay in flight while the caller's step runs. Ends of shards
                # taken left them too: the last live one's may leave nothing in flight, and only
                # a dispatch finds that no worker is left (the epoch's end, just below).
                self._dispatch()
                if slot is not None:
                    return self._deliver(slot)
            else:
                try:
                    while stager.has_room() and (slot := self._take_next()) is not None:
                        where = self._overflow_where(slot)
                        self._counters.overflow_batches += where is not None
                        self._counters.bytes += stager.stage(self._ring, slot, self._note(slot), where)
                    self._dispatch()  # as without a device: the slots taken left the tasks, room for more
                except Exception as error:
                    if not stager.staged or not self._raising_batch_error:
                        raise
                    self._raising_batch_error = False
                    self._pending_error = error  # raised in its turn, after the staged batches
                if stager.staged:
                    return self._pop_staged()
        if self._sampler_done and not self._table.outstanding and not self._table.ready:
            if not self._persistent_workers:
                if stager is not None and stager.copying:
                    return _COPY  # shutting down waits for them: let them finish first
                self._shutdown_workers()
            return _END
        return _NOTHING

    def _steady(self) -> Any:
        """``next()`` in order, without a device, nothing pending: one native call
        (``_native.steady_take``: returned slots back, published slots collected, the next batch
        taken, the slot table's own transitions), then ``_dispatch_and_wait`` and again until
        the batch is in. Anything out of the ordinary goes to ``_round``, whose result this
        returns; ``_NOTHING`` means a round found nothing ready (the general path waits next)."""
        table = self._table
        leases = self._leases
        ring = self._ring
        assert ring is not None
        if leases.released or table.waiting_count or self._grow_to is not None:
            return self._round()  # a slot released early, overflow memory to grant, or a ring to grow
        self._awaiting_room = False
        while True:
            slot, self._banked, gone = _native.steady_take(
                ring.mm, ring.ready_sem, ring.header_offsets, self._banked, table.tasks, table.state, table.ready,
                table.load, table.free, leases.bases, table.epoch, self._rcvd_seq, _STEADY)
            table.outstanding -= gone
            if slot >= 0:
                return self._hand_out(slot)
            if slot == _GENERAL or not self._dispatch_and_wait():
                # a slot for the general path, or a case of the round's (a round ran last
                # whenever the general path waits)
                return self._round()

    def _dispatch_and_wait(self) -> bool:
        """No batch ready in order yet (steady state): dispatch what the free slots allow, then
        wait as the general path does (yields, then workers and timeout checked, then sleep).
        False, without waiting, when a round must run instead: the epoch ends (the round says
        so), a slot was released early, or the ring must grow."""
        self._dispatch()
        if self._grow_to is not None or self._leases.released or self._sampler_done and not self._table.outstanding:
            return False
        self._block(_READY)
        return True

    def _hand_out(self, slot: int) -> Any:
        """The batch of ``slot``, just taken in order: the next task dispatched (the batch left
        the tasks, as in _round), then the batch built and lent."""
        self._rcvd_seq += 1
        self._dispatch()
        # A batch that is one tensor in its slot: built and lent in one call. (_lone is None for
        # an IterableDataset, whose batches carry notes; overflow memory is _deliver's.)
        if self._lone is not None and not self._overflow:
            try:
                built = _native.lend_lone(slot, self._leases.bases, self._lone)
            except BaseException:
                self._table.give_back(slot)
                raise
            if built is not None:
                counters = self._counters
                counters.batches += 1
                counters.bytes += built[1]
                return built[0]
        return self._deliver(slot)  # anything else, or what lend_lone left as it found it

    def _give_back_returned(self) -> None:
        """Slots whose batches the user dropped (or released) become free."""
        for returned in self._leases.take_returned():
            self._table.give_back(returned)

    def _copied(self, slots: list[int]) -> None:
        """Device copies out of ``slots`` completed: the slots (and their overflow memory) return."""
        for slot in slots:
            self._table.give_back(slot)
            self._drop_overflow(slot)

    def _check(self) -> None:
        """Replace dead workers (or raise); raise if the user's ``timeout`` has passed."""
        for wid in self._pool.dead():
            self._recover(wid)
        if self._deadline is not None and time.monotonic() >= self._deadline:
            raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds")

    def _start(self) -> Generator[tuple[Any, ...], None, None]:
        """Size the ring (from the first batch unless known), create it, attach every worker."""
        first = self._batch_bytes
        probe: tuple[int, int, Any] | None = None
        while self._slot_bytes is None and first is None:
            task = self._next_task()
            if task is None:
                return
            wid, seq, index = task
            _, status, needed, error = yield from self._probe(wid, seq, index)
            if status == Status.STOP:
                self._dispatcher.active[wid] = False
                self._rcvd_seq = seq + 1  # only exhausted shards came before
            elif status == Status.ERROR:  # the first batch's own error: raised, and the next one is probed
                self._rcvd_seq = seq + 1
                self._batch_failed()
                raise_worker_error(error)
            elif status == Status.INIT_ERROR:
                self._shutdown_workers()
                raise_worker_error(error)
            else:
                first = needed
                self._remember_batch_bytes(first)  # later epochs skip the probe
                probe = (wid, seq, index)
        slot_bytes = self._slot_bytes
        if slot_bytes is not None and first is not None:  # slot_bytes= is a hint: a ring grown past it stays grown
            slot_bytes = max(slot_bytes, first)
        geometry = plan_ring(self._num_workers, self._prefetch_factor, first, slot_bytes, self._memory_budget)
        self._table = SlotTable(geometry.num_slots, self._num_workers, self._table.epoch)
        self._leases = Leases()
        ring = Ring(geometry)
        self._ring = ring
        self._lone = None if self._iterable else lone_args(ring, geometry.num_slots)
        if self._device is not None:
            self._stager = _device.DeviceStager(self._device, self._device_prefetch)
        if self._stager is not None or (self._pin_memory and self._pin_memory_device == "cuda"):
            self.pinned = _device.register_host(ring.mm, ring.geometry.total_bytes)
        elif self._pin_memory:
            _device.warn_unsupported(self._pin_memory_device)
        self._attaching = dict(enumerate(self._pool.procs))
        for wid in range(self._num_workers):
            pending = -1
            if probe is not None and probe[0] == wid:
                pending = self._table.dispatch(wid, probe[1], probe[2])
            self._pool.send(wid, ("ring", ring.geometry, pending), ring.fd, dead_ok=True)
        yield from self._await_attached()
        self._started = True

    def _probe(self, wid: int, seq: int, index: Any) -> Generator[tuple[Any, ...], None, tuple[Any, ...]]:
        """Worker ``wid``'s answer for batch ``seq`` (the epoch's first, made privately to size
        the ring). A worker that dies first is replaced (within max_worker_restarts: ``_check``)
        and its replacement asked again."""
        while True:
            proc = self._pool.procs[wid]
            self._pool.send(wid, ("probe", self._table.epoch, seq, as_list(index)), dead_ok=True)
            while self._pool.procs[wid] is proc and not self._pool.conns[wid].poll():
                self._check()
                if self._pool.procs[wid] is proc:
                    yield ("conns", [wid])
            if self._pool.procs[wid] is proc:
                reply = self._pool.recv(wid)
                if reply is not None:
                    return tuple(reply)
                self._check()  # it died as it answered: replaced here, then asked again

    def _await_attached(self) -> Generator[tuple[Any, ...], None, None]:
        """Wait until every worker sent a new ring (``_attaching``: worker -> its process then)
        says it attached. A worker that dies meanwhile is replaced by ``_check`` (its
        replacement maps the ring by itself and says nothing) and no longer waited for. The
        state lives on the iterator: a wait cancelled by ``async for`` resumes at the next
        step, before anything else reads a connection."""
        attaching = self._attaching
        while attaching:
            self._check()
            for wid, proc in list(attaching.items()):
                if self._pool.procs[wid] is not proc:
                    del attaching[wid]  # replaced (by the _check above): its successor has the ring
                elif self._pool.conns[wid].poll():
                    reply = self._pool.recv(wid)
                    if reply is None:
                        continue  # it died as it answered: the next _check replaces it
                    if reply != ("attached",):
                        self._shutdown_workers()
                        raise ShmLoaderError(f"DataLoader worker {wid} answered {reply!r:.200} to a new ring, "
                                             "expected ('attached',): the setup protocol is broken")
                    del attaching[wid]
            if attaching:
                yield ("conns", sorted(attaching))

    def _recover(self, wid: int) -> None:
        """Replace dead worker ``wid`` and dispatch its tasks again, or raise WorkerDiedError.

        Its slots may be half written: each is reset and its task (same epoch, seq and
        index) goes to a live worker, so the epoch still yields every batch exactly once and
        in order. They go to its replacement (same worker id and seeds), so the batch -> worker
        assignment stays torch's. Overflow memory granted to its tasks is dropped.
        """
        table = self._table
        current = sorted(table.tasks[s].seq for s in table.of_worker(wid) if table.tasks[s].epoch == table.epoch)
        doing = ""
        if current:
            slot = next(s for s in table.of_worker(wid) if table.tasks[s].seq == current[0])
            doing = f" while producing batch {current[0]} (index {as_list(table.tasks[slot].index)!r:.200})"
        elif self._ring is None:
            doing = " before it answered for the first batch, before the ring was set up"
        used = self._counters.worker_restarts
        reason = None
        if self._started and self._iterable and not _checkpoint.has_state(self._dataset):
            # (before the start, a worker has made at most the first batch, privately: its
            # replacement makes it again from the shard's start)
            reason = ("an IterableDataset worker cannot be replaced without repeating or losing its shard; "
                      "give the dataset state_dict() and load_state_dict() to make its workers replaceable")
        elif used >= self._max_restarts:
            reason = f"{used} of max_worker_restarts={self._max_restarts} restarts are used up"
        if reason is not None:
            hint = (" If it ran out of memory, lower batch_size, num_workers or prefetch_factor; to tolerate "
                    "more deaths raise max_worker_restarts." if self._pool.killed(wid) else "")
            raise WorkerDiedError(f"{self._pool.death(wid)}{doing}; {reason}.{hint}")
        self._counters.worker_restarts += 1
        if self._ring is None:  # it died probing the first batch: a fresh worker, which _probe asks again
            self._pool.restart(wid, self._doorbell.fd)
            return
        # It may have published a slot DONE and died before posting its token: a slot found
        # DONE for another worker's token leaves that worker's slot with no token to come. One
        # more banked token makes _collect look again; a surplus one only makes it look once
        # more later (a token means "look for DONE slots", never "this slot is done").
        self._banked += 1
        orphans = table.orphans(wid)
        for slot, _ in orphans:
            self._drop_overflow(slot)
        self._ring.renew_queue(wid)
        shard = (self._shard_state(wid), table.epoch) if self._iterable else None
        self._pool.replace(wid, self._ring, self._doorbell.fd, shard)
        for slot, task in orphans:  # to its replacement: the batch -> worker assignment stays torch's
            if task.epoch == table.epoch:
                table.redispatch(slot, task, wid)
                self._submit(slot, wid, task.seq, task.index)

    def _shard_state(self, wid: int) -> bytes:
        """Where a replacement of IterableDataset worker ``wid`` resumes its shard: the state its
        dataset stored after the last batch it made that is kept (ready, staged, or delivered),
        in this epoch; nothing (the shard's start) when there is none."""
        assert self._ring is not None
        table = self._table
        kept = [(table.tasks[s].seq, s) for s in table.ready.values() if table.tasks[s].worker == wid]
        if kept:
            slot = max(kept)[1]
            piped = self._piped.get(slot)
            if piped is not None:
                state: bytes = pickle.loads(piped)[1]
                return state
            return read_dataset_state(self._ring, slot, self._overflow_where(slot))
        staged = [note for note in ([] if self._stager is None else self._stager.notes()) if note and note[0] == wid]
        if staged:
            note: tuple[int, bytes] = staged[-1]
            return note[1]
        if wid in self.dataset_states:
            return self.dataset_states[wid]
        # The iterator's first epoch may have begun from a checkpoint: the state it was given.
        return self._pool.configs[wid].dataset_state if self._table.epoch == 0 else b""

    def _submit(self, slot: int, wid: int, seq: int, index: Any) -> None:
        """Write task ``seq`` into ``slot`` and wake worker ``wid``: one native call when its
        index fits the slot (the common case: a batch sampler's list of ints, as int64 values;
        anything else pickled); otherwise the index goes over the connection."""
        ring = self._ring
        assert ring is not None
        epoch = self._table.epoch
        posted = ring.post_task(wid, slot, epoch, seq, index)
        if posted == NOT_INTS:
            posted = ring.post_task(wid, slot, epoch, seq, pickle.dumps(as_list(index), protocol=pickle.HIGHEST_PROTOCOL), True)
        if posted == POSTED:
            return
        size = self._dispatcher.send_index(ring, slot, wid, epoch, seq, index,
                                           functools.partial(self._pool.send, dead_ok=True))
        if size > ring.data_bytes:
            self._want_growth(size)

    def _dispatch(self) -> None:
        table = self._table
        # torch's bound: num_workers * prefetch_factor tasks dispatched and not yet taken.
        # The ring's extra slot is for the batch in the user's hands, never one more task.
        cap = self._num_workers * self._prefetch_factor
        while table.free and len(table.tasks) < cap and not self._sampler_done and self._grow_to is None:
            if not self._in_order:
                task = self._next_task()
                if task is None:
                    return
                wid, seq, index = task
                self._submit(table.dispatch(wid, seq, index), wid, seq, index)
                continue
            # In order: _next_task, table.dispatch and the post of _submit in one native call
            ring = self._ring
            assert ring is not None
            dispatcher = self._dispatcher
            seq = self._send_seq
            code, dispatcher.next_rr, slot, wid, index = _native.dispatch_next(
                self._sampler_iter, dispatcher.active, dispatcher.next_rr, table.load, table.free, table.state,
                table.tasks, table.epoch, seq, ring.posting, _DISPATCH)
            if code < 0:  # no worker active, or the sampler is exhausted
                self._sampler_done = True
                return
            self._send_seq = seq + 1
            table.outstanding += 1
            if code != POSTED:  # the index is not a list of ints, or does not fit the slot
                self._submit(slot, wid, seq, index)

    def _next_task(self) -> tuple[int, int, Any] | None:
        """(worker, seq, index) of the epoch's next batch, or None when there is none."""
        wid = self._dispatcher.pick(self._table.load, self._num_workers * self._prefetch_factor)
        if wid is None:
            self._sampler_done = True
            return None
        try:
            index = next(self._sampler_iter)  # torch's _next_index, without its frame
        except StopIteration:
            self._sampler_done = True
            return None
        seq = self._send_seq
        self._send_seq += 1
        return wid, seq, index

    def _collect(self) -> None:
        """Take in DONE slots, one per semaphore token: results become ready, requests for
        overflow memory wait for a grant."""
        assert self._ring is not None
        taken, done = self._ring.collect()
        tokens = self._banked + taken
        self._banked = 0
        if not tokens:
            return
        headers = self._ring.headers
        table = self._table
        state = table.state
        for slot in list(table.tasks):  # in dispatch order: a worker's piped results come in it
            if state[slot] is not _IN_FLIGHT or not done[slot]:
                continue
            hdr = headers[slot]
            task = table.tasks[slot]
            if hdr[_R_SEQ] != task.seq or hdr[_R_EPOCH] != task.epoch:
                self._shutdown_workers()
                raise CorruptSlotError(
                    f"slot {slot} was published for task {hdr[_R_SEQ]} of epoch {hdr[_R_EPOCH]}, "
                    f"but holds task {task.seq} of epoch {task.epoch}: a torn or foreign write"
                )
            if hdr[_STATUS] == _NEED_MEMORY:
                if table.overflowed(slot, hdr[_NEEDED]) is None:
                    self._pool.send_memory(task.worker, slot, 0, -1)  # a stale epoch's batch: drop it
                else:
                    self._want_growth(hdr[_NEEDED])
            else:
                payload = None
                if hdr[_REGION] == _PIPE:
                    # the worker sends it after publishing: read it now, in the pipe's order
                    payload = self._pool.recv(task.worker, raw=True)
                    if payload is None:
                        continue  # it died mid-send: its tasks are dispatched again
                if table.done(slot) is None:
                    self._drop_overflow(slot)
                elif payload is not None:
                    self._piped[slot] = payload
            tokens -= 1
            if not tokens:
                break
        self._banked = tokens

    # ------------------------------------------------------------ overflow
    def _remember_batch_bytes(self, nbytes: int) -> None:
        """Rings made later (next epochs, when not persistent) start at this slot size."""
        self._batch_bytes = max(self._batch_bytes or 0, nbytes)
        loader = self._loader()
        if loader is not None:
            loader._shm_batch_bytes = self._batch_bytes

    def _want_growth(self, nbytes: int) -> None:
        """A batch (or index) of ``nbytes`` did not fit: grow the slots once the ring drains."""
        assert self._ring is not None
        target = grown_slot_bytes(nbytes)
        self._remember_batch_bytes(target)
        if self._growth_declined or target <= self._ring.geometry.data_bytes:
            return
        self._grow_to = max(self._grow_to or 0, target)

    def _grant(self) -> None:
        """Give waiting workers their overflow memory, lowest sequence number first, while
        ``memory_budget`` has room; the rest wait (backpressure). Under a budget with in-order
        delivery, a batch gets memory only once every batch before it has its memory or fits a
        slot, so the budget is never taken by a batch that cannot be delivered yet."""
        assert self._ring is not None
        table = self._table
        self._awaiting_room = False
        for slot in table.waiting():
            task = table.tasks[slot]
            if task.epoch != table.epoch:
                table.drop(slot)
                self._pool.send_memory(task.worker, slot, 0, -1)
                continue
            size = round_up(task.needed, PAGE)
            if self._memory_budget is not None and self._in_order and self._earlier_may_overflow(task.seq):
                return  # granting out of order could give an undeliverable later batch the room
            room = self._room_for(task.seq, size)
            if room is None:  # only the batches the caller holds could make room: a copy, not a hang
                self._ring.set_state(slot, IDLE)
                table.granted(slot)
                self._pool.send_memory(task.worker, slot, -1)
                continue
            if not room:
                self._awaiting_room = True
                return
            fd, mm = self._arena.allocate(size)
            try:
                if self.pinned:
                    _device.register_host(mm, size)
                self._ring.set_state(slot, IDLE)  # before the worker can publish again
                table.granted(slot)
                self._overflow[slot] = (mm, size)
                self._pool.send_memory(task.worker, slot, size, fd)
            finally:
                os.close(fd)

    def _earlier_may_overflow(self, seq: int) -> bool:
        """Whether a task of this epoch before ``seq`` is still being made without overflow
        memory (it may yet ask for some)."""
        table = self._table
        return any(
            table.state[slot] is SlotState.IN_FLIGHT and slot not in self._overflow
            and task.epoch == table.epoch and task.seq < seq
            for slot, task in table.tasks.items()
        )

    def _room_for(self, seq: int, size: int) -> bool | None:
        """Whether ``memory_budget`` has room for ``size`` more bytes now. None when it has not
        and only the caller could make room (the batches it holds) while it waits for this very
        batch: that batch then comes as a pickled copy. Raises when it never will have room
        (the batch is larger than the budget leaves beside the ring)."""
        budget = self._memory_budget
        if budget is None:
            return True
        assert self._ring is not None
        g = self._ring.geometry
        if g.total_bytes + size > budget:
            raise MemoryBudgetError(
                f"batch {seq} needs {size:,} bytes, more than memory_budget={budget:,} leaves beside the "
                f"ring ({g.total_bytes:,} bytes: {g.num_slots} slots of {g.data_bytes:,}). Raise "
                f"memory_budget to at least {g.total_bytes + size:,}, or use smaller batches."
            )
        if g.total_bytes + self._arena.in_use + size <= budget:
            return True
        table = self._table
        if self._in_order:
            wanted_next = seq == self._rcvd_seq
        else:  # nothing else can arrive: a worker that waits for memory makes no other batch
            blocked = {table.tasks[s].worker for s in table.waiting()}
            unblocked = any(w not in blocked for w in range(self._num_workers))
            moving = any(table.state[s] is SlotState.IN_FLIGHT and t.worker not in blocked for s, t in table.tasks.items())
            can_dispatch = table.free and not self._sampler_done and self._grow_to is None and unblocked
            wanted_next = not table.ready and not moving and not can_dispatch
        return None if wanted_next and not self._overflow and self._stager is None else False

    def _overflow_where(self, slot: int) -> Where | None:
        granted = self._overflow.get(slot)
        return None if granted is None else (granted[0], 0, granted[1])

    def _drop_overflow(self, slot: int) -> None:
        granted = self._overflow.pop(slot, None)
        if granted is not None:
            self._arena.free(granted[1])

    def _grow(self) -> Generator[tuple[Any, ...], None, None]:
        """Replace the drained ring by one with larger slots; every worker attaches to it. Under
        memory_budget only when the new ring, and room for one batch to overflow, fit beside
        what is still held (the old ring while the user views it); otherwise overflow keeps
        carrying large batches."""
        old = self._ring
        assert old is not None and self._grow_to is not None
        size, self._grow_to = self._grow_to, None
        g = RingGeometry(self._num_workers, self._table.num_slots, size)
        held = old.geometry.total_bytes if self._leases.holding() else 0
        # Under memory_budget, only with room left beside it for a batch of that size to
        # overflow: a grown ring that fills the budget would make the next larger batch an error.
        if self._memory_budget is not None and g.total_bytes + size + held + self._arena.in_use > self._memory_budget:
            self._growth_declined = True
            return
        ring = Ring(g)
        try:
            if self.pinned:
                _device.register_host(ring.mm, g.total_bytes)
        except BaseException:
            ring.close()
            raise
        # The new ring is the iterator's from here on, with its slot table, leases and one-tensor
        # view, in one step (nothing was in flight: the old ring drained). A worker replaced from
        # here on inherits it. The old ring is closed whatever happens next.
        self._ring, self._leases = ring, Leases()
        self._table = SlotTable(g.num_slots, self._num_workers, self._table.epoch)
        self._lone = None if self._iterable else lone_args(ring, g.num_slots)
        self._attaching = dict(enumerate(self._pool.procs))
        try:
            for wid in range(self._num_workers):
                # One that died already (unseen: liveness is checked before sleeping) is replaced
                # by _await_attached's _check, on the new ring: it is then no longer waited for.
                self._pool.send(wid, ("ring", -1, ring.geometry), ring.fd, dead_ok=True)
                old.push_task(wid, RESIZE_TASK)
        finally:
            old.close()
            if held:
                self._arena.retire(old.mm, held)
            self._counters.ring_growths += 1
        yield from self._await_attached()

    # ------------------------------------------------------------ delivery
    def _take_next(self) -> int | None:
        """The slot of the next batch to yield, skipping exhausted shards; raises worker errors."""
        assert self._ring is not None
        table = self._table
        while table.ready:
            if self._in_order:
                if self._rcvd_seq not in table.ready:
                    return None
                seq = self._rcvd_seq
                self._rcvd_seq += 1
            else:
                seq = min(table.ready)
            slot = table.take(seq)
            hdr = self._ring.headers[slot]
            status = hdr[_STATUS]
            if status == _OK:
                return slot
            table.give_back(slot)
            if status == Status.STOP:
                self._dispatcher.active[hdr[Field.WORKER]] = False
                continue
            self._fail(slot, status)
        return None

    def _fail(self, slot: int, status: int) -> None:
        """Raise the result of ``slot``: a batch's error (the loader goes on, as torch's does), or
        one that ends the loader (worker_init_fn failed, an unknown status)."""
        assert self._ring is not None
        self._drop_overflow(slot)
        if status == Status.ERROR or status == Status.INIT_ERROR:
            error = pickle.loads(read_pickled(self._ring, slot))
            if status == Status.ERROR:
                self._batch_failed()
            else:
                self._shutdown_workers()
            raise_worker_error(error)
        self._shutdown_workers()
        raise CorruptSlotError(f"slot {slot}: unknown result status {status}")

    def _batch_failed(self) -> None:
        self._raising_batch_error = True
        self._failed_batches += 1

    def _pop_staged(self) -> Any:
        assert self._stager is not None
        batch, note = self._stager.pop()
        self._delivered(note)
        self._counters.batches += 1
        return batch

    def _note(self, slot: int) -> tuple[int, bytes] | None:
        """For an IterableDataset: which worker made this batch and its dataset's state after it."""
        if not self._iterable:
            return None
        assert self._ring is not None
        return int(self._ring.headers[slot][Field.WORKER]), read_dataset_state(self._ring, slot, self._overflow_where(slot))

    def _delivered(self, note: tuple[int, bytes] | None) -> None:
        if note is not None:
            self.last_worker = note[0]
            if note[1]:
                self.dataset_states[note[0]] = note[1]

    def _deliver(self, slot: int) -> Any:
        assert self._ring is not None
        piped = self._piped.pop(slot, None) if self._piped else None
        if piped is not None:
            self._table.give_back(slot)
            batch, state = pickle.loads(piped)
            if self._iterable:
                self._delivered((int(self._ring.headers[slot][Field.WORKER]), state))
            self._counters.batches += 1
            self._counters.copies += 1
            return batch
        if self._iterable:
            self._delivered(self._note(slot))
        where = self._overflow_where(slot) if self._overflow else None
        if where is not None:
            # The batch lies in its own overflow memory: the slot is free at once, the memory
            # once the batch's last view is dropped.
            self._overflow.pop(slot)
            self._table.give_back(slot)
            try:
                batch, base, nbytes = read_batch(self._ring, slot, None, where)
            except BaseException:
                self._arena.free(where[2])
                raise
            self._arena.lend(base, where[2])
            self._counters.overflow_batches += 1
        else:
            # Never lend the last slot: a caller that keeps every batch (list(loader), a
            # replay buffer) would leave the workers nowhere to write. Copy instead.
            leases = self._leases
            last = self._table.num_slots - 1  # lent slots before this one that leave none to the workers
            copy = len(leases.bases) >= last and leases.holding() >= last
            try:
                batch, base, nbytes = read_batch(self._ring, slot, copy_leaf if copy else None)
            except BaseException:
                self._table.give_back(slot)
                raise
            if copy:
                self._counters.copies += 1
                del base
                self._table.give_back(slot)
            else:
                leases.lend(slot, base)
        counters = self._counters
        counters.batches += 1
        counters.bytes += nbytes
        return batch

    # --------------------------------------------------------------- sync
    def __next__(self) -> Any:
        if _profiler._is_profiler_enabled:
            return super().__next__()
        # torch's __next__ without the record_function scope, which costs more than
        # a small batch's whole transport when no profiler is listening.
        if (self._lone is None or not self._started or self._shutdown or not self._in_order or self._overflow
                or self._stager is not None or self._pending_error is not None or self._timeout > 0
                or self._attaching):
            data = self._next_data()
            self._count_yield()
            return data
        # The steady state's common case in one frame: _next_data and _steady (their accounting,
        # take, dispatch and lend_lone; the waits are _dispatch_and_wait's) without the calls
        # between them. What it does not finish (anything out of the ordinary) _next_data does,
        # from where it stopped.
        asked = time.perf_counter()
        table = self._table
        leases = self._leases
        ring = self._ring
        assert ring is not None
        if leases.released or table.waiting_count or self._grow_to is not None:
            return self._next_general(asked)
        try:
            while True:
                slot, self._banked, gone = _native.steady_take(
                    ring.mm, ring.ready_sem, ring.header_offsets, self._banked, table.tasks, table.state,
                    table.ready, table.load, table.free, leases.bases, table.epoch, self._rcvd_seq, _STEADY)
                table.outstanding -= gone
                # A slot taken, or one for the general path: done here. Nothing ready in order
                # yet: wait as _steady does, then look again (a round's case: _next_data's).
                if slot != _NOT_READY or not self._dispatch_and_wait():
                    break
        except BaseException as exc:
            if (instead := self._failed(exc)) is not None:
                raise instead from None  # a worker's StopIteration ends the loop, as in torch's loader
            raise
        if slot < 0:
            return self._next_general(asked)
        counters = self._counters
        counters.requested(asked)
        try:
            self._awaiting_room = False
            data = self._hand_out(slot)
        except BaseException as exc:
            if (instead := self._failed(exc)) is not None:
                raise instead from None  # a worker's StopIteration ends the loop, as in torch's loader
            raise
        finally:
            counters.returned(asked)
        self._num_yielded += 1  # (_count_yield's warning is for an IterableDataset: never here)
        return data

    def _next_general(self, asked: float) -> Any:
        data = self._next_data(asked)
        self._count_yield()
        return data

    def _count_yield(self) -> None:
        """torch's bookkeeping after a batch is handed out (sync and async alike)."""
        self._num_yielded += 1
        if self._iterable and self._IterableDataset_len_called is not None and (
            self._num_yielded > self._IterableDataset_len_called
        ):
            warnings.warn(
                f"Length of IterableDataset {self._dataset} was reported to be "
                f"{self._IterableDataset_len_called}(when accessing len(dataloader)), but "
                f"{self._num_yielded} samples have been fetched. For multiprocessing data-loading, this "
                "could be caused by not properly configuring the IterableDataset replica at each worker.",
                stacklevel=4,
            )

    def _next_data(self, asked: float | None = None) -> Any:
        asked = self._counters.requested(asked)
        try:
            # The steady state (started, running, nothing staged or pending): in order, _steady
            # (its waits included); otherwise one _round. The generator only when they say so.
            looked = (self._started and not self._shutdown and self._stager is None and self._pending_error is None
                      and not self._attaching)
            result = _NOTHING
            if looked:
                self._deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
                result = self._steady() if self._in_order else self._round()
            if result is _NOTHING or result is _GROW:
                steps = self._steps(looked and result is _NOTHING)
                request = next(steps)
                while True:
                    self._block(request)
                    request = next(steps)
        except StopIteration as stop:
            result = stop.value
        except BaseException as exc:
            if (instead := self._failed(exc)) is not None:
                raise instead from None  # a worker's StopIteration ends the loop, as in torch's loader
            raise
        finally:
            self._counters.returned(asked)
        if result is _END:
            self._counters.epoch_ended()
            raise StopIteration
        return result

    def _failed(self, exc: BaseException) -> StopIteration | None:
        """``exc`` leaves ``next()``: one batch's error leaves the loader running; anything else
        stops the workers, and later ``next()`` calls say why. Returns the StopIteration to
        raise instead when ``exc`` is one batch's and carries one (StopCarrier), else None
        (raise ``exc``)."""
        if self._raising_batch_error:
            self._raising_batch_error = False
            return exc.stop if isinstance(exc, StopCarrier) else None
        if self._fatal is None:
            self._fatal = exc
        self._shutdown_workers()
        return None  # (an error that ends the loader never ends a loop in silence)

    def _block(self, request: tuple[Any, ...]) -> None:
        began = time.perf_counter()
        try:
            self._wait_for(request)
        finally:
            self._counters.blocked_s += time.perf_counter() - began

    def _wait_for(self, request: tuple[Any, ...]) -> None:
        if request is _COPY:
            assert self._stager is not None
            self._copied(self._stager.reap(block=True))
        elif request is _READY:
            assert self._ring is not None
            if self._yield_for_ready():
                return
            self._check()  # only before sleeping: a batch that came while yielding needs no waitpid
            if self._ring.take_ready(self._sleep_s()):  # a signal's handler (Ctrl-C) raises through it
                self._banked += 1
        else:
            conns = [self._pool.conns[w] for w in request[1]]
            mp_connection.wait(conns + self._pool.sentinels, self._sleep_s())

    def _sleep_s(self) -> float:
        """How long a sync wait may sleep before it looks again: CHECK_S (worker deaths are
        seen within it), never past the user's ``timeout``."""
        if self._deadline is None:
            return CHECK_S
        return max(0.0, min(CHECK_S, self._deadline - time.monotonic()))

    def _yield_for_ready(self) -> bool:
        """Before sleeping on the ready semaphore, yield the CPU and look again (``YieldWait``);
        a token taken so is banked for ``_collect``."""
        ring = self._ring
        assert ring is not None
        if self.yields(ring.mm, ring.ready_sem):
            self._banked += 1
            return True
        return False

    # -------------------------------------------------------------- async
    def __aiter__(self) -> RingIterator:
        return self

    async def __anext__(self) -> Any:
        asked = self._counters.requested()
        steps = self._steps()
        try:
            request = next(steps)
            while True:
                await self._await(request)
                request = next(steps)
        except StopIteration as stop:
            result = stop.value
        except asyncio.CancelledError:
            if not self._started:  # cancelled mid start-up: the handshake cannot resume
                self._shutdown_workers()
            raise
        except BaseException as exc:
            if (instead := self._failed(exc)) is not None:
                raise StopAsyncIteration from instead  # as a sync loop ends at a worker's StopIteration
            raise
        finally:
            self._counters.returned(asked)
        if result is _END:
            self._counters.epoch_ended()
            raise StopAsyncIteration
        self._count_yield()
        return result

    async def _await(self, request: tuple[Any, ...]) -> None:
        began = time.perf_counter()
        try:
            await self._await_for(request)
        finally:
            self._counters.blocked_s += time.perf_counter() - began

    async def _await_for(self, request: tuple[Any, ...]) -> None:
        if request is _COPY:
            await self._await_copy()
            return
        loop = asyncio.get_running_loop()
        ring = None
        if request is _READY:
            self._check()
            ring = self._ring
            assert ring is not None
            ring.want_doorbell(True)  # workers ring the doorbell only while we wait on it
            self._doorbell.drain()  # before the last look, so a post after the look still wakes us
            if ring.take_ready(0):
                ring.want_doorbell(False)
                self._banked += 1
                return
            fds = [self._doorbell.fd]
        else:
            fds = [self._pool.conns[w].fileno() for w in request[1]]
        fds += self._pool.sentinels
        woken = loop.create_future()

        def wake() -> None:
            if not woken.done():
                woken.set_result(None)

        for fd in fds:
            loop.add_reader(fd, wake)
        timer = None
        if self._deadline is not None:
            timer = loop.call_at(loop.time() + max(0.0, self._deadline - time.monotonic()), wake)
        try:
            await woken
        finally:
            for fd in fds:
                loop.remove_reader(fd)
            if timer is not None:
                timer.cancel()
            if ring is not None and not self._shutdown:
                ring.want_doorbell(False)

    async def _await_copy(self) -> None:
        """Wait for the oldest device copy without blocking the event loop: its CUDA event is
        queried from the loop, at intervals that grow from 50 µs to 2 ms (a copy of a large
        batch takes milliseconds; a small one is seen at once). Dead workers and the timeout
        are checked meanwhile."""
        stager = self._stager
        assert stager is not None
        delay = 50e-6
        while stager.copying and not stager.copying[0][0].query():
            self._check()
            await asyncio.sleep(delay)
            delay = min(2 * delay, 2e-3)

    # ------------------------------------------------------------ release
    def release(self, batch: Any) -> int:
        """Return the slots that ``batch`` views to the ring now. Returns how many."""
        if self._ring is None:
            return 0
        views = [(slot, leaf) for leaf in leaves_of(batch) if (slot := slot_of(self._ring, leaf)) is not None]
        return self._leases.release_views(views)

    def holding(self) -> int:
        return self._leases.holding()

    def occupancy(self) -> RingOccupancy | None:
        if self._ring is None:
            return None
        held = self._leases.holding()
        copying = 0 if self._stager is None else len(self._stager.copying)
        table = self._table
        in_flight = table.count(SlotState.IN_FLIGHT) + table.count(SlotState.WAITING)
        ready = len(table.ready) + copying
        return RingOccupancy(
            slots=table.num_slots,
            slot_bytes=self._ring.geometry.data_bytes,
            free=table.num_slots - held - in_flight - ready,
            in_flight=in_flight,
            ready=ready,
            held=held,
        )

    def worker_busy(self) -> tuple[float, ...]:
        if self._ring is None:
            return ()
        now = time.monotonic_ns()
        busy = []
        for c in self._ring.counters:
            started, spent = int(c[Counter.STARTED_NS]), int(c[Counter.BUSY_NS])
            busy.append(min(1.0, spent / (now - started)) if started and now > started else 0.0)
        return tuple(busy)

    # ----------------------------------------------------------- shutdown
    def _shutdown_workers(self) -> None:
        if self._shutdown:
            return
        self._shutdown = True
        try:
            if self._stager is not None:
                self._stager.stream.synchronize()  # no DMA may outlive the mapping it reads
            self._pool.stop(self._ring)
        finally:
            if self._ring is not None:
                self._ring.close()
            self._doorbell.close()

    def __del__(self) -> None:
        last_words = getattr(self, "last_words", None)
        if last_words is not None:
            self.last_words = None
            last_words(self)
        if not getattr(self, "_shutdown", True):
            self._shutdown_workers()
