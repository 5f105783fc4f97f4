"""WorkerPool.stop reaps every worker, whenever it exits; a message to a worker that died is
left to the consumer's recovery where it may be."""

from __future__ import annotations

from typing import Any

import pytest

from shmloader._errors import ShmLoaderError, WorkerDiedError
from shmloader.main.pool import WorkerPool


class ExitsAfterItsTimedJoin:
    """A worker that exits just after its timed join gave up, so that stop() sees the exit
    only through ``exitcode`` (spawn workers tearing torch down take that long)."""

    pid = -1

    def __init__(self) -> None:
        self.exited = False
        self.reaped = False  # multiprocessing drops a process from its children once a join sees it exit

    @property
    def exitcode(self) -> int | None:
        return 0 if self.exited else None

    def join(self, timeout: float | None = None) -> None:
        if timeout is not None and not self.exited:
            self.exited = True  # ...a moment after this join returned empty-handed
            return
        self.reaped = self.exited

    def terminate(self) -> None:
        raise AssertionError("a worker that has exited is not terminated")


class Conn:
    def send(self, msg: Any) -> None:
        pass

    def close(self) -> None:
        pass


def test_stop_reaps_a_worker_that_exits_after_its_timed_join() -> None:
    pool = object.__new__(WorkerPool)
    pool.procs = [ExitsAfterItsTimedJoin(), ExitsAfterItsTimedJoin()]
    pool.conns = [Conn(), Conn()]
    pool.stopped = False
    pool.stop()
    assert all(p.reaped for p in pool.procs)  # before the fix: exitcode 0, never joined, two pipes open


class Exited:
    """A worker process that has exited (its end of the connection closed)."""

    pid = -1
    exitcode = -9

    def join(self, timeout: float | None = None) -> None:
        pass


class Alive(Exited):
    exitcode = None  # type: ignore[assignment]


class Broken(Conn):
    def send(self, msg: Any) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def send_bytes(self, payload: bytes) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def pool_of(proc: Any) -> WorkerPool:
    pool = object.__new__(WorkerPool)
    pool.procs = [proc]
    pool.conns = [Broken()]
    pool.stopped = False
    return pool


def test_a_message_to_a_dead_worker_is_left_to_recovery_or_raised() -> None:
    # dead_ok: the consumer's next liveness check replaces the worker and dispatches its tasks
    # again (an index or a memory grant sent as it died); otherwise WorkerDiedError.
    assert pool_of(Exited()).send(0, ("index", 0, b""), dead_ok=True) is False
    pool_of(Exited()).send_memory(0, 0, 4096, fd=-1)  # nothing raised, no descriptor sent
    with pytest.raises(WorkerDiedError, match="killed by signal SIGKILL"):
        pool_of(Exited()).send(0, ("index", 0, b""))
    with pytest.raises(ShmLoaderError, match=r"connection to DataLoader worker 0 \(pid -1\) broke \(BrokenPipeError: "
                                             r".*while the worker still runs") as raised:
        pool_of(Alive()).send(0, ("index", 0, b""), dead_ok=True)  # alive: not a death to recover from
    assert isinstance(raised.value.__cause__, BrokenPipeError)


class Hangs(Conn):
    def recv(self) -> Any:
        raise EOFError

    def recv_bytes(self) -> bytes:
        raise ConnectionResetError(104, "Connection reset by peer")


def test_a_read_from_a_broken_connection_is_a_death_only_if_the_worker_died(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shmloader.main.pool.DEATH_GRACE_S", 0.0)
    for raw in (False, True):
        pool = pool_of(Exited())
        pool.conns = [Hangs()]
        assert pool.recv(0, raw) is None  # dead: the consumer's liveness check replaces it
        pool.procs = [Alive()]
        with pytest.raises(ShmLoaderError, match="while the worker still runs"):
            pool.recv(0, raw)
