"""A Python model of ``_native.Scheduler``: the slot table's transitions and the per-batch step,
written plainly, for the tests to hold the native one to (tests/unit/test_slots.py,
tests/unit/test_step.py); and ``Handoff``, the hand-off protocol between the consumer and the
workers around it (tests/unit/test_handoff.py). It is the specification, not a second
implementation: nothing in shmloader uses it."""

from __future__ import annotations

import copy
from typing import Any

from shmloader import _native
from shmloader.main.scheduler import Scheduler, SlotState, Step, Task
from shmloader.wire.layout import AWAIT_ANY, AWAIT_NONE, DONE, Field, Region, Status
from shmloader.wire.ring import POSTED, Ring

FREE, IN_FLIGHT, WAITING, READY, LENT = (SlotState.FREE, SlotState.IN_FLIGHT, SlotState.WAITING, SlotState.READY,
                                         SlotState.LENT)


class ModelTable:
    def __init__(self, num_slots: int, num_workers: int, cap: int, in_order: bool = True, epoch: int = 0) -> None:
        self.num_slots, self.num_workers, self.cap, self.in_order, self.epoch = num_slots, num_workers, cap, in_order, epoch
        self.state = [FREE] * num_slots
        self.free = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 is used first
        self.tasks: dict[int, Task] = {}  # in dispatch order
        self.load = [0] * num_workers
        self.outstanding = 0
        self.active = [True] * num_workers
        self.rr = 0
        self.send_seq = self.rcvd_seq = self.banked = 0
        self.exhausted = False  # the epoch has no more tasks: the sampler is exhausted, or every shard ended
        self.unposted: list[int] = []
        self.tails = [0] * num_workers  # entries queued per worker on the ring (attached: all 0)

    def set_cap(self, cap: int) -> None:
        self.cap = cap

    def awaited(self) -> tuple[int, int] | None:
        """(slot, seq) of the one result whose publication must wake a consumer that sleeps now,
        or None (any may): in order, the next to take, when its task is in flight and nothing
        else may need the consumer first (a slot waiting for memory, a past epoch's task, a task
        unposted)."""
        if (not self.in_order or self.waiting_count or self.unposted
                or any(t.epoch != self.epoch for s, t in self.tasks.items() if self.state[s] is not READY)):
            return None
        for slot, task in self.tasks.items():
            if task.seq == self.rcvd_seq:
                return (slot, task.seq) if self.state[slot] is IN_FLIGHT else None
        return None

    def wanted(self, ring: Ring, slot: int) -> bool:
        """The last look of a consumer about to sleep for ``slot``'s batch: a slot in flight is
        published that it must step for, ``slot`` itself or one whose result asks for memory or
        comes over its pipe."""
        for s in self.tasks:
            hdr = ring.headers[s]
            if self.state[s] is IN_FLIGHT and hdr[Field.STATE] == DONE and (
                    s == slot or hdr[Field.STATUS] == Status.NEED_MEMORY or hdr[Field.REGION] == Region.PIPE):
                return True
        return False

    def bank_token(self) -> None:
        self.banked += 1

    def skip_result(self, seq: int) -> None:
        assert seq >= self.rcvd_seq
        self.rcvd_seq = seq + 1

    def start_round_robin_at(self, worker: int) -> None:
        assert 0 <= worker < self.num_workers
        self.rr = worker

    @property
    def waiting_count(self) -> int:
        return self.state.count(WAITING)

    def ready(self) -> dict[int, int]:
        """seq -> slot of the READY slots."""
        return {self.tasks[s].seq: s for s in self.tasks if self.state[s] is READY}

    def _expect(self, slot: int, *states: SlotState) -> None:
        if self.state[slot] not in states:
            raise AssertionError(f"slot {slot} is {self.state[slot].name}, expected {[s.name for s in states]}")

    def _free(self, slot: int) -> None:
        self.tasks.pop(slot, None)
        self.state[slot] = FREE
        self.free.append(slot)

    def _leave_worker(self, slot: int) -> None:
        task = self.tasks[slot]
        self.load[task.worker] -= 1
        self.outstanding -= task.epoch == self.epoch

    def dispatch(self, worker: int, seq: int, index: Any) -> int:
        slot = self.free.pop()
        self._expect(slot, FREE)
        self.state[slot] = IN_FLIGHT
        self.tasks[slot] = Task(worker, self.epoch, seq, index, 0)
        self.load[worker] += 1
        self.outstanding += 1
        return slot

    def redispatch(self, slot: int, worker: int, seq: int, index: Any) -> None:
        self._expect(slot, FREE)
        self.free.remove(slot)
        self.state[slot] = IN_FLIGHT
        self.tasks[slot] = Task(worker, self.epoch, seq, index, 0)
        self.load[worker] += 1
        self.outstanding += 1

    def done(self, slot: int) -> bool:
        self._expect(slot, IN_FLIGHT)
        task = self.tasks[slot]
        self.load[task.worker] -= 1
        if task.epoch != self.epoch:
            self._free(slot)
            return False
        self.outstanding -= 1
        self.state[slot] = READY
        return True

    def overflowed(self, slot: int, needed: int) -> bool:
        self._expect(slot, IN_FLIGHT)
        if self.tasks[slot].epoch != self.epoch:
            self._leave_worker(slot)
            self._free(slot)
            return False
        self.state[slot] = WAITING
        self.tasks[slot] = self.tasks[slot]._replace(needed=needed)
        return True

    def drop(self, slot: int) -> None:
        self._expect(slot, WAITING)
        self._leave_worker(slot)
        self._free(slot)

    def granted(self, slot: int) -> None:
        self._expect(slot, WAITING)
        self.state[slot] = IN_FLIGHT

    def take(self, seq: int) -> int:
        slot = self.ready()[seq]
        self.state[slot] = LENT
        del self.tasks[slot]
        return slot

    def give_back(self, slot: int) -> None:
        self._expect(slot, LENT)
        self.state[slot] = FREE
        self.free.append(slot)

    def orphans(self, worker: int) -> list[tuple[int, Task]]:
        out = sorted(((s, t) for s, t in self.tasks.items() if t.worker == worker and self.state[s] in (IN_FLIGHT, WAITING)),
                     key=lambda st: (st[1].epoch, st[1].seq))
        for slot, _ in out:
            self._leave_worker(slot)
            self._free(slot)
        return out

    def new_epoch(self) -> None:
        self.epoch += 1
        for slot in [s for s in self.tasks if self.state[s] is READY]:  # in dispatch order
            self._free(slot)
        self.outstanding = 0
        self.send_seq = self.rcvd_seq = self.rr = 0
        self.exhausted = False
        self.active = [True] * self.num_workers

    def end_shard(self, worker: int) -> None:
        """torch's ``_workers_status[worker] = False`` at the worker's StopIteration; with every
        shard ended, torch's epoch ends once nothing is outstanding."""
        self.active[worker] = False
        if not any(self.active):
            self.exhausted = True

    def pick(self) -> int:
        """torch's ``_try_put_index``: the next active worker of the cycle; out of order, one with
        fewer than ``max_tasks // sum(_workers_status)`` tasks. None found: no task now (torch
        returns and tries again when a result is processed), never the end of the epoch."""
        n_active = sum(self.active)
        for _ in range(self.num_workers):
            w, self.rr = self.rr, (self.rr + 1) % self.num_workers
            if self.active[w] and (self.in_order or self.load[w] < self.cap // n_active):
                return w
        return -1

    # ------------------------------------------------------------- the step
    def step(self, ring: Ring, bases: dict[int, Any], alive: dict[int, bool], sampler: Any, dispatch: bool,
             take: bool) -> tuple[int, int]:
        """What ``Scheduler.step`` must do: (answer, event slot or -1). ``alive[slot]``: whether
        the base of lent ``slot`` is still held elsewhere."""
        for slot in [s for s in bases if not alive[s]]:
            del bases[slot]
            self.give_back(slot)
        while ring.take_ready(0):
            self.banked += 1
        for slot in list(self.tasks):
            if self.banked <= 0:
                break
            hdr = ring.headers[slot]
            if self.state[slot] is not IN_FLIGHT or hdr[Field.STATE] != DONE:
                continue
            task = self.tasks[slot]
            if hdr[Field.R_SEQ] != task.seq or hdr[Field.R_EPOCH] != task.epoch:
                return Step.TORN, slot
            self.banked -= 1
            if hdr[Field.STATUS] == Status.NEED_MEMORY:
                return Step.NEED_MEMORY, slot
            if hdr[Field.REGION] == Region.PIPE:
                return Step.PIPE, slot
            if not self.done(slot):
                return Step.STALE, slot
        if dispatch:
            self._fill(ring, sampler)
        if not take:
            return Step.NOT_READY, -1
        ready = self.ready()
        if self.in_order:
            slot = ready.get(self.rcvd_seq, -1)
        else:
            slot = ready[min(ready)] if ready else -1
        if slot < 0:
            return Step.NOT_READY, -1
        self.take(self.tasks[slot].seq)
        self.rcvd_seq += self.in_order
        if ring.headers[slot][Field.STATUS] != Status.OK:
            return Step.RESULT, slot
        if dispatch:
            self._fill(ring, sampler)
        return slot, -1

    def _fill(self, ring: Ring, sampler: Any) -> None:
        while self.free and len(self.tasks) < self.cap and not self.exhausted:
            worker = self.pick()
            if worker < 0:
                return  # no active worker has room now; a result that comes makes some
            try:
                index = next(sampler)
            except StopIteration:
                self.exhausted = True
                return
            slot = self.dispatch(worker, self.send_seq, index)
            self.send_seq += 1
            # The task written into its slot and queued at the worker's tail (the tails' one writer)
            entry = ring.queue_offsets[worker] + (self.tails[worker] % ring.queue_len) * 8
            if _native.post_task(ring.mm, ring.header_offsets[slot], self.epoch, self.tasks[slot].seq, index, False,
                                 ring.data_offsets[slot], ring.data_bytes, entry, slot, ring.task_sems[worker],
                                 False) == POSTED:
                self.tails[worker] += 1
            else:
                self.unposted.append(slot)


def same(native: Scheduler, model: ModelTable) -> None:
    """Assert the native table is exactly the model's."""
    native.check()
    n = model.num_slots
    assert [native.state(s) for s in range(n)] == model.state
    assert native.free_slots() == model.free
    assert native.tasks() == list(model.tasks)
    assert [native.task_of(s) for s in native.tasks()] == list(model.tasks.values())
    assert native.ready() == sorted(model.ready().values(), key=lambda s: model.tasks[s].seq)
    assert list(native.load) == model.load
    assert (native.outstanding, native.waiting_count, native.n_ready, native.n_free, native.n_tasks) == (
        model.outstanding, model.waiting_count, len(model.ready()), len(model.free), len(model.tasks))
    assert list(native.tails) == model.tails
    assert (list(native.active), native.rr, native.send_seq, native.rcvd_seq, native.banked,
            native.exhausted, native.epoch) == (model.active, model.rr, model.send_seq, model.rcvd_seq,
                                                   model.banked, model.exhausted, model.epoch)
    assert native.awaited() == model.awaited()


# ------------------------------------------------------------------ the hand-offs
RUN, LOOK, AWAIT, LAST, ASLEEP, FINISHED = "run", "look", "await", "last", "asleep", "finished"  # the consumer's (ASLEEP a worker's too)
ARM, DRAIN, PEEK, RINGING = "arm", "drain", "peek", "ringing"  # an ``async for`` consumer's, in place of AWAIT..ASLEEP
TAKE, WRITE, POST, FLAG, RING = "take", "write", "post", "flag", "ring"  # a worker's other states


def word(ring: Ring, offset: int) -> int:
    """The int64 at ``offset`` of the ring."""
    return int.from_bytes(ring.mm[offset:offset + 8], "little", signed=True)


def tokens(ring: Ring, sem: int) -> int:
    """The tokens on the semaphore at ``sem``, counted and put back."""
    n = 0
    while _native.sem_wait(ring.mm, sem, 0):
        n += 1
    for _ in range(n):
        _native.sem_post(ring.mm, sem)
    return n


class Handoff:
    """The hand-off protocol (shmloader/README.md, "Hand-offs") as processes that move one at a
    time around a scheduler's table on its ring: ``table`` is the native ``Scheduler`` (attached
    to ``ring``) or a ``ModelTable``. The semaphores are the ring's own; nobody blocks on one: a
    sleeper is a state, woken once its semaphore has a token (as a futex waiter is by a post).

    The consumer RUNs the step (collect, dispatch, take); the user drops each batch before the
    next step. After a step that found nothing, a move of its own (others may move between the
    two: the window a lost wake-up would hide in), it LOOKs: a token of the ready semaphore, if
    there is one (a yield's hit), is banked and it runs again. Without one it sleeps as
    ``main.wait.Waiter._block`` does: it AWAITs (takes the wake semaphore's stale tokens and names
    the result it waits for in the awaited word: the table's ``awaited()``, fenced), looks a
    LAST time (the table's ``wanted``: the named result DONE; with none named, a ready token):
    either way a token is banked, the word cleared, and it runs again (the result may have been
    published before the word was named, its token matched with another DONE slot); and
    without one goes ASLEEP on the wake semaphore (that look and the sleep are one); woken, it
    takes the wake token, clears the word and runs again (the step takes the ready tokens).
    The epoch's end (exhausted, nothing outstanding or ready) is FINISHED. The depth may grow
    once, at any point: ``deepen`` (another cap, as ``Scheduler.set_cap``), a move of its own.

    With ``bell`` the consumer is an ``async for`` (``main.wait.Waiter._wait``): after a step
    that found nothing it ARMs (sets the doorbell flag in the segment, fenced), DRAINs the
    doorbell (an eventfd: ``bell`` counts its writes), PEEKs (a token taken is banked and it runs
    again, the flag cleared), and without one is RINGING: its event loop waits on the eventfd,
    and once it was written it clears the flag and runs again (the step takes the tokens).

    A worker TAKEs a token of its task semaphore and its queue's next entry (or goes ASLEEP),
    WRITEs its task's result (the result fields, then STATE = DONE with a release store), then
    POSTs a token on the ready semaphore (``_native.publish``'s order; each a move here, so that
    the consumer may look between them), reads the awaited word and the doorbell FLAG (after a
    full fence) and posts the wake semaphore when the word names its result, RINGs the
    doorbell when the flag is set (``worker.loop``'s write comes after ``publish`` returns), and
    takes again.

    A lost wake-up is a state where no process can move while the consumer is not FINISHED."""

    def __init__(self, table: Scheduler | ModelTable, ring: Ring, tasks: int, deepen: int = 0,
                 bell: bool = False) -> None:
        self.table, self.ring = table, ring
        self.sampler = iter([[i] for i in range(tasks)])
        self.bases: dict[int, Any] = {}  # the lease table: each batch dropped by the user at once
        self.consumer = RUN
        self.workers: list[Any] = [TAKE] * ring.geometry.num_workers  # TAKE, ASLEEP, (WRITE | RING, slot), (POST | FLAG, slot, seq)
        self.heads = [0] * ring.geometry.num_workers  # entries each worker took from its queue
        self.delivered: list[int] = []  # the seqs of the batches taken, in order
        self.deepen = deepen  # the cap the depth grows to (0: it does not)
        self.async_for = bell  # the consumer waits on the doorbell (``async for``), not the semaphore
        self.bell = 0  # the doorbell eventfd's count
        self.awaiting: tuple[int, int] | None = None  # (slot, seq) the sync consumer named, until its last look

    def movers(self) -> list[str | int]:
        """Who can move now: "consumer", "depth" and worker ids."""
        ring = self.ring
        who: list[str | int] = []
        if (self.consumer in (RUN, LOOK, AWAIT, LAST, ARM, DRAIN, PEEK)
                or (self.consumer == ASLEEP and tokens(ring, ring.wake_sem)) or (self.consumer == RINGING and self.bell)):
            who.append("consumer")
        if self.deepen and self.consumer != FINISHED:
            who.append("depth")
        for w, state in enumerate(self.workers):
            if state != ASLEEP or tokens(ring, ring.task_sems[w]):
                who.append(w)
        return who

    def move(self, who: str | int) -> None:
        if who == "consumer":
            self._consumer()
        elif who == "depth":
            self.table.set_cap(self.deepen)
            self.deepen = 0
        else:
            assert isinstance(who, int)
            self._worker(who)

    def _step(self) -> int:
        if isinstance(self.table, ModelTable):
            got, _ = self.table.step(self.ring, self.bases, dict.fromkeys(self.bases, False), self.sampler, True, True)
            return int(got)
        return int(self.table.step(self.bases, self.sampler, True, True))

    def _consumer(self) -> None:
        ring, table = self.ring, self.table
        if self.consumer in (ARM, DRAIN, PEEK, RINGING):
            self._async_wait()
            return
        if self.consumer in (AWAIT, LAST, ASLEEP):
            self._sleep()
            return
        if self.consumer == LOOK:
            if _native.sem_wait(ring.mm, ring.ready_sem, 0):  # a token came while it yielded
                table.bank_token()
                self.consumer = RUN
            else:
                self.consumer = AWAIT
            return
        got = self._step()
        if got >= 0:
            self.delivered.append(int(ring.headers[got][Field.R_SEQ]))
            self.bases[got] = object()  # (the user's batch, dropped at once: the next step gives it back)
        elif got != Step.NOT_READY:
            raise AssertionError(f"step answered {Step(got)!r} for plain batches")
        elif table.exhausted and not table.outstanding and not (table.n_ready if isinstance(table, Scheduler)
                                                                  else len(table.ready())):
            self.consumer = FINISHED
        else:
            self.consumer = ARM if self.async_for else LOOK

    def _sleep(self) -> None:
        """One move of a sync ``next()``'s sleep (``Waiter._block``'s order, through the ring's
        ``await_result``, ``take_ready`` and ``sleep_awaited``)."""
        ring = self.ring
        if self.consumer == AWAIT:  # (one move: a publisher between the two only leaves a stale wake token)
            self.awaiting = self.table.awaited()
            ring.await_result(None if self.awaiting is None else self.awaiting[1])
            self.consumer = LAST
        elif self.consumer == LAST:
            awaiting, self.awaiting = self.awaiting, None
            if awaiting is None:
                hit = ring.take_ready(0)
            elif isinstance(self.table, ModelTable):
                hit = self.table.wanted(ring, awaiting[0])
            else:
                hit = self.table.wanted(awaiting[0])
            if hit:
                ring.stop_awaiting()
                self.table.bank_token()
                self.consumer = RUN
            else:
                self.consumer = ASLEEP
        else:  # ASLEEP, and the wake semaphore has a token: it wakes
            assert ring.sleep_awaited(0)
            ring.stop_awaiting()
            self.consumer = RUN

    def _async_wait(self) -> None:
        """One move of an ``async for``'s wait for a batch (``Waiter._wait``'s order)."""
        ring = self.ring
        if self.consumer == ARM:
            ring.want_doorbell(True)
            self.consumer = DRAIN
        elif self.consumer == DRAIN:
            self.bell = 0
            self.consumer = PEEK
        elif self.consumer == PEEK:
            if _native.sem_wait(ring.mm, ring.ready_sem, 0):
                ring.want_doorbell(False)
                self.table.bank_token()
                self.consumer = RUN
            else:
                self.consumer = RINGING
        else:  # RINGING, and the doorbell was written: the loop's reader runs
            ring.want_doorbell(False)
            self.consumer = RUN

    def _worker(self, w: int) -> None:
        ring, state = self.ring, self.workers[w]
        if state == ASLEEP:
            self.workers[w] = TAKE  # woken: it takes again
        elif state == TAKE:
            if not _native.sem_wait(ring.mm, ring.task_sems[w], 0):
                self.workers[w] = ASLEEP
                return
            slot = int(ring.queues[w][self.heads[w] % ring.queue_len])
            self.heads[w] += 1
            self.workers[w] = (WRITE, slot)
        elif state[0] == WRITE:
            slot = state[1]
            hdr = ring.headers[slot]
            hdr[Field.R_SEQ], hdr[Field.R_EPOCH] = hdr[Field.SEQ], hdr[Field.EPOCH]
            hdr[Field.STATUS], hdr[Field.REGION] = int(Status.OK), int(Region.SLOT)
            _native.store_release(ring.mm, ring.state_offsets[slot], DONE)
            self.workers[w] = (POST, slot, int(hdr[Field.R_SEQ]))
        elif state[0] == POST:
            _native.sem_post(ring.mm, ring.ready_sem)
            self.workers[w] = (FLAG, state[1], state[2])
        elif state[0] == FLAG:  # (the read and the wake's post one move: a worker in between can always move on)
            # (its seq as it published it: the slot may be taken and written anew by now)
            awaited, flag = word(ring, ring.awaited_word), word(ring, ring.doorbell_flag)
            if awaited == AWAIT_ANY or (awaited != AWAIT_NONE and awaited == state[2] + 1):
                _native.sem_post(ring.mm, ring.wake_sem)
            self.workers[w] = (RING, state[1]) if flag else TAKE
        else:
            self.bell += 1
            self.workers[w] = TAKE

    def key(self) -> tuple[Any, ...]:
        """The whole state (for a ModelTable's run): the ring's bytes, semaphores included, the
        table, every process and what was delivered."""
        assert isinstance(self.table, ModelTable)
        return (bytes(self.ring.mm), repr(sorted(vars(self.table).items())), self.consumer, tuple(self.workers),
                tuple(self.heads), tuple(self.delivered), tuple(sorted(self.bases)), self.deepen, self.bell,
                self.awaiting)

    def snapshot(self) -> tuple[Any, ...]:
        """Everything a move may change (for a ModelTable's run), to go back to with ``restore``."""
        assert isinstance(self.table, ModelTable)
        return (bytes(self.ring.mm), copy.deepcopy(self.table), copy.copy(self.sampler), self.consumer,
                list(self.workers), list(self.heads), list(self.delivered), dict(self.bases), self.deepen, self.bell,
                self.awaiting)

    def restore(self, snapshot: tuple[Any, ...]) -> None:
        (mm, table, sampler, self.consumer, workers, heads, delivered, bases, self.deepen, self.bell,
         self.awaiting) = snapshot
        self.ring.mm[:] = mm
        self.table, self.sampler = copy.deepcopy(table), copy.copy(sampler)
        self.workers, self.heads, self.delivered, self.bases = list(workers), list(heads), list(delivered), dict(bases)
