"""Worker processes: start, watch, stop. Knows processes and pipes, not slots."""

from __future__ import annotations

import array
import dataclasses
import errno
import os
import pickle
import signal
import socket
import time
from multiprocessing import reduction
from typing import Any, Callable

from shmloader._errors import ShmLoaderError, WorkerDiedError
from shmloader.wire.layout import STOP_TASK
from shmloader.wire.messages import Memory, Stop
from shmloader.wire.ring import Ring
from shmloader.worker.loop import InheritedFd, worker_main, worker_replacement
from shmloader.worker.produce import WorkerConfig

JOIN_GRACE_S = 0.5  # a worker stuck in user code is terminated after this
DEATH_GRACE_S = 5.0  # a worker whose connection broke has this long to exit before it is an error


class WorkerPool:
    def __init__(self, ctx: Any, configs: list[WorkerConfig], doorbell: int) -> None:
        self.ctx = ctx
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.configs = configs
        self.stopped = False
        try:
            for cfg in configs:
                proc, conn = self._start(cfg, doorbell)
                self.procs.append(proc)
                self.conns.append(conn)
        except BaseException:
            self.stop()
            raise

    def _start(self, cfg: WorkerConfig, doorbell: int) -> tuple[Any, Any]:
        parent_end, child_end = self.ctx.Pipe(duplex=True)
        proc = self.ctx.Process(
            target=worker_main, args=(cfg, child_end, InheritedFd(doorbell)), daemon=True,
            name=f"shmloader-worker-{cfg.worker_id}",
        )
        proc.start()
        child_end.close()
        return proc, parent_end

    @property
    def sentinels(self) -> list[int]:
        return [p.sentinel for p in self.procs]

    def dead(self) -> list[int]:
        """Workers that exited while they should be running."""
        if self.stopped:
            return []
        return [wid for wid, proc in enumerate(self.procs) if proc.exitcode is not None]

    def death(self, wid: int) -> str:
        """'DataLoader worker 1 (pid 123) was killed by signal SIGKILL' (or exited with code N,
        which a worker does only through the user's sys.exit / os._exit / SystemExit)."""
        proc = self.procs[wid]
        code = proc.exitcode
        if code is not None and code < 0:
            how = f"was killed by signal {signal.Signals(-code).name}"
        else:
            how = (f"exited with code {code} on its own (sys.exit, os._exit or SystemExit in the dataset or "
                   "worker_init_fn: raise an exception instead)")
        return f"DataLoader worker {wid} (pid {proc.pid}) {how}"

    def killed(self, wid: int) -> bool:
        """Whether worker ``wid`` died of a signal (the OOM killer's SIGKILL, a crash)."""
        code = self.procs[wid].exitcode
        return code is not None and code < 0

    def check_alive(self) -> None:
        """Raise WorkerDiedError naming the first worker that exited."""
        for wid in self.dead():
            raise WorkerDiedError(
                f"{self.death(wid)} unexpectedly. If it ran out of memory, lower batch_size, "
                "num_workers or prefetch_factor."
            )

    def restart(self, wid: int, doorbell: int) -> None:
        """Start worker ``wid`` afresh (it died before a ring existed: while it was probing the
        first batch), with a new connection; it begins with the setup protocol again."""
        self.procs[wid].join()
        self.conns[wid].close()
        self.procs[wid], self.conns[wid] = self._start(self.configs[wid], doorbell)

    def replace(self, wid: int, ring: Ring, doorbell: int,
                dataset_state: tuple[bytes, int, bool] | None = None) -> None:
        """Start a new worker ``wid`` (same start method) that maps the ring through its fd, with
        a new connection (closing the old one drops whatever the dead worker had queued on it).
        ``dataset_state``: the worker snapshot it resumes from, its epoch, and whether it was taken in
        an earlier epoch (``WorkerConfig.dataset_state_done``)."""
        ctx = self.ctx
        self.procs[wid].join()
        self.conns[wid].close()
        parent_end, child_end = ctx.Pipe(duplex=True)
        self.conns[wid] = parent_end
        cfg = self.configs[wid]
        if dataset_state is not None:
            cfg = dataclasses.replace(cfg, dataset_state=dataset_state[0], dataset_state_epoch=dataset_state[1],
                                      dataset_state_done=dataset_state[2])
        proc = ctx.Process(
            target=worker_replacement,
            args=(cfg, ring.geometry, InheritedFd(ring.fd), child_end, InheritedFd(doorbell)),
            daemon=True, name=f"shmloader-worker-{wid}",
        )
        proc.start()
        child_end.close()
        self.procs[wid] = proc

    def send_memory(self, wid: int, slot: int, size: int, fd: int = -1) -> None:
        """Answer ``wid``'s request for overflow memory: ``size`` bytes at ``fd``; 0: drop the
        batch; -1: send it pickled over the connection instead. A worker that died meanwhile
        is left to the consumer's next liveness check (its tasks are dispatched again).

        Sent once per batch while the user holds the ring, so it costs what it must: the
        message as ``Connection.send`` frames it, pickled plainly (multiprocessing's pickler
        copies every registered reducer per call: ~70 µs), and the descriptor as
        ``reduction.send_handle`` sends it (one byte with it), without duplicating the
        connection's descriptor for it."""
        conn = self.conns[wid]
        try:
            conn.send_bytes(pickle.dumps(Memory(slot, size), pickle.HIGHEST_PROTOCOL))
            if size > 0:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=conn.fileno())
                try:
                    sock.sendmsg([b"\x01"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
                finally:
                    sock.detach()  # (the descriptor stays the connection's)
        except OSError as error:
            self._dead_or_raise(wid, error)

    def send(self, wid: int, msg: tuple[Any, ...], fd: int | None = None, dead_ok: bool = False) -> bool:
        """Send ``msg`` to worker ``wid``, then the descriptor ``fd`` if given (the worker reads
        it right after the message). If it died: with ``dead_ok``, False (the consumer's next
        liveness check replaces it and dispatches its tasks again); otherwise WorkerDiedError."""
        try:
            self.conns[wid].send(msg)
            if fd is not None:
                reduction.send_handle(self.conns[wid], fd, self.procs[wid].pid)
        except OSError as error:
            if not dead_ok:
                self.check_alive()
                raise
            self._dead_or_raise(wid, error)
            return False
        return True

    def recv(self, wid: int, raw: bool = False) -> Any:
        """The next message from worker ``wid`` (its bytes with ``raw``), or None when the worker
        died (its end of the connection closed with it): the consumer's next liveness check
        replaces it and dispatches its tasks again. A connection that broke while the worker
        still runs is an error (ShmLoaderError), never taken for a death."""
        try:
            return self.conns[wid].recv_bytes() if raw else self.conns[wid].recv()
        except (EOFError, OSError) as error:
            self._dead_or_raise(wid, error)
            return None

    def _dead_or_raise(self, wid: int, error: BaseException) -> None:
        """The connection to ``wid`` broke (``error``): it is exiting (it closed its end), so
        wait for it; one still alive after that is an error, raised."""
        proc = self.procs[wid]
        proc.join(timeout=DEATH_GRACE_S)
        if proc.exitcode is None:
            raise ShmLoaderError(
                f"the connection to DataLoader worker {wid} (pid {proc.pid}) broke ({type(error).__name__}: "
                f"{error}) while the worker still runs; something in the worker closed or wrote to the "
                "loader's pipe (a library closing inherited file descriptors?). Start a new epoch with "
                "iter(loader)."
            ) from error

    def stop(self, push: Callable[[int, int], None] | None = None) -> None:
        """Ask every worker to stop (``push``: the scheduler's, which queues STOP_TASK on the
        ring), wait briefly, then terminate stragglers. Idempotent."""
        if self.stopped:
            return
        self.stopped = True
        for wid, proc in enumerate(self.procs):
            if proc.exitcode is None:
                if push is not None:
                    try:
                        push(wid, STOP_TASK)
                    except (OSError, RuntimeError):
                        pass  # (no ring attached, or its semaphore failed: the message and the join below stop it)
                try:
                    self.conns[wid].send(Stop())
                except OSError:
                    pass
        deadline = time.monotonic() + JOIN_GRACE_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.exitcode is None:
                proc.terminate()
                proc.join(JOIN_GRACE_S)
            if proc.exitcode is None:
                os.kill(proc.pid, signal.SIGKILL)
            # Joined to the end (at once: it has exited or been killed). A process that exited
            # after its timed join, seen only through ``exitcode``, would otherwise stay in
            # multiprocessing's children with its two pipes open until the next start.
            proc.join()
        for conn in self.conns:
            try:
                conn.close()
            except OSError as exc:
                # Collected in a reference cycle, a connection's own finalizer may have run
                # first (finalizers run in any order there) and closed its fd, leaving the
                # handle set
                if exc.errno != errno.EBADF:
                    raise
