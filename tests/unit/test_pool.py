"""WorkerPool.stop reaps every worker, whenever it exits."""

from __future__ import annotations

from typing import Any

from shmloader._pool import WorkerPool


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
