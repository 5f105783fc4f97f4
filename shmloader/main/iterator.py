"""The main process's iterator: torch's iterator protocol over the ring, and its error policy.

``RingIterator`` is a facade. What it holds, each owned by one collaborator:

- ``_sched`` (``main.scheduler.Scheduler``, native): every slot's state, the epoch's tasks, the
  dispatch cursor, sequence numbers, banked tokens; its ``step`` is the per-batch path;
- ``_broker`` (``main.overflow.OverflowBroker``): when overflow memory is granted under
  ``memory_budget``, and growth;
- ``_delivery`` (``main.delivery.Delivery``): from a taken slot to the user's batch, worker snapshots;
- ``_life`` (``main.lifecycle.Lifecycle``): the workers, the doorbell, and the current ring's
  scope (``_life.scope``, a ``main.scope.RingScope``: the ring and everything tied to it: leases,
  overflow grants, the device stager): start, grow, replacement, shutdown;
- ``_waiter`` (``main.wait.Waiter``): sync and async waits.

The logic of one ``next()`` is the generator ``_steps``: it yields a *wait request*
(``main.wait.Ready``, ``Copy``, ``Conns``) whenever nothing is ready; ``for``
(``__next__``) and ``async for`` (``__anext__``) are two thin drivers that fulfil requests
(``Waiter.block``, ``Waiter.wait``) and resume it. Each of its passes is ``_round``, which never
waits: one ``Scheduler.step`` per batch in the steady state, whose events (a request for
overflow memory, a batch over the pipe, an error, an end of shard) ``_on_event`` handles. A
``next()`` whose batch is ready runs one ``_round`` before making the generator: the same
path, with an early exit. "Nothing yet" is the private ``_NOTHING``, never a user's value.
"""

from __future__ import annotations

import asyncio
import pickle
import time
from typing import Any, Callable, Generator

import torch
import torch.autograd.profiler as _profiler
from torch.utils.data.dataloader import _BaseDataLoaderIter

from shmloader import _checkpoint, _sampler_position, _state_layout
from shmloader._errors import (
    CorruptSlotError,
    StopCarrier,
    WorkerReplacedWarning,
    raise_worker_error,
    warn_iterable_len,
)
from shmloader._stats import Counters, RingOccupancy, occupancy
from shmloader._torch_private import is_iterable, iterator_parts
from shmloader.main.delivery import Delivery
from shmloader.main.depth import DEFAULT, Depth, Watch
from shmloader.main.dispatch import batches_of
from shmloader.main.lease import leaves_of, read_pickled, slot_of
from shmloader.main.lifecycle import Lifecycle, RingSettings
from shmloader.main.overflow import OverflowBroker
from shmloader.main.resume import RingCheckpoint
from shmloader.main.scheduler import Scheduler, Step
from shmloader.main.scope import RingScope
from shmloader.main.wait import Copy, Ready, Request, Waiter, interrupted
from shmloader.wire.layout import Field, Status
from shmloader.wire.ring import Ring
from shmloader.worker.produce import has_state, worker_configs

PARENT_CHECK_S = 0.5  # how often an idle worker checks that this process lives
# Private answers of the iterator's steps, never a user's value (a batch may be None, 0, [] ...)
_NOTHING = object()  # nothing ready yet
_END = object()  # the epoch has ended
_GROW = object()  # the ring must grow before anything else is dispatched
_COPY = object()  # only a device copy's completion moves on
_NOT_READY = int(Step.NOT_READY)

class RingIterator(RingCheckpoint, _BaseDataLoaderIter):
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
        self._counters: Counters = loader._shm_counters
        self._iterable = is_iterable(self)
        self._deadline: float | None = None
        self._pending_error: Exception | None = None  # a batch's error, raised after the batches staged before it
        # The exception on its way out of next() that leaves the loader running (one batch's error,
        # a timeout, a replacement said as an error): any other one stops it (_failed)
        self._goes_on: BaseException | None = None
        self._failed_batches = 0  # batches of this epoch that raised instead (a checkpoint counts them consumed)
        self._fatal: BaseException | None = None  # what stopped the workers before the epoch ended
        depth: Depth = loader._shm_depth
        depth.begin(loader.prefetch_factor)
        cap = self._num_workers * depth.prefetch  # tasks at once (torch's bound); memory_budget may give fewer slots
        self._sched = Scheduler(cap, self._num_workers, cap, in_order=loader.in_order)
        self._watch = Watch(depth, self._counters)
        in_flight = self._num_workers * (depth.prefetch if depth.given else DEFAULT)  # torch's, given or not
        self._broker = OverflowBroker(loader._shm_memory, loader._shm_memory_budget, loader.in_order, in_flight)
        plan: _state_layout.Plan | None = loader._shm_resume_plan
        self._delivery = Delivery(self._sched, self._broker, self._counters, self._iterable or has_state(self._dataset),
                                  seqs=not loader.in_order and not self._iterable)  # (consumed: not a prefix)
        configs = worker_configs(iterator_parts(self), loader.worker_init_fn, int(self._base_seed), PARENT_CHECK_S,
                                 _checkpoint.snapshots_of(plan))
        settings = RingSettings(
            loader.multiprocessing_context or torch.multiprocessing, configs, loader.slot_bytes,
            depth, loader._shm_memory_budget,
            self._pin_memory_device if self._pin_memory else None,  # (torch's: the accelerator, if any)
            loader._shm_device, loader.device_prefetch, loader.max_worker_restarts)
        self._life = Lifecycle(settings, self._sched, self._delivery, self._broker, self._counters)
        self._waiter = Waiter(self._life, self._counters)
        # (in_order=False: always its state now; batches made again after a snapshot would not be
        # the ones consumed, whichever came first)
        self._every = getattr(loader, "snapshot_every_n_steps", 1) if loader.in_order else 1
        self.after_replay: Callable[[], None] | None = None  # (a resume's: _checkpoint calls it)
        if plan is not None and plan.finished and not self._iterable:
            _sampler_position.carry_sampler(self._index_sampler, plan)  # (persistent workers' next epoch)
        self._reset(loader, first_iter=True)
        if plan is not None:
            self._resume(loader, plan)
        self._snapshots = _checkpoint.Snapshots(self._every, self)

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        super()._reset(loader, first_iter)
        batches = batches_of(self._index_sampler, self._sampler_iter)
        self._sampler_iter = _sampler_position.pulled_from(self._index_sampler, batches, self._iterable, self)
        self._pulled_before = 0  # batches of indices a resume drew before this iterator's first dispatch
        self._drawn = (0, False)  # (what a resume's positioning drew, to the sampler's end or not)
        self.finished = False  # this epoch's StopIteration was raised
        self._failed_batches = 0
        self._pending_error = None  # (an error staged behind batches of an epoch left early is that epoch's)
        self._goes_on = None
        if not first_iter:
            self._sched.new_epoch()  # ready results dropped, the dispatch cursor and sequence numbers anew
            self._broker.new_epoch(self._life.scope)
            self._delivery.new_epoch(self._life.scope)
            self._snapshots = _checkpoint.Snapshots(self._every, self)

    @property
    def shut_down(self) -> bool:
        return self._life.stopped

    @property
    def ring(self) -> Ring | None:
        """The ring this iterator's workers write into (None before the first batch)."""
        scope = self._life.scope
        return None if scope is None else scope.ring

    # ------------------------------------------------------ the one path
    def _steps(self, first: Any = None) -> Generator[Request, None, Any]:
        """The logic of one ``next()``. ``first``: what a ``_round`` just returned when the
        caller ran one (the early exit of a ready ``next()``), processed as this loop's first."""
        if first is None:
            scope = self._life.scope
            if scope is not None and scope.stager is not None and scope.stager.staged:
                return self._delivery.pop_staged(scope.stager)  # batches staged before an error or shutdown come first
            if self._pending_error is not None:
                error, self._pending_error = self._pending_error, None
                self._goes_on = error
                raise error
            if self._life.stopped:
                if self._fatal is not None:  # never a silent end of the epoch
                    raise RuntimeError(
                        f"this DataLoader iterator stopped after an earlier error ({type(self._fatal).__name__}: "
                        f"{self._fatal}); start a new epoch with iter(loader)"
                    ) from self._fatal
                return _END
            self._deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
            if not self._life.started and not self._sched.exhausted:
                yield from self._start()
            if self._life.attaching:  # a grown ring's wait, cancelled in an async for: before any connection is read
                yield from self._life.await_attached(self._check)
        while True:
            result = self._round() if first is None else first
            first = None
            if result is not _NOTHING and result is not _COPY and result is not _GROW:
                return result
            scope = self._life.scope
            assert scope is not None  # (_round answers _END until a ring exists)
            if result is _GROW:
                yield from self._life.grow(scope, self._check)
                continue
            stager = scope.stager
            if result is _COPY or (stager is not None and stager.copying and not self._sched.n_free):
                # Every slot is copying or staged (or the epoch ends with copies running): only
                # a copy's completion moves on. Waited for without blocking an event loop.
                self._check()
                yield Copy(scope)
                continue
            yield Ready(scope)  # whoever waits checks dead workers and the timeout before it blocks

    def _round(self) -> Any:
        """One pass that never waits: the scheduler's step (slots back, results collected, tasks
        dispatched, the next batch taken) and what its events ask; then the batch, ``_END``,
        ``_GROW`` (the ring must grow first), ``_COPY`` (wait for a device copy) or ``_NOTHING``."""
        sched, delivery = self._sched, self._delivery
        scope = self._life.scope
        if scope is not None:
            broker, leases = self._broker, scope.leases
            if leases.released:
                for slot in leases.take_released():
                    sched.give_back(slot)
            stager = scope.stager
            if stager is not None:
                scope.reap()
            if sched.waiting_count:  # (after the reaped copies gave their grants back)
                broker.grant(scope)
            if self._counters.batches >= self._watch.at:
                cap = self._watch.look(scope.ring)
                if cap is not None:
                    self._life.deepen(scope, cap)
            while True:
                # (with the device stager full, only slots back, results in and tasks out)
                room = stager is None or stager.has_room()
                got = sched.step(leases.bases, self._sampler_iter, broker.grow_to is None, room)
                if sched.has_unposted:
                    self._life.post_unposted(scope)
                if got >= 0:
                    if stager is None:
                        return delivery.deliver(scope, got)
                    delivery.stage(scope, got)
                elif got == _NOT_READY:
                    break
                elif stager is None or not stager.staged:
                    self._on_event(scope, got)
                else:
                    try:
                        self._on_event(scope, got)
                    except Exception as error:
                        if error is not self._goes_on:
                            raise
                        self._goes_on = None
                        self._pending_error = error  # raised in its turn, after the staged batches
                        break
            if sched.waiting_count:  # (grants the step's events dropped: stale epochs, errors)
                broker.grant(scope)
            if broker.grow_to is not None and not sched.n_tasks and not (stager and stager.copying):
                return _GROW
            if stager is not None and stager.staged:
                return delivery.pop_staged(stager)
        if sched.exhausted and not sched.outstanding and not sched.n_ready:
            if not self._persistent_workers:
                if scope is not None and scope.stager is not None and scope.stager.copying:
                    return _COPY  # shutting down waits for them: let them finish first
                self._shutdown_workers()
            return _END
        return _NOTHING

    def _on_event(self, scope: RingScope, code: int) -> None:
        """What ``Scheduler.step`` stopped at, for slot ``sched.event``."""
        sched, ring = self._sched, scope.ring
        slot = sched.event
        hdr = ring.headers[slot]
        if code == Step.NEED_MEMORY:
            self._broker.requested(scope, slot, hdr[Field.NEEDED], bool(hdr[Field.OWN]))
        elif code == Step.PIPE:
            self._delivery.piped_in(scope, slot)
        elif code == Step.STALE:
            scope.drop(slot)
        elif code == Step.TORN:
            task = sched.task_of(slot)
            error = CorruptSlotError(
                f"slot {slot} was published for task {hdr[Field.R_SEQ]} of epoch {hdr[Field.R_EPOCH]}, "
                f"but holds task {task and task.seq} of epoch {task and task.epoch}: a torn or foreign write"
            )
            self._shutdown_workers()  # (after the header is read: shutting down gives its memory back)
            raise error
        elif code == Step.RESULT:  # taken, and not a batch: an end of shard, or an error
            status = hdr[Field.STATUS]
            if status == Status.STOP:  # with the worker's snapshot then, where it fit the slot
                worker = int(hdr[Field.WORKER])
                self._delivery.shard_ended(worker, read_pickled(ring, slot) if hdr[Field.PICKLED_LEN] else b"")
                sched.give_back(slot)
                sched.end_shard(worker)
                return
            consumed = self._delivery.consumed
            if consumed is not None:
                consumed.add(int(hdr[Field.R_SEQ]))
            sched.give_back(slot)
            scope.drop(slot)
            if status == Status.ERROR or status == Status.INIT_ERROR:  # (a failed worker_init_fn fails each
                error = pickle.loads(read_pickled(ring, slot))       # of its worker's batches: worker.loop)
                raise_worker_error(error, self._batch_failed)  # the loader goes on, as torch's does
            self._shutdown_workers()
            raise CorruptSlotError(f"slot {slot}: unknown result status {status}")
        else:
            raise AssertionError(f"Scheduler.step answered {code}")

    def _batch_failed(self, error: BaseException) -> None:
        """``error`` is one batch's: raised, and the loader goes on."""
        self._goes_on = error
        self._failed_batches += 1

    # ------------------------------------------------- start and workers
    def _start(self) -> Generator[Request, None, None]:
        batch_bytes = self._broker.memory.batch_bytes  # (an earlier iterator's measure: no probe)
        yield from self._life.start(self._sampler_iter, batch_bytes, self._check, self._batch_failed)

    def _check(self) -> None:
        """Replace dead workers (or raise); raise if the user's ``timeout`` has passed."""
        for wid in self._life.pool.dead():
            try:
                self._life.recover(wid, self._iterable and not has_state(self._dataset))
            except WorkerReplacedWarning as said:  # (made an error: raised once the worker is replaced; it goes on)
                self._goes_on = said
                raise
        if self._deadline is not None and time.monotonic() >= self._deadline:
            # torch's: raised at the deadline, and the iterator goes on (the next next() waits
            # for the same batch again): nothing is stopped first, nothing is lost.
            self._goes_on = RuntimeError(f"DataLoader timed out after {self._timeout} seconds")
            raise self._goes_on

    # --------------------------------------------------------------- sync
    def __next__(self) -> Any:
        if _profiler._is_profiler_enabled:
            with _profiler.record_function(self._profile_name):  # torch's scope, when a profiler listens
                return self._yielded(self._next_data())
        # (the scope costs more than a small batch's whole transport when no profiler listens)
        return self._yielded(self._next_data())

    def _yielded(self, data: Any) -> Any:
        """``data`` leaves ``next()`` (or ``anext()``): torch's count and an IterableDataset's
        length warning, then the step a snapshot every n steps counts."""
        self._num_yielded += 1
        if self._iterable and (said := self._IterableDataset_len_called) is not None and self._num_yielded > said:
            warn_iterable_len(self._dataset, said, self._num_yielded)
        if self._every != 1:
            self._snapshots.stepped(self, self._num_yielded + self._failed_batches)
        return data

    def _next_data(self) -> Any:
        counters = self._counters
        asked = counters.requested()
        try:
            # The early exit: a started, running iterator with nothing staged, pending or timed
            # runs one round; the generator only when that round found nothing (or more to do).
            life = self._life
            steady = (life.started and not life.stopped and life.scope is not None and life.scope.stager is None
                      and self._pending_error is None and not life.attaching and not self._timeout)
            result = self._round() if steady else _NOTHING
            if result is _NOTHING or result is _GROW or result is _COPY:
                steps = self._steps(result if steady else None)  # (goes on from that round's result)
                request = next(steps)
                block, check = self._waiter.block, self._check
                while True:
                    block(request, check, self._deadline)
                    request = next(steps)
        except StopIteration as stop:
            result = stop.value
        except BaseException as exc:
            if (instead := self._failed(exc)) is not None:
                raise instead from None  # a worker's StopIteration ends the loop, as in torch's loader
            raise
        finally:
            counters.returned(asked)
        if result is _END:
            counters.epoch_ended()
            self.finished = True
            raise StopIteration
        return result

    def _failed(self, exc: BaseException) -> StopIteration | None:
        """``exc`` leaves ``next()``: one batch's error leaves the loader running; anything else
        stops the workers, and later ``next()`` calls say why. Returns the StopIteration to
        raise instead when ``exc`` is one batch's and carries one (StopCarrier), else None
        (raise ``exc``)."""
        if exc is self._goes_on:
            self._goes_on = None
            return exc.stop if isinstance(exc, StopCarrier) else None
        if self._fatal is None:
            self._fatal = exc
        self._shutdown_workers()
        return None  # (an error that ends the loader never ends a loop in silence)

    # -------------------------------------------------------------- async
    def __aiter__(self) -> RingIterator:
        return self

    async def __anext__(self) -> Any:
        asked = self._counters.requested()
        steps = self._steps()
        try:
            request = next(steps)
            while True:
                await self._waiter.wait(request, self._check, self._deadline)
                request = next(steps)
        except StopIteration as stop:
            result = stop.value
        except asyncio.CancelledError:
            # At a wait: what it waited for is kept (start-up, growth, ready slots), and the next
            # anext goes on. But Ctrl-C stops the workers, as it does a sync loop's.
            if interrupted():
                self._failed(KeyboardInterrupt())
            raise
        except BaseException as exc:
            if (instead := self._failed(exc)) is not None:
                raise StopAsyncIteration from instead  # as a sync loop ends at a worker's StopIteration
            raise
        finally:
            self._counters.returned(asked)
        if result is _END:
            self._counters.epoch_ended()
            self.finished = True
            raise StopAsyncIteration
        return self._yielded(result)

    # ------------------------------------------------- the user's view
    def release(self, batch: Any) -> int:
        """Return the slots that ``batch`` views to the ring now. Returns how many."""
        scope = self._life.scope
        if scope is None:
            return 0
        views = [(slot, leaf) for leaf in leaves_of(batch) if (slot := slot_of(scope.ring, leaf)) is not None]
        return scope.leases.release_views(views)

    def held_count(self) -> int:
        """How many slots the user holds right now."""
        scope = self._life.scope
        return 0 if scope is None else scope.leases.viewed_count()

    def occupancy(self) -> RingOccupancy | None:
        scope = self._life.scope
        if scope is None:
            return None
        stager = scope.stager
        return occupancy(self._sched, scope.ring.geometry.data_bytes, scope.leases.viewed_count(),
                         0 if stager is None else len(stager.copying))

    def worker_busy(self) -> tuple[float, ...]:
        return self._life.worker_busy()

    # ----------------------------------------------------------- shutdown
    def _shutdown_workers(self) -> None:
        life = getattr(self, "_life", None)
        if life is not None:
            life.shutdown()

    def __del__(self) -> None:
        last_words = getattr(self, "last_words", None)
        life = getattr(self, "_life", None)
        try:
            if last_words is not None and not (life is not None and life.at_exit):
                self.last_words = None
                last_words(self)
        finally:
            self._shutdown_workers()
