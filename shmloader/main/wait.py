"""Waiting (main process): how ``next()`` and ``async for`` wait when nothing is ready.

The iterator's steps (``main.iterator``) never wait themselves: they yield a *wait request* and
are resumed once it is fulfilled. This module fulfils the three kinds, two ways:

- ``Ready(scope)``: a published slot of the scope's ring. Sync: yield the CPU and look again a few times
  (``YieldWait``), then check the workers and the timeout, then sleep on the wake semaphore
  for at most ``CHECK_S``, woken by the result the awaited word names (in order, the next one
  the loop takes: a batch published ahead of it wakes nobody). Async: the doorbell eventfd
  (workers write it while the doorbell flag in the segment is set) and the workers' process
  sentinels, on the running event loop.
- ``Copy(scope)``: the oldest device copy out of the scope's ring. Sync: its CUDA event,
  synchronized. Async: its event queried from the loop at growing intervals.
- ``Conns(workers)``: a message on those workers' connections (start-up, a grown ring).

A token taken from the ready semaphore while waiting is banked in the scheduler (a token
means "look for DONE slots"). Worker deaths are noticed within ``CHECK_S`` either way.
"""

from __future__ import annotations

import asyncio
import signal
import time
from multiprocessing import connection as mp_connection
from typing import TYPE_CHECKING, Callable, NamedTuple, Union

from shmloader._stats import Counters
from shmloader.main.scope import RingScope
from shmloader.wire.ring import YieldWait

if TYPE_CHECKING:
    from shmloader.main.lifecycle import Lifecycle

CHECK_S = 0.25  # how often a blocked sync wait checks worker liveness


class Ready(NamedTuple):
    """Wait for a published slot of ``scope``'s ring."""

    scope: RingScope

    @property
    def kind(self) -> str:
        return "ready"


class Copy(NamedTuple):
    """Wait for the oldest device copy out of ``scope``'s ring."""

    scope: RingScope

    @property
    def kind(self) -> str:
        return "copy"


class Conns(NamedTuple):
    """Wait for a message on these workers' connections (start-up, a grown ring)."""

    workers: list[int]

    @property
    def kind(self) -> str:
        return "conns"


Request = Union[Ready, Copy, Conns]


class Waiter:
    """Each wait takes ``check`` (the iterator's: it replaces dead workers or raises, and raises
    past the timeout) and ``deadline`` (the user's timeout as a ``time.monotonic()`` value, or
    None). (Passed per call: held here, they would make a reference cycle through the iterator,
    which must die, and stop its workers, as soon as it is dropped.)"""

    def __init__(self, life: Lifecycle, counters: Counters) -> None:
        self.life = life
        self.counters = counters
        self.yields = YieldWait()  # a sync next()'s, before it sleeps on the wake semaphore

    # ----------------------------------------------------------------- sync
    def block(self, request: Request, check: Callable[[], None], deadline: float | None) -> None:
        began = time.perf_counter()
        try:
            self._block(request, check, deadline)
        finally:
            self.counters.blocked_s += time.perf_counter() - began
            self.counters.waits += 1

    def _block(self, request: Request, check: Callable[[], None], deadline: float | None) -> None:
        if isinstance(request, Copy):
            request.scope.reap(block=True)
            return
        if isinstance(request, Ready):
            scope = request.scope
            ring = scope.ring
            if self.yields(ring.mm, ring.ready_sem):
                scope.sched.bank_token()
                return
            check()  # only before sleeping: a batch that came while yielding needs no waitpid
            sched = scope.sched
            awaited = sched.awaited()  # (slot, seq), or None: any result
            try:
                ring.await_result(None if awaited is None else awaited[1])  # before the last look: publishers see it
                # The last look. With a batch named: it, or a result that asks for memory, is
                # published (perhaps before the naming, its token matched with another DONE slot);
                # a batch ahead of the named one does not end the wait. With none: a token.
                if awaited is None:
                    looked = ring.take_ready(0)
                else:
                    looked = sched.wanted(awaited[0])
                if looked:
                    sched.bank_token()
                    return
                ring.sleep_awaited(self.sleep_s(deadline))  # a signal's handler (Ctrl-C) raises through it
            finally:
                ring.stop_awaiting()
            return
        pool = self.life.pool
        mp_connection.wait([pool.conns[w] for w in request.workers] + pool.sentinels, self.sleep_s(deadline))

    def sleep_s(self, deadline: float | None) -> float:
        """How long a sync wait may sleep before it looks again: CHECK_S (worker deaths are
        seen within it), never past the user's ``timeout``."""
        if deadline is None:
            return CHECK_S
        return max(0.0, min(CHECK_S, deadline - time.monotonic()))

    # ---------------------------------------------------------------- async
    async def wait(self, request: Request, check: Callable[[], None], deadline: float | None) -> None:
        began = time.perf_counter()
        try:
            await self._wait(request, check, deadline)
        finally:
            self.counters.blocked_s += time.perf_counter() - began
            self.counters.waits += 1

    async def _wait(self, request: Request, check: Callable[[], None], deadline: float | None) -> None:
        if isinstance(request, Copy):
            await self._copy(request.scope, check)
            return
        life = self.life
        loop = asyncio.get_running_loop()
        ring = None
        if isinstance(request, Ready):
            check()
            scope = request.scope
            ring = scope.ring
            ring.want_doorbell(True)  # workers ring the doorbell only while we wait on it
            life.doorbell.drain()  # before the last look, so a post after the look still wakes us
            if ring.take_ready(0):
                ring.want_doorbell(False)
                scope.sched.bank_token()
                return
            fds = [life.doorbell.fd]
        else:
            fds = [life.pool.conns[w].fileno() for w in request.workers]
        fds += life.pool.sentinels
        woken = loop.create_future()

        def wake() -> None:
            if not woken.done():
                woken.set_result(None)

        for fd in fds:
            loop.add_reader(fd, wake)
        timer = None
        if deadline is not None:
            timer = loop.call_at(loop.time() + max(0.0, deadline - time.monotonic()), wake)
        try:
            await woken
        finally:
            for fd in fds:
                loop.remove_reader(fd)
            if timer is not None:
                timer.cancel()
            if ring is not None and not life.stopped:
                ring.want_doorbell(False)

    async def _copy(self, scope: RingScope, check: Callable[[], None]) -> None:
        """Wait for the oldest device copy without blocking the event loop: its CUDA event is
        queried from the loop, at intervals that grow from 50 µs to 2 ms (a copy of a large
        batch takes milliseconds; a small one is seen at once). Dead workers and the timeout
        are checked meanwhile."""
        stager = scope.stager
        assert stager is not None
        delay = 50e-6
        while stager.copying and not stager.copying[0][0].query():
            check()
            await asyncio.sleep(delay)
            delay = min(2 * delay, 2e-3)


def interrupted() -> bool:
    """Whether the running task is being cancelled for Ctrl-C: ``asyncio.run`` (and
    ``uvloop.run``, through ``asyncio.Runner``) answers SIGINT by cancelling the main task, and
    raises KeyboardInterrupt once it has ended. Seen through the handler it installed (its
    count of interrupts); any other cancellation (a timeout around ``anext``) is not one."""
    runner_type = getattr(asyncio, "Runner", None)  # (3.11: on 3.10 asyncio.run raises KeyboardInterrupt itself)
    if runner_type is None:
        return False
    handler = signal.getsignal(signal.SIGINT)
    runner = getattr(getattr(handler, "func", None), "__self__", None)
    return isinstance(runner, runner_type) and getattr(runner, "_interrupt_count", 0) > 0
