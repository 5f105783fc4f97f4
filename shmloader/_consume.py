"""The main process's iterator: start-up, waiting (sync and async), ordering, errors.

One generator, ``_steps``, holds all the logic of producing the next batch; it
yields a *wait request* whenever nothing is ready. ``__next__`` fulfils requests by
blocking on the ready semaphore in short timed waits (so worker deaths and timeouts
are noticed); ``__anext__`` fulfils them by awaiting the doorbell eventfd and the
workers' process sentinels on the running event loop: no helper thread, no polling.

Invariants:
- a slot is in exactly one of: free, in flight (``_inflight``), ready (``_ready``),
  lent to the user (``Leases``);
- each token of the ready semaphore stands for one in-flight slot whose header says
  DONE (the worker sets DONE before it posts);
- a result whose epoch is not the current one is discarded and its slot freed.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import time
import warnings
import weakref
from multiprocessing import connection as mp_connection
from typing import Any, Generator

import posix_ipc
import torch
from torch.utils.data.dataloader import _BaseDataLoaderIter, _DatasetKind

from . import _checkpoint, _device
from ._dispatch import Dispatcher
from ._errors import BatchTooLargeError, CorruptSlotError, WorkerDiedError
from ._budget import plan_ring
from ._layout import DONE, C, F, Status
from ._lease import Leases, copy_leaf, leaves_of, read_batch, read_extra, read_meta, slot_of
from ._pool import WorkerPool
from ._ring import Ring
from ._stats import Counters, RingOccupancy
from ._worker import WorkerConfig

CHECK_S = 0.25  # how often a blocked sync wait checks worker liveness
PARENT_CHECK_S = 0.5  # how often an idle worker checks that this process lives
_END = object()
_READY = ("ready",)


class RingIterator(_BaseDataLoaderIter):
    """Iterator over a DataLoader with ``num_workers > 0`` (sync and async)."""

    def __init__(self, loader: Any) -> None:
        super().__init__(loader)
        if loader._shm_resume_seed is not None:
            # Resuming an epoch that reused persistent workers: their base seed, and the
            # sampler RNG as that epoch found it (creating this iterator drew from it).
            self._base_seed, rng = loader._shm_resume_seed
            _checkpoint.set_rng_state(loader.generator, rng)
            self._sampler_iter = iter(self._index_sampler)
        self._loader = weakref.ref(loader)
        self._in_order: bool = loader.in_order
        self._prefetch_factor: int = loader.prefetch_factor
        self._num_slots: int = self._num_workers * self._prefetch_factor  # memory_budget may lower it
        self._slot_bytes: int | None = loader.slot_bytes
        self._first_batch_bytes: int | None = loader._shm_first_batch_bytes
        self._memory_budget: int | None = loader._shm_memory_budget
        self._counters: Counters = loader._shm_counters
        self._max_restarts: int = loader.max_worker_restarts
        self._iterable = self._dataset_kind == _DatasetKind.Iterable
        self._shutdown = True  # until the workers exist
        self._ring: Ring | None = None
        self._started = False
        self._deadline: float | None = None
        self._epoch = 0
        self._banked = 0
        self._free: list[int] = []
        self._inflight: dict[int, tuple[int, int, int, Any]] = {}  # slot -> (worker, epoch, seq, index)
        self._ready: dict[int, int] = {}  # seq -> slot
        self._dispatcher = Dispatcher(self._num_workers, self._iterable)
        self._leases = Leases(self._num_slots)
        self.pinned = False  # the ring is page-locked (pin_memory=True or device= on CUDA)
        self._device: torch.device | None = loader._shm_device
        self._device_prefetch: int = loader.device_prefetch
        self._stager: _device.DeviceStager | None = None  # made with the ring, after the fork
        self._pending_error: Exception | None = None
        resume: _checkpoint.IterableResume | None = loader._shm_resume_iterable
        ctx = loader.multiprocessing_context or torch.multiprocessing
        self._start_method: str = ctx.get_start_method()
        self._doorbell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
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
            self._pool = WorkerPool(ctx, configs, self._doorbell)
        except BaseException:
            os.close(self._doorbell)
            raise
        self._shutdown = False
        self._reset(loader, first_iter=True)
        if resume is not None:  # continue the round-robin where the checkpointed epoch was
            self._dispatcher.active = list(resume.active)
            if resume.last_worker is not None:
                self._dispatcher.skip_to(resume.last_worker + 1)

    # ---------------------------------------------------------------- epochs
    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        super()._reset(loader, first_iter)
        if not first_iter:
            self._epoch += 1
        self._free.extend(self._ready.values())
        self._ready = {}
        self.dataset_states: dict[int, bytes] = {}  # worker -> state after its last delivered batch
        self.last_worker: int | None = None  # worker of the last delivered batch
        if self._stager is not None:
            self._stager.drain()
        self._outstanding = 0
        self._send_seq = 0
        self._rcvd_seq = 0
        self._sampler_done = False
        self._dispatcher.reset()

    @property
    def shut_down(self) -> bool:
        return self._shutdown

    # ----------------------------------------------------------------- logic
    def _steps(self) -> Generator[tuple[Any, ...], None, Any]:
        if self._stager is not None and self._stager.staged:
            return self._pop_staged()  # batches staged before an error or shutdown come first
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise error
        if self._shutdown:
            return _END
        self._deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        if not self._started and not self._sampler_done:
            yield from self._start()
        while True:
            stager = self._stager
            if self._ring is not None:
                self._free.extend(self._leases.take_returned())
                if stager is not None:
                    self._free.extend(stager.reap())
                self._dispatch()
                if stager is None:
                    slot = self._take_next()
                    if slot is not None:
                        return self._deliver(slot)
                else:
                    try:
                        while stager.has_room() and (slot := self._take_next()) is not None:
                            self._counters.bytes += stager.stage(self._ring, slot, self._note(slot))
                    except Exception as error:
                        if not stager.staged:
                            raise
                        self._pending_error = error  # raised in its turn, after the staged batches
                    if stager.staged:
                        return self._pop_staged()
            if self._sampler_done and not self._outstanding and not self._ready:
                if not self._persistent_workers:
                    self._shutdown_workers()
                return _END
            self._check()
            if stager is not None and stager.copying and not self._free:
                # Every slot is copying or staged: only a copy's completion frees one.
                self._free.extend(stager.reap(block=True))
                continue
            yield _READY

    def _check(self) -> None:
        """Replace dead workers (or raise); raise if the user's ``timeout`` has passed."""
        for wid in self._pool.dead():
            self._recover(wid)
        if self._deadline is not None and time.monotonic() >= self._deadline:
            raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds")

    def _start(self) -> Generator[tuple[Any, ...], None, None]:
        """Size the ring (from the first batch unless known), create it, attach every worker."""
        first = self._first_batch_bytes
        probe: tuple[int, int, Any] | None = None
        while self._slot_bytes is None and first is None:
            task = self._next_task()
            if task is None:
                return
            wid, seq, index = task
            self._pool.send(wid, ("probe", self._epoch, seq, index))
            yield from self._wait_conns([wid])
            _, status, needed, error = self._pool.conns[wid].recv()
            if status == Status.STOP:
                self._dispatcher.active[wid] = False
                self._rcvd_seq = seq + 1  # only exhausted shards came before
            elif status == Status.ERROR:
                self._shutdown_workers()
                error.reraise()
            else:
                first = needed
                loader = self._loader()
                if loader is not None:
                    loader._shm_first_batch_bytes = first  # later epochs skip the probe
                probe = (wid, seq, index)
        geometry = plan_ring(self._num_workers, self._prefetch_factor, first, self._slot_bytes, self._memory_budget)
        self._num_slots = geometry.num_slots
        ring = Ring(geometry)
        self._ring = ring
        if self._device is not None:
            self._stager = _device.DeviceStager(self._device, self._device_prefetch)
        if self._stager is not None or (self._pin_memory and self._pin_memory_device == "cuda"):
            self.pinned = _device.register_host(ring.mm, ring.geometry.total_bytes)
        elif self._pin_memory:
            _device.warn_unsupported(self._pin_memory_device)
        self._free = list(range(self._num_slots - 1, -1, -1))
        for wid in range(self._num_workers):
            pending = -1
            if probe is not None and probe[0] == wid:
                pending = self._free.pop()
                self._track(pending, wid, probe[1], probe[2])
            self._pool.send(wid, ("ring", ring.spec, pending))
        for wid in range(self._num_workers):
            yield from self._wait_conns([wid])
            reply = self._pool.conns[wid].recv()
            assert reply == ("attached",), reply
        ring.unlink()
        self._started = True

    def _recover(self, wid: int) -> None:
        """Replace dead worker ``wid`` and dispatch its tasks again, or raise WorkerDiedError.

        Its slots may be half written: each is reset and its task (same epoch, seq and
        index) goes to the least-loaded live worker, so the epoch still yields every batch
        exactly once and in order. A token it posted for a slot that is now re-dispatched
        stays banked: a token means "look for DONE slots", never "this slot is done".
        """
        tasks = sorted((seq, slot, epoch, index) for slot, (w, epoch, seq, index) in self._inflight.items() if w == wid)
        current = [t for t in tasks if t[2] == self._epoch]
        doing = f" while producing batch {current[0][0]} (index {current[0][3]!r:.200})" if current else ""
        used = self._counters.worker_restarts
        reason = None
        if not self._started:
            reason = "it died while the ring was being set up"
        elif self._iterable:
            reason = "an IterableDataset worker cannot be replaced without repeating or losing its shard"
        elif self._start_method != "fork":
            reason = f"replacing workers needs the fork start method; this loader uses {self._start_method!r}"
        elif used >= self._max_restarts:
            reason = f"{used} of max_worker_restarts={self._max_restarts} restarts are used up"
        if reason is not None:
            raise WorkerDiedError(
                f"{self._pool.death(wid)}{doing}; {reason}. If it ran out of memory, lower batch_size, "
                "num_workers or prefetch_factor; to tolerate more deaths raise max_worker_restarts."
            )
        assert self._ring is not None
        self._counters.worker_restarts += 1
        for _, slot, epoch, _ in tasks:
            del self._inflight[slot]
            self._dispatcher.load[wid] -= 1
            if epoch == self._epoch:
                self._outstanding -= 1
        self._ring.renew_queue(wid)
        self._pool.replace(wid, self._ring, self._doorbell)
        for seq, slot, epoch, index in tasks:
            if epoch != self._epoch:
                self._free.append(slot)
                continue
            target = self._dispatcher.pick()
            assert target is not None
            self._track(slot, target, seq, index)
            self._dispatcher.submit(self._ring, slot, target, self._epoch, seq, index)

    def _wait_conns(self, wids: list[int]) -> Generator[tuple[Any, ...], None, None]:
        while not all(self._pool.conns[w].poll() for w in wids):
            self._check()
            yield ("conns", wids)

    def _dispatch(self) -> None:
        assert self._ring is not None
        while self._free and not self._sampler_done:
            task = self._next_task()
            if task is None:
                return
            wid, seq, index = task
            slot = self._free.pop()
            self._track(slot, wid, seq, index)
            self._dispatcher.submit(self._ring, slot, wid, self._epoch, seq, index)

    def _next_task(self) -> tuple[int, int, Any] | None:
        """(worker, seq, index) of the epoch's next batch, or None when there is none."""
        wid = self._dispatcher.pick()
        if wid is None:
            self._sampler_done = True
            return None
        try:
            index = self._next_index()  # type: ignore[no-untyped-call]
        except StopIteration:
            self._sampler_done = True
            return None
        seq = self._send_seq
        self._send_seq += 1
        return wid, seq, index

    def _track(self, slot: int, wid: int, seq: int, index: Any) -> None:
        self._inflight[slot] = (wid, self._epoch, seq, index)
        self._outstanding += 1
        self._dispatcher.load[wid] += 1

    def _collect(self) -> None:
        """Move DONE slots from in flight to ready, one per semaphore token."""
        assert self._ring is not None
        tokens, self._banked = self._banked, 0
        sem = self._ring.ready
        assert sem is not None
        while True:
            try:
                sem.acquire(0)
            except posix_ipc.BusyError:
                break
            tokens += 1
        if not tokens:
            return
        headers = self._ring.headers
        for slot in list(self._inflight):
            if headers[slot][F.STATE] != DONE:
                continue
            wid, epoch, seq, _ = self._inflight.pop(slot)
            self._dispatcher.load[wid] -= 1
            if epoch != self._epoch:
                self._free.append(slot)
            else:
                self._outstanding -= 1
                self._ready[seq] = slot
            tokens -= 1
            if not tokens:
                break
        self._banked = tokens

    def _take_next(self) -> int | None:
        """The slot of the next batch to yield, skipping exhausted shards; raises worker errors."""
        assert self._ring is not None
        self._collect()
        while self._ready:
            if self._in_order:
                if self._rcvd_seq not in self._ready:
                    return None
                seq = self._rcvd_seq
                self._rcvd_seq += 1
            else:
                seq = min(self._ready)
            slot = self._ready.pop(seq)
            hdr = self._ring.headers[slot]
            status = int(hdr[F.STATUS])
            if status == Status.OK:
                return slot
            if status == Status.STOP:
                self._dispatcher.active[int(hdr[F.WORKER])] = False
                self._free.append(slot)
                continue
            self._fail(slot, status, seq)
        return None

    def _fail(self, slot: int, status: int, seq: int) -> None:
        assert self._ring is not None
        hdr = self._ring.headers[slot]
        g = self._ring.geometry
        if status == Status.ERROR:
            error = pickle.loads(read_meta(self._ring, slot))
            self._shutdown_workers()
            error.reraise()
        if status == Status.TOO_LARGE:
            needed = int(hdr[F.NEEDED])
            self._shutdown_workers()
            raise BatchTooLargeError(
                f"batch {seq} needs {needed:,} bytes but a ring slot holds {g.data_bytes:,} bytes "
                f"(slots are sized from the first batch plus 25% and 64 KiB, or by slot_bytes=). "
                f"Pass DataLoader(..., slot_bytes=N) with N >= {needed:,}."
            )
        self._shutdown_workers()
        raise CorruptSlotError(f"slot {slot}: unknown result status {status}")

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
        return int(self._ring.headers[slot][F.WORKER]), read_extra(self._ring, slot)

    def _delivered(self, note: tuple[int, bytes] | None) -> None:
        if note is not None:
            self.last_worker = note[0]
            if note[1]:
                self.dataset_states[note[0]] = note[1]

    def _deliver(self, slot: int) -> Any:
        assert self._ring is not None
        self._delivered(self._note(slot))
        # Never lend the last slot: a caller that keeps every batch (list(loader), a
        # replay buffer) would leave the workers nowhere to write. Copy instead.
        copy = self._leases.holding() + 1 >= self._num_slots
        try:
            batch, base, nbytes = read_batch(self._ring, slot, copy_leaf if copy else None)
        except BaseException:
            self._free.append(slot)
            raise
        self._counters.batches += 1
        self._counters.bytes += nbytes
        if copy:
            self._counters.copies += 1
            del base
            self._free.append(slot)
        else:
            self._leases.lend(slot, base)
        return batch

    # --------------------------------------------------------------- sync
    def __next__(self) -> Any:
        if torch.autograd.profiler._is_profiler_enabled:
            return super().__next__()
        # torch's __next__ without the record_function scope, which costs more than
        # a small batch's whole transport when no profiler is listening.
        data = self._next_data()
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

    def _next_data(self) -> Any:
        asked = self._counters.requested()
        steps = self._steps()
        try:
            request = next(steps)
            while True:
                self._block(request)
                request = next(steps)
        except StopIteration as stop:
            result = stop.value
        except BaseException:
            self._shutdown_workers()
            raise
        finally:
            self._counters.returned(asked)
        if result is _END:
            self._counters.epoch_ended()
            raise StopIteration
        return result

    def _block(self, request: tuple[Any, ...]) -> None:
        if request is _READY:
            assert self._ring is not None and self._ring.ready is not None
            try:
                self._ring.ready.acquire(CHECK_S)
                self._banked += 1
            except (posix_ipc.BusyError, posix_ipc.SignalError):
                pass
        else:
            conns = [self._pool.conns[w] for w in request[1]]
            mp_connection.wait(conns + self._pool.sentinels, CHECK_S)

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
        except BaseException:
            self._shutdown_workers()
            raise
        finally:
            self._counters.returned(asked)
        if result is _END:
            self._counters.epoch_ended()
            raise StopAsyncIteration
        self._count_yield()
        return result

    async def _await(self, request: tuple[Any, ...]) -> None:
        loop = asyncio.get_running_loop()
        if request is _READY:
            assert self._ring is not None and self._ring.ready is not None
            try:  # drain before the last check, so a post after the check still wakes us
                os.eventfd_read(self._doorbell)
            except BlockingIOError:
                pass
            try:
                self._ring.ready.acquire(0)
                self._banked += 1
                return
            except posix_ipc.BusyError:
                pass
            fds = [self._doorbell]
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

    # ------------------------------------------------------------ release
    def release(self, batch: Any) -> int:
        """Return the slots that ``batch`` views to the ring now. Returns how many."""
        if self._ring is None:
            return 0
        slots = {slot_of(self._ring, leaf) for leaf in leaves_of(batch)}
        return sum(self._leases.release(s) for s in slots if s is not None)

    def holding(self) -> int:
        return self._leases.holding()

    def occupancy(self) -> RingOccupancy | None:
        if self._ring is None:
            return None
        held = self._leases.holding()
        copying = 0 if self._stager is None else len(self._stager.copying)
        in_flight = len(self._inflight)
        ready = len(self._ready) + copying
        return RingOccupancy(
            slots=self._num_slots,
            slot_bytes=self._ring.geometry.data_bytes,
            free=self._num_slots - held - in_flight - ready,
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
            started, spent = int(c[C.STARTED_NS]), int(c[C.BUSY_NS])
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
            os.close(self._doorbell)

    def __del__(self) -> None:
        if not getattr(self, "_shutdown", True):
            self._shutdown_workers()
