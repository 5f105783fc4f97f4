"""The worker process: fetch samples, collate into a slot, signal readiness.

A worker starts on a setup pipe: it may be asked to produce the first
batch privately (the probe that sizes the ring), then receives the ring's geometry and
the segment's fd, attaches, and from then on talks only through shared memory: it
takes slot numbers from its task queue (a semaphore per worker), reads the index from the
slot, writes the batch and the result header, marks the slot DONE, posts the ready
semaphore and rings the doorbell (an eventfd the main process's event loop watches).

A batch that does not fit its slot takes the overflow path (see ``_overflow.py``): the
worker publishes the slot as ``NEED_MEMORY`` and waits on its setup connection for the
memory (an fd), a "drop", or (no room in memory_budget while the consumer holds it) a
request to send the batch pickled over the connection; then it publishes again. When the
ring grows, a resize task makes it attach to the new ring the connection carries.

It exits on a stop task, or within a second of its parent's death. It ignores
SIGINT: Ctrl-C is the main process's to handle, and the main process stops it.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import pickle
import random
import select
import signal
import struct
import sys
import time
from typing import Any, Callable, NamedTuple

import numpy as np
import torch
from torch._utils import ExceptionWrapper
from torch.utils.data._utils import collate as torch_collate
from multiprocessing import reduction
from torch.utils.data._utils import worker as torch_worker

from ._collate import SlotWriter, slot_collate_map
from ._layout import RESIZE_TASK, Counter, Region, RingGeometry, Status
from ._ring import AttachedRing

_ONE = struct.pack("=Q", 1)
# A batch that took longer than this gives the CPU away once it is published (_serve). Small
# batches don't: their worker soon waits for its next task, which frees the CPU anyway.
LONG_BATCH_NS = 200_000


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs from the loader (pickled once per worker under spawn)."""

    worker_id: int
    num_workers: int
    dataset: Any
    iterable: bool
    auto_collation: bool
    collate_fn: Callable[[Any], Any]
    drop_last: bool
    base_seed: int
    worker_init_fn: Callable[[int], None] | None
    parent_pid: int
    parent_check_s: float = 0.5  # how often an idle worker checks that the loader lives
    dataset_state: bytes = b""  # a pickled IterableDataset state to load before its first epoch
    # The epoch that state belongs to, for a replaced worker: loaded (with its "shard ended"
    # flag) only if the first task is of that epoch. None: a checkpoint's, loaded as it is.
    dataset_state_epoch: int | None = None


class Outcome(NamedTuple):  # one per batch: a tuple is the cheapest to make
    status: Status
    needed: int = 0
    error: ExceptionWrapper | None = None


_OK, _NEED_MEMORY = Status.OK, Status.NEED_MEMORY  # (an enum member lookup costs more than a global's)
_tuple_new = tuple.__new__


def _ok(needed: int) -> Outcome:
    """``Outcome(Status.OK, needed)``, made at tuple speed (one per batch)."""
    return _tuple_new(Outcome, (_OK, needed, None))

_BUSY_NS, _BATCHES = Counter.BUSY_NS, Counter.BATCHES


def _wrap(where: str) -> ExceptionWrapper:
    """torch's wrapper of the exception being handled: the main process re-raises it."""
    return ExceptionWrapper(where=where)  # type: ignore[no-untyped-call]


class InheritedFd:
    """An fd handed to a child: inherited as is under fork, duplicated under spawn/forkserver."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return (_rebuild_fd, (reduction.DupFd(self.fd),))


def _rebuild_fd(dup: Any) -> InheritedFd:
    return InheritedFd(dup.detach())


class _Producer:
    """Turns an index into a batch written by a SlotWriter."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.where = f"in DataLoader worker process {cfg.worker_id}"
        self.fused = cfg.auto_collation and cfg.collate_fn is torch_collate.default_collate
        # Map-style, default collate: a batch like the last one stacked into the same slot is
        # stacked in one step (SlotWriter.stack_lone)
        self.lean = self.fused and not cfg.iterable
        self._epoch: int | None = None
        self._iter: Any = None
        self._ended = False
        self.dataset_state = b""

    def _samples(self, epoch: int, index: Any) -> Any:
        ds = self.cfg.dataset
        if not self.cfg.iterable:
            if not self.cfg.auto_collation:
                return ds[index]
            getitems = getattr(ds, "__getitems__", None)
            return getitems(index) if getitems else [ds[i] for i in index]
        if epoch != self._epoch:
            ended = False
            resumed = self.cfg.dataset_state_epoch
            if self._epoch is None and self.cfg.dataset_state and resumed in (None, epoch):
                saved = pickle.loads(self.cfg.dataset_state)  # a checkpoint's, or a dead predecessor's
                ds.load_state_dict(saved["state"])
                ended = resumed == epoch and saved["ended"]
            self._epoch, self._iter, self._ended = epoch, iter(ds), ended
        if self._ended:
            raise StopIteration
        if not self.cfg.auto_collation:
            return next(self._iter)
        data = []
        for _ in index:
            try:
                data.append(next(self._iter))
            except StopIteration:
                self._ended = True
                break
        if not data or (self.cfg.drop_last and len(data) < len(index)):
            raise StopIteration
        return data

    def _dataset_state(self) -> bytes:
        """An IterableDataset's ``state_dict()`` after this batch, and whether its shard ended
        within the batch, pickled (b"" for a dataset without state)."""
        get = getattr(self.cfg.dataset, "state_dict", None) if self.cfg.iterable else None
        return pickle.dumps({"ended": self._ended, "state": get()}) if callable(get) else b""

    def produce(self, epoch: int, index: Any, writer: SlotWriter, fn_map: dict[Any, Any]) -> tuple[Outcome, Any]:
        """Fetch and collate into ``writer``; returns the outcome and the batch object."""
        try:
            samples = self._samples(epoch, index)
            if self.lean and type(samples) is list and samples:
                batch = writer.stack_lone(samples)
                if batch is not None:
                    return _ok(writer.dataset_state_off), batch
            if self.fused:
                # Samples that are plain tensors: the map's tensor entry, as collate() would call it
                stack = fn_map.get(torch.Tensor) if type(samples) is list and samples and type(samples[0]) is torch.Tensor else None
                if stack is not None:
                    batch = stack(samples, collate_fn_map=fn_map)
                else:
                    batch = torch_collate.collate(samples, collate_fn_map=fn_map)
            else:
                batch = self.cfg.collate_fn(samples)
            del samples
            self.dataset_state = self._dataset_state() if self.cfg.iterable else b""
            needed = writer.finish(batch, self.dataset_state)
        except StopIteration:
            if not self.cfg.iterable:
                return Outcome(Status.ERROR, error=_wrap(where=self.where)), None
            return Outcome(Status.STOP), None
        except Exception:
            return Outcome(Status.ERROR, error=_wrap(where=self.where)), None
        if not writer.fits:
            return Outcome(Status.NEED_MEMORY, needed=needed), batch
        return _ok(needed), batch


def _init(cfg: WorkerConfig) -> ExceptionWrapper | None:
    """torch's worker setup: threads, seeds, worker info, worker_init_fn."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    seed = cfg.base_seed + cfg.worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(torch_worker._generate_state(cfg.base_seed, cfg.worker_id))  # type: ignore[no-untyped-call]
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=cfg.worker_id, num_workers=cfg.num_workers, seed=seed, dataset=cfg.dataset
    )
    where = f"in DataLoader worker process {cfg.worker_id}"
    try:
        if cfg.worker_init_fn is not None:
            cfg.worker_init_fn(cfg.worker_id)
    except (StopIteration, SystemExit, KeyboardInterrupt) as exc:
        # Said as what it was, in a RuntimeError: raised as itself from next() it would end the
        # caller's loop in silence (StopIteration), end the main process (SystemExit) or pose as
        # Ctrl-C, where a failed set-up ends the loader.
        if isinstance(exc, StopIteration):
            what = "StopIteration", "a DataLoader worker's set-up cannot end an epoch"
        else:
            code = f"({exc.code!r})" if isinstance(exc, SystemExit) else ""
            what = f"{type(exc).__name__}{code} (sys.exit?)", "a DataLoader worker cannot exit on its own"
        try:
            raise RuntimeError(f"worker_init_fn raised {what[0]} in worker {cfg.worker_id}: {what[1]}; raise "
                               "an exception to report a failed set-up") from exc
        except RuntimeError:
            return _wrap(where=where)
    except Exception:
        return _wrap(where=where)
    return None


def _publish(ring: AttachedRing, slot: int, cfg: WorkerConfig, writer: SlotWriter, outcome: Outcome,
             epoch: int, seq: int, doorbell: int, region: Region = Region.SLOT) -> None:
    if outcome.status is _OK:
        table_off, table_len = writer.table_off, writer.table_len
        pickled_off, pickled_len = writer.pickled_off, writer.pickled_len
        dataset_state_off, dataset_state_len = writer.dataset_state_off, writer.dataset_state_len
    else:
        table_off = table_len = pickled_off = pickled_len = dataset_state_off = dataset_state_len = 0
        if outcome.status is Status.ERROR or outcome.status is Status.INIT_ERROR:
            pickled_len = _write_error(ring, slot, outcome.error)
    # The result fields from STATUS on, in field order (see _layout.Field); DONE is stored after
    # them with release ordering, then the ready semaphore is posted.
    results = (outcome.status, cfg.worker_id, table_off, table_len, pickled_off, pickled_len, outcome.needed,
               epoch, seq, dataset_state_off, dataset_state_len, region)
    if ring.publish(slot, results):  # an async for waits: ring its doorbell too
        try:
            os.write(doorbell, _ONE)
        except OSError:
            pass  # the main process closed the doorbell: it is shutting down


def _write_error(ring: AttachedRing, slot: int, error: ExceptionWrapper | None) -> int:
    """Pickle the worker's exception to the start of the slot's data region, never past its
    end; returns its length."""
    assert error is not None
    cap = ring.geometry.data_bytes
    payload = fit_error(error, cap)
    start = ring.geometry.data_offset(slot)
    ring.bytes[start : start + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    return len(payload)


CUT = "\n[... {} characters of the traceback cut so that the error fits its ring slot ...]\n"


def picklable(error: ExceptionWrapper) -> ExceptionWrapper:
    """``error``, made to pickle: an exception class that cannot be pickled (one defined inside
    a function) travels as a RuntimeError whose message names it."""
    try:
        pickle.dumps(error.exc_type)
    except Exception:
        name = f"{error.exc_type.__module__}.{error.exc_type.__qualname__}"
        error.where = f"(raised as {name}, which cannot be pickled) {error.where}"
        error.exc_type = RuntimeError  # the traceback text still ends with the original type and message
    return error


def fit_error(error: ExceptionWrapper, cap: int) -> bytes:
    """``error`` pickled (see ``picklable``) in at most ``cap`` bytes. A traceback too long
    for the slot is cut from the middle: its first line (which worker) and its end (the
    exception's type and message) stay, and the cut says so; sizes are counted in encoded
    bytes, not characters."""
    payload = pickle.dumps(picklable(error))
    if len(payload) <= cap:
        return payload
    text = error.exc_msg
    keep = len(text)
    while keep > 0:
        keep = min(keep - 1, keep * (cap - 256) // max(1, len(payload)))  # shrink at least one character
        head = text[: keep // 4]
        tail = text[len(text) - (keep - keep // 4) :] if keep else ""
        error.exc_msg = head + CUT.format(len(text) - keep) + tail
        payload = pickle.dumps(error)
        if len(payload) <= cap:
            return payload
    error.exc_msg = CUT.format(len(text))
    payload = pickle.dumps(error)
    assert len(payload) <= cap, (len(payload), cap)  # a slot holds at least a page
    return payload


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
    what does not fit in shared memory: overflow memory ("memory", slot, size, then the fd;
    size 0 means drop the batch), an index too large for its slot ("index", slot, payload),
    a new ring ("ring", -1, geometry, then the segment's fd) and ("stop",). Messages for a later
    task are kept until asked for."""

    def __init__(self, conn: Any, parent: ParentWatch, check_s: float) -> None:
        self.conn = conn
        self.parent = parent
        self.check_s = check_s
        self._kept: dict[tuple[str, int], tuple[Any, ...]] = {}

    def expect(self, kind: str, slot: int = -1) -> tuple[Any, ...] | None:
        """The message ``(kind, slot, ...)``; None when told to stop or the loader is gone."""
        while (kind, slot) not in self._kept:
            while not self.conn.poll(self.check_s):
                if not self.parent.alive():
                    return None
            msg = self.conn.recv()
            if msg[0] == "stop":
                return None
            if msg[0] == "memory":
                msg = (*msg, reduction.recv_handle(self.conn) if msg[2] > 0 else -1)
            elif msg[0] == "ring":
                msg = (*msg, reduction.recv_handle(self.conn))
            self._kept[(msg[0], msg[1])] = msg
        return self._kept.pop((kind, slot))


def _deliver(ring: AttachedRing, slot: int, cfg: WorkerConfig, writer: SlotWriter, outcome: Outcome, batch: Any,
             dataset_state: bytes, epoch: int, seq: int, mailbox: Mailbox, doorbell: int) -> bool:
    """Publish ``outcome``; a batch that did not fit takes the overflow path. False: stop."""
    if outcome.status is not _NEED_MEMORY:
        _publish(ring, slot, cfg, writer, outcome, epoch, seq, doorbell)
        return True
    measure = SlotWriter(None)  # exactly what a fresh writer will need (leaf order included)
    try:
        needed = measure.finish(batch, dataset_state)
    except Exception:  # it was measured once already; whatever fails now is this batch's error
        error = Outcome(Status.ERROR, error=_wrap(where=f"in DataLoader worker process {cfg.worker_id}"))
        _publish(ring, slot, cfg, writer, error, epoch, seq, doorbell)
        return True
    _publish(ring, slot, cfg, writer, Outcome(Status.NEED_MEMORY, needed=needed), epoch, seq, doorbell)
    reply = mailbox.expect("memory", slot)
    if reply is None:
        return False
    _, _, size, fd = reply
    if not size:
        return True  # the consumer no longer wants this batch (a new epoch began)
    if size < 0:  # no room in memory_budget while the consumer holds it: a pickled copy
        try:
            payload = pickle.dumps((batch, dataset_state), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            error = Outcome(Status.ERROR, error=_wrap(where=f"in DataLoader worker process {cfg.worker_id}"))
            _publish(ring, slot, cfg, writer, error, epoch, seq, doorbell)
            return True
        _publish(ring, slot, cfg, writer, Outcome(Status.OK, needed=len(payload)), epoch, seq, doorbell, Region.PIPE)
        mailbox.conn.send_bytes(payload)  # after publishing: the consumer reads as we write
        return True
    try:
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    overflow = SlotWriter(mm)
    overflow.begin(0, size)
    try:
        overflow.finish(batch, dataset_state)
        if not overflow.fits:
            raise RuntimeError(f"the batch measured {needed:,} bytes, then needed more than the {size:,} granted")
        outcome = Outcome(Status.OK, needed=needed)
    except Exception:
        outcome = Outcome(Status.ERROR, error=_wrap(where=f"in DataLoader worker process {cfg.worker_id}"))
    del overflow, mm  # unmapped once the writer's views are gone; the consumer keeps its own mapping
    _publish(ring, slot, cfg, writer, outcome, epoch, seq, doorbell,
             Region.OVERFLOW if outcome.status is Status.OK else Region.SLOT)
    return True


def _worker_loop(cfg: WorkerConfig, conn: Any, doorbell: int) -> None:
    parent = ParentWatch(cfg.parent_pid)
    init_error = _init(cfg)
    producer = _Producer(cfg)
    probe_writer = SlotWriter(None)
    pending: tuple[int, int, Outcome, Any, bytes] | None = None
    batch: Any = None
    # Setup phase: the pipe carries the probe, then the ring's geometry and the segment's fd.
    while True:
        if not conn.poll(cfg.parent_check_s):
            if not parent.alive():
                return
            continue
        msg = conn.recv()
        if msg[0] == "stop":
            return
        if msg[0] == "probe":
            _, epoch, seq, index = msg
            if init_error is not None:
                outcome, batch = Outcome(Status.INIT_ERROR, error=init_error), None
                init_error = None
            else:
                probe_writer.begin(0, 0)
                outcome, batch = producer.produce(epoch, index, probe_writer, slot_collate_map(probe_writer))
                if outcome.status is Status.NEED_MEMORY:
                    outcome = Outcome(Status.PROBED, needed=outcome.needed)
            pending = (epoch, seq, outcome, batch, producer.dataset_state)
            conn.send(("probed", int(outcome.status), outcome.needed,
                       None if outcome.error is None else picklable(outcome.error)))
            continue
        geometry: RingGeometry = msg[1]
        pending_slot: int = msg[2]
        segment = reduction.recv_handle(conn)  # sent right after the geometry
        break
    ring = AttachedRing.by_fd(geometry, segment, cfg.worker_id)
    ring.counters[cfg.worker_id][Counter.STARTED_NS] = time.monotonic_ns()
    conn.send(("attached",))
    mailbox = Mailbox(conn, parent, cfg.parent_check_s)
    if pending is not None and pending_slot >= 0:
        writer = SlotWriter(ring.mm)
        epoch, seq, outcome, batch, dataset_state = pending
        writer.begin(ring.geometry.data_offset(pending_slot), ring.geometry.data_bytes)
        if outcome.status is Status.PROBED:
            try:
                needed = writer.finish(batch, dataset_state)
                outcome = Outcome(Status.OK if writer.fits else Status.NEED_MEMORY, needed=needed)
            except Exception:  # the first batch could be measured but not written: its error
                outcome = Outcome(Status.ERROR, error=_wrap(where=f"in DataLoader worker process {cfg.worker_id}"))
                batch = None
        if not _deliver(ring, pending_slot, cfg, writer, outcome, batch, dataset_state, epoch, seq, mailbox, doorbell):
            return
    # The probe's private copy of the first batch (the writer keeps its leaves too): not for
    # the worker's whole life.
    del pending, batch, probe_writer
    _serve(cfg, ring, producer, mailbox, init_error, doorbell)


def worker_replacement(cfg: WorkerConfig, geometry: RingGeometry, segment: InheritedFd, conn: Any,
                       doorbell: InheritedFd) -> None:
    """Entry point of a worker that replaces a dead one, under any start method: it maps the
    ring through the segment's fd (the name is long gone; the semaphores live inside)."""
    try:
        parent = ParentWatch(cfg.parent_pid)
        init_error = _init(cfg)
        ring = AttachedRing.by_fd(geometry, segment.fd, cfg.worker_id)
        ring.counters[cfg.worker_id][Counter.STARTED_NS] = time.monotonic_ns()
        _serve(cfg, ring, _Producer(cfg), Mailbox(conn, parent, cfg.parent_check_s), init_error, doorbell.fd)
    except (KeyboardInterrupt, EOFError, BrokenPipeError, ConnectionResetError):
        pass  # as in worker_main


def _reattach(cfg: WorkerConfig, old: AttachedRing, mailbox: Mailbox) -> AttachedRing | None:
    """The ring grew: attach to the new one (counters carried over), tell the consumer."""
    msg = mailbox.expect("ring")
    if msg is None:
        return None
    ring = AttachedRing.by_fd(msg[2], msg[3], cfg.worker_id)
    ring.counters[cfg.worker_id][:] = old.counters[cfg.worker_id]
    mailbox.conn.send(("attached",))
    return ring


def _serve(cfg: WorkerConfig, ring: AttachedRing, producer: _Producer, mailbox: Mailbox,
           init_error: ExceptionWrapper | None, doorbell: int) -> None:
    """Steady state: tasks from the queue, batches into slots; shared memory and semaphores only
    (the setup connection only for what does not fit: overflow memory, a grown ring)."""
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
            continue
        slot, epoch, seq, index = task
        if index is None:  # the pickled index did not fit the slot: it came over the connection
            msg = mailbox.expect("index", slot)
            if msg is None:
                return
            index = pickle.loads(msg[2])
        elif type(index) is bytes:
            index = pickle.loads(index)
        start = ring.data_offsets[slot]
        began = time.monotonic_ns()
        writer.begin(start, ring.data_bytes)
        batch = None
        if init_error is not None:
            outcome, init_error = Outcome(Status.INIT_ERROR, error=init_error), None
        else:
            outcome, batch = producer.produce(epoch, index, writer, fn_map)
        spent = time.monotonic_ns() - began
        counters = ring.counters[cfg.worker_id]
        counters[_BUSY_NS] += spent
        counters[_BATCHES] += 1
        if not _deliver(ring, slot, cfg, writer, outcome, batch, producer.dataset_state, epoch, seq, mailbox, doorbell):
            return
        del batch
        if spent > LONG_BATCH_NS:
            # A sync next() waiting for a batch yields its CPU rather than sleeping (_consume's
            # _yield_for_ready), so when every CPU runs a worker it waits in a run queue behind
            # one until that worker's time slice ends: milliseconds, when batches take that
            # long, while the next tasks wait for it to take this batch. Sharing its run queue,
            # this worker hands it the CPU now; alone, the call returns at once (< 1 µs).
            os.sched_yield()
