"""The ring's lifecycle (main process): the workers, the segment, and every change of either.

``Lifecycle`` owns the worker pool, the doorbell, and the current ring's scope
(``main.scope.RingScope``: the ring and everything tied to it). It starts an iterator's ring
(the first batch probed to size the slots, the segment created and pinned, every worker
attached), grows it when batches outgrow its slots (a new scope, swapped whole), replaces dead
workers, and shuts everything down.

Generators here yield wait requests (``main.wait.Conns(workers)``) as the iterator's steps do,
and take ``check``: the iterator's look at dead workers and the timeout.
"""

from __future__ import annotations

import atexit
import functools
import re
import warnings
import weakref
from typing import Any, Callable, Generator, NamedTuple

import torch

from shmloader._errors import (
    SharedMemoryWarning,
    ShmLoaderError,
    WorkerDiedError,
    WorkerReplacedWarning,
    raise_worker_error,
    user_stacklevel,
)
from shmloader._stats import Counters, worker_busy
from shmloader.main import device as _device
from shmloader.main.budget import plan_ring, slot_size
from shmloader.main.delivery import Delivery
from shmloader.main.depth import Depth
from shmloader.main.dispatch import as_list, index_text, post
from shmloader.main.overflow import OverflowBroker
from shmloader.main.pool import WorkerPool
from shmloader.main.scheduler import Scheduler
from shmloader.main.scope import RingScope, RingUse
from shmloader.main.wait import Conns, Request
from shmloader.wire.layout import RESIZE_TASK, RingGeometry, Status
from shmloader.wire.messages import Attached, Grown, NewRing, Probe, Probed
from shmloader.wire.ring import Doorbell, Ring
from shmloader.worker.produce import WorkerConfig

Steps = Generator[Request, None, Any]


_said_elsewhere: set[str] = set()  # the kinds of cause (figures left out) rings went to a memfd for


def said_where(ring: Ring) -> None:
    """Warn, once per kind of cause (too small, read-only, absent...), that a ring is in a
    memory file because /dev/shm cannot hold it."""
    kind = None if ring.elsewhere is None else re.sub(r"[\d,]+", "N", ring.elsewhere)
    if kind is None or kind in _said_elsewhere:
        return
    _said_elsewhere.add(kind)
    warnings.warn(f"shmloader's ring ({ring.geometry.total_bytes:,} bytes) is in a memory file (memfd), not in "
                  f"/dev/shm: {ring.elsewhere}. Batches travel as fast and are not copied; the memory counts "
                  "against this process and its cgroup as any other (memory_budget= bounds it).",
                  SharedMemoryWarning, stacklevel=user_stacklevel())


class RingSettings(NamedTuple):
    """What an iterator's workers and rings are made with, fixed for its life."""

    ctx: Any  # the multiprocessing context workers start in
    configs: list[WorkerConfig]  # one per worker
    slot_bytes: int | None  # DataLoader(slot_bytes=): a hint
    depth: Depth  # the loader's: prefetch_factor given, or the depth that adapts
    budget: int | None  # memory_budget
    pin: str | None  # pin_memory's device (the ring is page-locked on CUDA), or None
    device: torch.device | None  # DataLoader(device=)
    device_prefetch: int
    max_restarts: int  # max_worker_restarts


class Probing(NamedTuple):
    """The first batch's probe, sent to ``worker`` (then the process ``proc``) for ``epoch``."""

    worker: int
    seq: int
    index: Any
    proc: Any
    epoch: int
_live: weakref.WeakSet[Lifecycle] = weakref.WeakSet()  # lifecycles whose workers may run (each adds itself)


@atexit.register
def _stop_at_exit() -> None:
    """At interpreter exit, before modules are torn down (an iterator a module still holds,
    a persistent one most often, would otherwise be collected after the modules it needs):
    stop every live iterator's workers. Its last words (its progress, for a checkpoint) are
    not wanted any more: ``at_exit`` says so."""
    for life in list(_live):
        life.at_exit = True
        life.shutdown()


def _room_freed(broker: weakref.ref[OverflowBroker], doorbell: Doorbell) -> bool:
    """The loader's shared memory shrank (from any thread: the one that dropped a batch): a
    grant of this iterator that waits for room in memory_budget may go now, so an async for
    waiting is woken. False once the iterator is gone."""
    waiting = broker()
    if waiting is None:
        return False
    if waiting.awaiting_room:
        doorbell.ring()  # (a no-op once shut down: the bell is closed)
    return True


class Lifecycle:
    def __init__(self, settings: RingSettings, sched: Scheduler, delivery: Delivery, broker: OverflowBroker,
                 counters: Counters) -> None:
        self.settings = settings
        self.sched = sched
        self.delivery = delivery
        self.broker = broker
        self.counters = counters
        self.doorbell = Doorbell()
        try:
            self.pool = WorkerPool(settings.ctx, settings.configs, self.doorbell.fd)
        except BaseException:
            self.doorbell.close()
            raise
        broker.memory.listeners.append(functools.partial(_room_freed, weakref.ref(broker), self.doorbell))
        self.scope: RingScope | None = None  # the current ring and everything tied to it
        self.started = False  # the ring exists and every worker has attached to it once
        self.stopped = False
        self.attaching: dict[int, Any] = {}  # workers sent a new ring, not yet attached: worker -> its process
        # The first batch's probe, sent and not answered. Kept here so that a start-up whose wait
        # was cancelled (async for) or timed out goes on where it was; a probe of an epoch left
        # meanwhile is answered and dropped.
        self.probing: Probing | None = None
        self.busy: tuple[float, ...] | None = None  # each worker's busy share when they stopped
        self.at_exit = False  # stopped as the interpreter exits
        _live.add(self)

    # -------------------------------------------------------------- start
    def start(self, sampler: Any, batch_bytes: int | None, check: Callable[[], None],
              batch_failed: Callable[[BaseException], None]) -> Steps:
        """Size the ring (from the first batch, unless its size is known: ``batch_bytes``, an
        earlier iterator's), create it, attach every worker. The first batch's task is probed:
        made privately by its worker, which keeps it and writes it into its slot once the ring
        exists.

        Resumable: every wait is at a yield, and what a wait left behind lives here (the probe
        sent: ``probing``; the ring made, workers not yet attached: ``scope``, ``attaching``),
        so a start whose generator was dropped (an ``async for`` cancelled) is called again and
        goes on, asking nothing twice and drawing no index twice."""
        if self.scope is None:
            yield from self._create(sampler, batch_bytes, check, batch_failed)
            if self.scope is None:
                return  # the epoch had no batch (every shard ended while probing)
        yield from self.await_attached(check)
        self.started = True

    def _create(self, sampler: Any, batch_bytes: int | None, check: Callable[[], None],
                batch_failed: Callable[[BaseException], None]) -> Steps:
        """``start``'s first part: the probe, then the ring created and sent to every worker."""
        sched, settings = self.sched, self.settings
        slot_bytes = settings.slot_bytes
        first = batch_bytes
        probe: tuple[int, int, Any] | None = None
        if self.probing is not None and self.probing.epoch != sched.epoch:
            yield from self._drop_probe(check)
        while slot_bytes is None and first is None:
            if self.probing is not None:  # asked before this start was cancelled: its answer is awaited
                wid, seq, index = self.probing.worker, self.probing.seq, self.probing.index
            else:
                task = sched.next_task(sampler)
                if task is None:
                    return
                wid, seq, index = task
            status, needed, error = yield from self._probe(wid, seq, index, check)
            if status == Status.STOP:
                sched.end_shard(wid)
                sched.skip_result(seq)  # only exhausted shards came before
            elif status == Status.ERROR or status == Status.INIT_ERROR:  # the first batch's error (its own,
                sched.skip_result(seq)                                   # or its worker's worker_init_fn's):
                raise_worker_error(error, batch_failed)                  # raised; the next one is probed
            else:
                first = needed
                self.broker.memory.remember(first)  # later epochs skip the probe
                probe = (wid, seq, index)
        if slot_bytes is not None and first is not None:  # slot_bytes= is a hint: a ring grown past it stays grown
            slot_bytes = max(slot_bytes, first)
        # Under memory_budget, what the loader's other memory leaves (rings kept by held batches
        # of earlier epochs, other live iterators, overflow memory).
        prefetch = settings.depth.ring_prefetch(sched.num_workers, slot_size(first, slot_bytes))
        geometry = plan_ring(sched.num_workers, prefetch, first, slot_bytes, settings.budget, self.broker.memory.in_use)
        ring = Ring(geometry)
        device, pin = settings.device, settings.pin
        try:
            said_where(ring)  # (a warning made an error closes the ring as any failure here does)
            pinned = False
            if device is not None or pin == "cuda":
                pinned = _device.register_host(ring.mm, geometry.total_bytes)
            elif pin is not None:
                _device.warn_unsupported(pin)
            stager = None if device is None else _device.DeviceStager(device, settings.device_prefetch)
        except BaseException:
            ring.close()
            raise
        self.scope = scope = RingScope(ring, sched, self.pool, self.broker.memory,
                                       RingUse(pinned, stager, not self.delivery.noting))
        sched.set_cap(settings.depth.planned(sched.num_workers, geometry.num_slots, geometry.data_bytes))
        self.attaching = dict(enumerate(self.pool.procs))
        for wid in range(sched.num_workers):
            pending = -1
            if probe is not None and probe[0] == wid:
                pending = sched.dispatch(wid, probe[1], probe[2])
            scope.send(wid, NewRing(geometry, pending), ring.fd)

    def _probe(self, wid: int, seq: int, index: Any, check: Callable[[], None]) -> Steps:
        """Worker ``wid``'s answer for batch ``seq`` (the epoch's first, made privately to size
        the ring). A worker that dies first is replaced (within max_worker_restarts: ``check``)
        and its replacement asked again."""
        pool = self.pool
        while True:
            proc = pool.procs[wid]
            if self.probing is None or self.probing.proc is not proc:  # (a replacement is asked anew)
                pool.send(wid, Probe(self.sched.epoch, seq, as_list(index)), dead_ok=True)
                self.probing = Probing(wid, seq, index, proc, self.sched.epoch)
            reply = yield from self._answer(wid, proc, check)
            if reply is not None:
                self.probing = None
                if not isinstance(reply, Probed):
                    self.shutdown()
                    raise ShmLoaderError(f"DataLoader worker {wid} answered {reply!r:.200} to a probe, expected "
                                         "Probed(status, needed, error): the setup protocol is broken")
                return reply
            check()  # it died before or as it answered: replaced here, then asked again

    def _drop_probe(self, check: Callable[[], None]) -> Steps:
        """The probe of an epoch left before it answered (persistent workers: a timeout or a
        cancel cut the start short, then a new epoch began): its answer is read and dropped, so
        the connection carries the new probe's next. The worker keeps only its latest probe's
        batch; a replacement of it was never asked."""
        assert self.probing is not None
        yield from self._answer(self.probing.worker, self.probing.proc, check)  # (None: it died first)
        self.probing = None

    def _answer(self, wid: int, proc: Any, check: Callable[[], None]) -> Steps:
        """Worker ``wid``'s next message, while ``proc`` is its process; None once it died (a
        death ``check`` replaces it for)."""
        pool = self.pool
        while pool.procs[wid] is proc and not pool.conns[wid].poll():
            check()
            if pool.procs[wid] is proc:
                yield Conns([wid])
        return pool.recv(wid) if pool.procs[wid] is proc else None

    def await_attached(self, check: Callable[[], None]) -> Steps:
        """Wait until every worker sent a new ring (``attaching``: worker -> its process then)
        says it attached. A worker that dies meanwhile is replaced by ``check`` (its
        replacement maps the ring by itself and says nothing) and no longer waited for. The
        state lives here: a wait cancelled by ``async for`` resumes at the next step, before
        anything else reads a connection."""
        attaching, pool = self.attaching, self.pool
        while attaching:
            check()
            for wid, proc in list(attaching.items()):
                if pool.procs[wid] is not proc:
                    del attaching[wid]  # replaced (by the check above): its successor has the ring
                elif pool.conns[wid].poll():
                    reply = pool.recv(wid)
                    if reply is None:
                        continue  # it died as it answered: the next check replaces it
                    if not isinstance(reply, Attached):
                        self.shutdown()
                        raise ShmLoaderError(f"DataLoader worker {wid} answered {reply!r:.200} to a new ring, "
                                             "expected Attached(): the setup protocol is broken")
                    del attaching[wid]
            if attaching:
                yield Conns(sorted(attaching))

    # --------------------------------------------------------------- grow
    def deepen(self, scope: RingScope, cap: int) -> None:
        """The depth grew to ``cap`` tasks: the scheduler's cap, or, past what the ring holds (its
        first growth: the ring is torch's), a deeper ring once this one drains."""
        if self.settings.depth.outgrew:
            self.broker.want_deeper(scope.ring.data_bytes)
        else:
            self.sched.set_cap(cap)

    def grow(self, old: RingScope, check: Callable[[], None]) -> Steps:
        """Replace the drained ring (``old``) by one with larger slots (``broker.grow_to``), or more
        of them (the depth outgrew it: ``Depth.outgrew``); every worker attaches to it. The old
        ring's slots the user does not hold go back to the system at once. Under memory_budget
        only when the new ring, and room for one batch to overflow, fit beside what is still
        held (the old ring's held slots); otherwise overflow keeps carrying large batches, and
        the depth stays what the ring holds."""
        broker, budget = self.broker, self.settings.budget
        size = broker.take_growth()
        # As many slots as now, or fewer where a ring deepened for smaller batches would pass
        # RING_BYTES; more when the depth outgrew the ring (its first growth: main.depth)
        workers, depth = self.sched.num_workers, self.settings.depth
        deepest = workers * depth.ring_prefetch(workers, size) + 1
        g = RingGeometry(workers, deepest if depth.outgrew else min(self.sched.num_slots, deepest), size)
        keep = old.held()  # the old ring's slots the user still views (nothing is copying: it drained)
        og = old.ring.geometry
        held = og.control_bytes + len(keep) * og.slot_stride if keep else 0
        # Under memory_budget, only with room left beside it for a batch of that size to
        # overflow: a grown ring that fills the budget would make the next larger batch an error.
        # (The old ring counts what it will keep: its held slots.)
        others = broker.memory.in_use - old.share.nbytes
        if budget is not None and g.total_bytes + size + held + others > budget:
            if size > old.ring.data_bytes:
                broker.growth_declined = True
            if depth.outgrew:
                depth.declined()
            return
        ring = Ring(g)
        try:
            said_where(ring)
            if old.use.pinned:
                _device.register_host(ring.mm, g.total_bytes)
        except BaseException:
            ring.close()
            raise
        # (nothing was in flight: the old ring drained.) Each worker's next entry on the old ring
        # is RESIZE_TASK, queued while the scheduler still writes the old ring's queues; it then
        # waits on its pipe for the new one. A worker replaced from here on inherits the new ring.
        # The old ring is closed whatever happens next.
        for wid in range(self.sched.num_workers):
            self.sched.push(wid, RESIZE_TASK)
        try:
            self.scope = scope = RingScope(ring, self.sched, self.pool, self.broker.memory, old.use)
            self.sched.set_cap(depth.planned(workers, g.num_slots, g.data_bytes))
            self.attaching = dict(enumerate(self.pool.procs))
            for wid in range(self.sched.num_workers):
                # One that died already (unseen: liveness is checked before sleeping) is replaced
                # by await_attached's check, on the new ring: it is then no longer waited for.
                scope.send(wid, Grown(ring.geometry), ring.fd)
        finally:
            # (drained: no task is in flight; the workers' next is to attach.) Counted at its
            # held slots until the batches viewing it are gone.
            old.retire(keep, control=False)
            self.counters.ring_growths += 1
        yield from self.await_attached(check)

    # ------------------------------------------------------------ workers
    def recover(self, wid: int, unresumable: bool) -> None:
        """Replace dead worker ``wid`` and dispatch its tasks again, or raise WorkerDiedError
        (past max_worker_restarts, or for an IterableDataset whose shard cannot resume:
        ``unresumable``).

        Its slots may be half written: each is reset and its task (same epoch, seq and
        index) goes to its replacement (same worker id and seeds, so the batch -> worker
        assignment stays torch's), so the epoch still yields every batch exactly once and in
        order. Overflow memory granted to its tasks is dropped.
        """
        sched, pool = self.sched, self.pool
        current = sorted((task.seq, slot) for slot in sched.of_worker(wid)
                         if (task := sched.task_of(slot)) and task.epoch == sched.epoch)
        doing = ""
        if current:
            task = sched.task_of(current[0][1])
            assert task is not None
            doing = f" while producing batch {task.seq} (index {index_text(as_list(task.index))})"
        elif self.scope is None:
            doing = " before it answered for the first batch, before the ring was set up"
        used, max_restarts = self.counters.worker_restarts, self.settings.max_restarts
        reason = None
        if self.started and unresumable:
            # (before the start, a worker has made at most the first batch, privately: its
            # replacement makes it again from the shard's start)
            reason = ("an IterableDataset worker cannot be replaced without repeating or losing its shard; "
                      "give the dataset state_dict() and load_state_dict() to make its workers replaceable")
        elif used >= max_restarts:
            reason = f"{used} of max_worker_restarts={max_restarts} restarts are used up"
        killed = pool.killed(wid)
        memory = " If it ran out of memory, lower batch_size, num_workers or prefetch_factor" if killed else ""
        if reason is not None:
            hint = f"{memory}; to tolerate more deaths raise max_worker_restarts." if memory else ""
            raise WorkerDiedError(f"{pool.death(wid)}{doing}; {reason}.{hint}")
        self.counters.worker_restarts += 1  # (stats().worker_restarts)
        said = (f"{pool.death(wid)}{doing}; replaced ({used + 1} of max_worker_restarts={max_restarts}): its "
                f"batches are made again, in order.{memory + '.' if memory else ''}")
        self._replace(wid)
        # (said once the replacement is done: a warning made an error must not leave it half done)
        warnings.warn(said, WorkerReplacedWarning, stacklevel=user_stacklevel())

    def _replace(self, wid: int) -> None:
        """``recover``'s replacement of dead worker ``wid``, and its tasks dispatched again."""
        sched, pool, scope = self.sched, self.pool, self.scope
        if scope is None:  # it died probing the first batch: a fresh worker, which start() asks again
            pool.restart(wid, self.doorbell.fd)
            return
        # It may have published a slot DONE and died before posting its token: a slot found
        # DONE for another worker's token leaves that worker's slot with no token to come. One
        # more banked token makes the step look again; a surplus one only makes it look once
        # more later (a token means "look for DONE slots", never "this slot is done").
        sched.bank_token()
        orphans = sched.orphaned(wid)
        for slot, _ in orphans:
            scope.drop(slot)
        shard = None
        if self.delivery.noting:  # from its snapshot (a checkpoint's, until it delivers: Delivery.resume_from)
            state, earlier = self.delivery.shard_state(scope, wid)
            shard = (state, sched.epoch, earlier)
        sched.renew_queue(wid)
        pool.replace(wid, scope.ring, self.doorbell.fd, shard)
        for slot, task in orphans:  # to its replacement: the batch -> worker assignment stays torch's
            if task.epoch == sched.epoch:
                sched.redispatch(slot, wid, task.seq, task.index)
                self.post(scope, slot)

    def post(self, scope: RingScope, slot: int) -> None:
        """Post ``slot``'s task the way its index fits (``main.dispatch.post``): what the scheduler's
        step could not post itself, or a task dispatched again."""
        needed = post(scope, slot)
        if needed:
            self.broker.want_growth(needed, scope.ring.data_bytes)

    def post_unposted(self, scope: RingScope) -> None:
        """Tasks the step dispatched but could not post (an index that is no list of int64 ints,
        or too large for its slot): pickled into the slot, or over the worker's connection."""
        for slot in self.sched.take_unposted():
            self.post(scope, slot)

    def worker_busy(self) -> tuple[float, ...]:
        """Each worker's busy share: read from the ring's counters, or as they were when the
        workers stopped (the counters' pages went back with the ring's control region)."""
        if self.busy is not None:
            return self.busy
        return () if self.scope is None else worker_busy(self.scope.ring.counters)

    def shutdown(self) -> None:
        """Stop the workers, close the ring and the doorbell. Idempotent."""
        if self.stopped:
            return
        self.stopped = True
        scope = self.scope
        try:
            if scope is not None and scope.stager is not None:
                scope.stager.stream.synchronize()  # no DMA may outlive the mapping it reads
            self.pool.stop(None if scope is None else self.sched.push)
            if scope is not None:  # nobody writes it now: what nobody holds goes back
                self.busy = worker_busy(scope.ring.counters)  # (the counters' pages go back too)
                scope.retire(scope.held(), control=True)
        finally:
            if scope is not None:
                scope.ring.close()  # (idempotent)
            self.doorbell.close()
