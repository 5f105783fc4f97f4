"""The worker process: fetch samples, collate into a slot, signal readiness.

A worker starts on a setup pipe: it may be asked to produce the first
batch privately (the probe that sizes the ring), then receives the ring's geometry and
the segment's fd, attaches, and from then on talks only through shared memory: it
takes slot numbers from its task queue (a semaphore per worker), reads the index from the
slot, writes the batch and the result header, marks the slot DONE, posts the ready
semaphore (and the wake semaphore, when a sleeping sync ``next()`` waits for this result) and
rings the doorbell (an eventfd the main process's event loop watches) when an ``async for``
waits.

A batch that does not fit its slot takes the overflow path (see ``main/overflow.py``): the
worker publishes the slot as ``NEED_MEMORY`` and waits on its setup connection for the
memory (an fd), a "drop", or (no room in memory_budget while the consumer holds it) a
request to send the batch pickled over the connection; then it publishes again. When the
ring grows, a resize task makes it attach to the new ring the connection carries.

It exits on a stop task, or within a second of its parent's death. It ignores
SIGINT: Ctrl-C is the main process's to handle, and the main process stops it.
"""

from __future__ import annotations

import mmap
import os
import pickle
import select
import socket
import struct
import sys
import time
from multiprocessing import reduction
from typing import Any, NamedTuple

import numpy as np
from torch._utils import ExceptionWrapper

from shmloader._errors import ShmLoaderError, fit_error, picklable
from shmloader.wire.layout import RESIZE_TASK, Counter, Region, RingGeometry, Status, round_up
from shmloader.wire.messages import Attached, Grown, Index, Memory, NewRing, Probe, Probed, Stop
from shmloader.wire.ring import AttachedRing
from shmloader.worker.collate import SlotWriter, slot_collate_map
from shmloader.worker.produce import Outcome, Producer, WorkerConfig, init, wrap

_ONE = struct.pack("=Q", 1)
_OK, _NEED_MEMORY = Status.OK, Status.NEED_MEMORY  # (a global costs less than an enum member lookup, per batch)
_BUSY_NS, _BATCHES = Counter.BUSY_NS, Counter.BATCHES
# A batch that took longer than this gives the CPU away once it is published (_serve). Small
# batches don't: their worker soon waits for its next task, which frees the CPU anyway.
LONG_BATCH_NS = 200_000


class InheritedFd:
    """An fd handed to a child: inherited as is under fork, duplicated under spawn/forkserver."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return (_rebuild_fd, (reduction.DupFd(self.fd),))


def _rebuild_fd(dup: Any) -> InheritedFd:
    return InheritedFd(dup.detach())


class TaskAt(NamedTuple):
    """The task a result is published for: its slot, epoch and seq, and whether it was posted
    ``own`` (the consumer holds the rest of the ring: its batch goes into memory of its own)."""

    slot: int
    epoch: int
    seq: int
    own: bool = False


_tuple_new = tuple.__new__


class Publisher:
    """A worker's way to publish results into the ring it is attached to: its worker id, its
    connection (for overflow memory), and the doorbell an ``async for`` waits on."""

    __slots__ = ("ring", "worker_id", "mailbox", "doorbell")

    def __init__(self, ring: AttachedRing, worker_id: int, mailbox: Mailbox, doorbell: int) -> None:
        self.ring = ring
        self.worker_id = worker_id
        self.mailbox = mailbox
        self.doorbell = doorbell

    def publish(self, at: TaskAt, writer: SlotWriter, outcome: Outcome, region: Region = Region.SLOT,
                shard_end: bytes = b"") -> None:
        """Publish ``outcome`` for the task ``at``, as ``writer`` laid it out in ``region``.
        ``shard_end``: with an end of shard, the worker's snapshot then (``Producer.snapshot``),
        written where an error's pickle goes when it fits the slot."""
        ring, slot = self.ring, at.slot
        if outcome.status is _OK:
            table_off, table_len = writer.table_off, writer.table_len
            pickled_off, pickled_len = writer.pickled_off, writer.pickled_len
            dataset_state_off, dataset_state_len = writer.dataset_state_off, writer.dataset_state_len
        else:
            table_off = table_len = pickled_off = pickled_len = dataset_state_off = dataset_state_len = 0
            if outcome.status is Status.ERROR or outcome.status is Status.INIT_ERROR:
                pickled_len = _write_error(ring, slot, outcome.error)
            elif shard_end and len(shard_end) <= ring.geometry.data_bytes:
                start = ring.geometry.data_offset(slot)
                ring.bytes[start : start + len(shard_end)] = np.frombuffer(shard_end, dtype=np.uint8)
                pickled_len = len(shard_end)
        # The result fields from STATUS on, in field order (see wire.layout.Field); DONE is stored after
        # them with release ordering, then the ready semaphore is posted (and the wake, when a sync
        # next() sleeps for this result: wire.layout.RingGeometry.awaited_word).
        results = (outcome.status, self.worker_id, table_off, table_len, pickled_off, pickled_len, outcome.needed,
                   at.epoch, at.seq, dataset_state_off, dataset_state_len, region)
        if ring.publish(slot, results):  # an async for waits: ring its doorbell too
            try:
                os.write(self.doorbell, _ONE)
            except OSError:
                pass  # the main process closed the doorbell: it is shutting down

    def publish_result(self, at: TaskAt, writer: SlotWriter, outcome: Outcome, batch: Any,
                       dataset_state: bytes) -> bool:
        """Publish ``outcome``; a batch that did not fit takes the overflow path. False: stop.

        A batch of a task posted ``own`` (the consumer holds the rest of the ring) asks for its
        leaves' bytes only, and is described (skeleton, leaf table, dataset state) in its slot's
        data region, which it does not otherwise use (``Region.LEAVES``): a batch of whole pages
        then costs exactly its pages, as torch's does."""
        if outcome.status is not _NEED_MEMORY:
            self.publish(at, writer, outcome, shard_end=dataset_state if outcome.status is Status.STOP else b"")
            return True
        ring, slot, where = self.ring, at.slot, f"in DataLoader worker process {self.worker_id}"
        measure = SlotWriter(None)  # exactly what a fresh writer will need (leaf order included)
        try:
            needed = measure.finish(batch, dataset_state)
        except Exception:  # it was measured once already; whatever fails now is this batch's error
            self.publish(at, writer, Outcome(Status.ERROR, error=wrap(where=where)))
            return True
        leaf_bytes = measure.used
        leaves_only = at.own and 0 < leaf_bytes and needed - round_up(leaf_bytes, 8) <= ring.data_bytes
        asked = leaf_bytes if leaves_only else needed
        self.publish(at, writer, Outcome(Status.NEED_MEMORY, needed=asked))
        reply = self.mailbox.expect(Memory, slot)
        if reply is None:
            return False
        size, fd = reply[0].size, reply[1]
        if not size:
            return True  # the consumer no longer wants this batch (a new epoch began)
        if size < 0:  # no room in memory_budget while the consumer holds it: a pickled copy
            try:
                payload = pickle.dumps((batch, dataset_state), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:
                self.publish(at, writer, Outcome(Status.ERROR, error=wrap(where=where)))
                return True
            self.publish(at, writer, Outcome(Status.OK, needed=len(payload)), Region.PIPE)
            self.mailbox.conn.send_bytes(payload)  # after publishing: the consumer reads as we write
            return True
        try:
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        overflow = SlotWriter(mm)
        overflow.begin(0, size)
        if leaves_only:
            overflow.describe_in(ring.mm, ring.data_offsets[slot], ring.data_bytes)
        try:
            overflow.finish(batch, dataset_state)
            if not overflow.fits:
                raise RuntimeError(f"the batch measured {asked:,} bytes, then needed more than the {size:,} granted")
            outcome = Outcome(Status.OK, needed=asked)
        except Exception:
            outcome = Outcome(Status.ERROR, error=wrap(where=where))
        # The overflow writer's layout, not the slot writer's: their leaves can come in another order
        # (default collate stacks some leaves before the skeleton is pickled, which adds the rest).
        written = outcome.status is Status.OK
        region = (Region.LEAVES if leaves_only else Region.OVERFLOW) if written else Region.SLOT
        self.publish(at, overflow if written else writer, outcome, region)
        del overflow, mm  # unmapped once the writer's views are gone; the consumer keeps its own mapping
        return True


def _write_error(ring: AttachedRing, slot: int, error: ExceptionWrapper | None) -> int:
    """Pickle the worker's exception to the start of the slot's data region, never past its
    end; returns its length."""
    assert error is not None
    cap = ring.geometry.data_bytes
    payload = fit_error(error, cap)
    start = ring.geometry.data_offset(slot)
    ring.bytes[start : start + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    return len(payload)


class ParentWatch:
    """Whether the loader's process lives. Not ``getppid()``: under forkserver a worker's
    parent is the fork server, not the loader. A pidfd (Linux >= 5.3) cannot be fooled by
    pid reuse; elsewhere fall back to signal 0."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self.fd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self.fd = None

    def alive(self) -> bool:
        if self.fd is not None:
            return not select.select([self.fd], [], [], 0)[0]  # readable once it has exited
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def worker_main(cfg: WorkerConfig, conn: Any, doorbell: InheritedFd) -> None:
    """Entry point of a worker process."""
    try:
        _worker_loop(cfg, conn, doorbell.fd)
    except (KeyboardInterrupt, EOFError, BrokenPipeError, ConnectionResetError):
        pass  # Ctrl-C is the main process's; a broken setup pipe means the main process is gone
    finally:
        sys.stdout.flush()


class Mailbox:
    """The worker's end of its setup connection once it serves the ring. The consumer sends
    what does not fit in shared memory (``wire.messages``): overflow memory (``Memory``, then
    its fd), an index too large for its slot (``Index``), a grown ring (``Grown``, then the
    segment's fd) and ``Stop``. Messages for a later task are kept until asked for."""

    def __init__(self, conn: Any, parent: ParentWatch, check_s: float) -> None:
        self.conn = conn
        self.parent = parent
        self.check_s = check_s
        self._kept: dict[tuple[type, int], tuple[Any, int]] = {}  # (kind, slot) -> (message, its fd or -1)

    def _recv_fd(self) -> int:
        """A descriptor sent as ``reduction.send_handle`` sends it, read without duplicating the
        connection's descriptor (each batch's overflow memory comes this way while the user
        holds the ring)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=self.conn.fileno())
        try:
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
        finally:
            sock.detach()  # (the descriptor stays the connection's)
        if not fds:
            raise EOFError("the main process closed the connection before sending a descriptor")
        return int(fds[0])

    def expect(self, kind: type, slot: int = -1) -> tuple[Any, int] | None:
        """The message of type ``kind`` for ``slot`` (-1: ``Grown``) and the descriptor that came
        with it (-1: none); None when told to stop or the loader is gone."""
        while (kind, slot) not in self._kept:
            while not self.conn.poll(self.check_s):
                if not self.parent.alive():
                    return None
            msg = self.conn.recv()
            if isinstance(msg, Stop):
                return None
            if isinstance(msg, Memory):
                self._kept[(Memory, msg.slot)] = (msg, self._recv_fd() if msg.size > 0 else -1)
            elif isinstance(msg, Grown):
                self._kept[(Grown, -1)] = (msg, reduction.recv_handle(self.conn))
            elif isinstance(msg, Index):
                self._kept[(Index, msg.slot)] = (msg, -1)
            else:
                raise ShmLoaderError(f"DataLoader worker got {msg!r:.200} from the main process while serving "
                                     "the ring: the setup protocol is broken")
        return self._kept.pop((kind, slot))


class FailedInit:
    """What a worker whose worker_init_fn raised answers a task, as torch's loader has it. In the
    epoch it started in (its first task's), every task of a map-style dataset fails with that
    error (torch's raises it once, then an UnboundLocalError), so the other workers' batches
    arrive and the epoch ends; an IterableDataset's shard has no batch to fail, so its first
    task gets the error and the next ones its end (torch's would raise without end). A
    persistent worker's later epochs make their batches (``answer`` is None), as torch's do."""

    def __init__(self, cfg: WorkerConfig, error: ExceptionWrapper) -> None:
        self.iterable = cfg.iterable
        self.error = error
        self.epoch: int | None = None
        self.said = False

    def answer(self, epoch: int) -> Outcome | None:
        if self.epoch is None:
            self.epoch = epoch
        if epoch != self.epoch:
            return None
        if self.iterable and self.said:
            return Outcome(Status.STOP)
        self.said = True
        return Outcome(Status.INIT_ERROR, error=self.error)


def _worker_loop(cfg: WorkerConfig, conn: Any, doorbell: int) -> None:
    parent = ParentWatch(cfg.parent_pid)
    init_error = init(cfg)
    init_failed = None if init_error is None else FailedInit(cfg, init_error)
    producer = Producer(cfg)
    probe_writer = SlotWriter(None)
    pending: tuple[int, int, Outcome, Any, bytes] | None = None
    batch: Any = None
    # Setup phase: the pipe carries probes, then the ring's geometry and the segment's fd.
    while True:
        if not conn.poll(cfg.parent_check_s):
            if not parent.alive():
                return
            continue
        msg = conn.recv()
        if isinstance(msg, Stop):
            return
        if isinstance(msg, Probe):
            epoch, seq, index = msg
            failed = None if init_failed is None else init_failed.answer(epoch)
            if failed is not None:
                outcome, batch = failed, None
            else:
                probe_writer.begin(0, 0)
                outcome, batch = producer.produce(epoch, index, probe_writer, slot_collate_map(probe_writer))
                if outcome.status is Status.NEED_MEMORY:
                    outcome = Outcome(Status.PROBED, needed=outcome.needed)
            pending = (epoch, seq, outcome, batch, producer.dataset_state)
            conn.send(Probed(int(outcome.status), outcome.needed,
                             None if outcome.error is None else picklable(outcome.error)))
            continue
        if not isinstance(msg, NewRing):
            raise ShmLoaderError(f"DataLoader worker {cfg.worker_id} got {msg!r:.200} from the main process "
                                 "before its ring: the setup protocol is broken")
        geometry: RingGeometry = msg.geometry
        pending_slot: int = msg.pending
        segment = reduction.recv_handle(conn)  # sent right after the geometry
        break
    ring = AttachedRing.by_fd(geometry, segment, cfg.worker_id)
    ring.counters[cfg.worker_id][Counter.STARTED_NS] = time.monotonic_ns()
    conn.send(Attached())
    publisher = Publisher(ring, cfg.worker_id, Mailbox(conn, parent, cfg.parent_check_s), doorbell)
    if pending is not None and pending_slot >= 0:
        writer = SlotWriter(ring.mm)
        epoch, seq, outcome, batch, dataset_state = pending
        writer.begin(ring.geometry.data_offset(pending_slot), ring.geometry.data_bytes)
        if outcome.status is Status.PROBED:
            try:
                needed = writer.finish(batch, dataset_state)
                outcome = Outcome(Status.OK if writer.fits else Status.NEED_MEMORY, needed=needed)
            except Exception:  # the first batch could be measured but not written: its error
                outcome = Outcome(Status.ERROR, error=wrap(where=f"in DataLoader worker process {cfg.worker_id}"))
                batch = None
        if not publisher.publish_result(TaskAt(pending_slot, epoch, seq), writer, outcome, batch, dataset_state):
            return
    # The probe's private copy of the first batch (the writer keeps its leaves too): not for
    # the worker's whole life.
    del pending, batch, probe_writer
    _serve(cfg, publisher, producer, init_failed)


def worker_replacement(cfg: WorkerConfig, geometry: RingGeometry, segment: InheritedFd, conn: Any,
                       doorbell: InheritedFd) -> None:
    """Entry point of a worker that replaces a dead one, under any start method: it maps the
    ring through the segment's fd (the name is long gone; the semaphores live inside)."""
    try:
        parent = ParentWatch(cfg.parent_pid)
        init_error = init(cfg)
        init_failed = None if init_error is None else FailedInit(cfg, init_error)
        ring = AttachedRing.by_fd(geometry, segment.fd, cfg.worker_id)
        ring.counters[cfg.worker_id][Counter.STARTED_NS] = time.monotonic_ns()
        _serve(cfg, Publisher(ring, cfg.worker_id, Mailbox(conn, parent, cfg.parent_check_s), doorbell.fd),
               Producer(cfg), init_failed)
    except (KeyboardInterrupt, EOFError, BrokenPipeError, ConnectionResetError):
        pass  # as in worker_main


def _reattach(cfg: WorkerConfig, old: AttachedRing, mailbox: Mailbox) -> AttachedRing | None:
    """The ring grew: attach to the new one (counters carried over), tell the consumer."""
    got = mailbox.expect(Grown)
    if got is None:
        return None
    ring = AttachedRing.by_fd(got[0].geometry, got[1], cfg.worker_id)
    ring.counters[cfg.worker_id][:] = old.counters[cfg.worker_id]
    mailbox.conn.send(Attached())
    return ring


def _serve(cfg: WorkerConfig, publisher: Publisher, producer: Producer, init_failed: FailedInit | None) -> None:
    """Steady state: tasks from the queue, batches into slots; shared memory and semaphores only
    (the setup connection only for what does not fit: overflow memory, a grown ring)."""
    ring, mailbox = publisher.ring, publisher.mailbox
    writer = SlotWriter(ring.mm)
    fn_map = slot_collate_map(writer)
    while True:
        task = ring.take_task(cfg.parent_check_s)
        if task is None:
            if not mailbox.parent.alive():
                return
            continue
        if isinstance(task, int):
            if task != RESIZE_TASK:
                return  # STOP_TASK
            del writer, fn_map  # views of the old ring
            grown = _reattach(cfg, ring, mailbox)
            if grown is None:
                return
            ring = grown
            writer = SlotWriter(ring.mm)
            fn_map = slot_collate_map(writer)
            publisher = Publisher(ring, cfg.worker_id, mailbox, publisher.doorbell)
            continue
        slot, epoch, seq, index, own = task
        if index is None:  # the pickled index did not fit the slot: it came over the connection
            got = mailbox.expect(Index, slot)
            if got is None:
                return
            index = pickle.loads(got[0].payload)
        elif type(index) is bytes:
            index = pickle.loads(index)
        start = ring.data_offsets[slot]
        began = time.monotonic_ns()
        # own: the consumer holds the rest of the ring, so the batch goes into memory of its own
        # (a slot of capacity 0 takes the overflow path: measured, then granted a memfd)
        writer.begin(start, 0 if own else ring.data_bytes)
        batch = None
        failed = None if init_failed is None else init_failed.answer(epoch)
        if failed is not None:
            outcome = failed
        else:
            outcome, batch = producer.produce(epoch, index, writer, fn_map)
        spent = time.monotonic_ns() - began
        counters = ring.counters[cfg.worker_id]
        counters[_BUSY_NS] += spent
        counters[_BATCHES] += 1
        state = producer.dataset_state
        # (made at tuple speed: once per batch)
        if not publisher.publish_result(_tuple_new(TaskAt, (slot, epoch, seq, own)), writer, outcome, batch, state):
            return
        del batch
        if spent > LONG_BATCH_NS:
            # A sync next() waiting for a batch yields its CPU rather than sleeping (main.wait.Waiter,
            # YieldWait), so when every CPU runs a worker it waits in a run queue behind
            # one until that worker's time slice ends: milliseconds, when batches take that
            # long, while the next tasks wait for it to take this batch. Sharing its run queue,
            # this worker hands it the CPU now; alone, the call returns at once (< 1 µs).
            os.sched_yield()
