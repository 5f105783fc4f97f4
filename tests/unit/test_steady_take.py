"""``_native.steady_take`` makes exactly SlotTable's own transitions: over random tables, leases
and published headers (torn, asking for memory, piped, stale, ends of shards among them), one
call leaves the table, the lease table and the semaphore as a Python model written with
SlotTable's methods does, and answers the same (slot taken, not ready, or GENERAL with the
table as the model leaves it)."""

from __future__ import annotations

import copy
import mmap
import random
import struct
from typing import Any

import pytest

from shmloader import _native
from shmloader._consume import _GENERAL, _STEADY
from shmloader._layout import DONE, N_FIELDS, Field, Region, Status
from shmloader._slots import SlotState, SlotTable

SLOTS, WORKERS = 5, 2
SEM = 0
HEADERS = tuple(64 + s * N_FIELDS * 8 for s in range(SLOTS))
FREE, IN_FLIGHT, READY, LENT = SlotState.FREE, SlotState.IN_FLIGHT, SlotState.READY, SlotState.LENT


def header(mm: mmap.mmap, slot: int, f: int) -> int:
    value: int = struct.unpack_from("q", mm, HEADERS[slot] + 8 * f)[0]
    return value


def model(table: SlotTable, bases: dict[int, Any], mm: mmap.mmap, tokens: int, seq: int) -> tuple[int, int]:
    """What the call must do, with SlotTable's methods: (answer, tokens left)."""
    returned = [s for s, alive in bases.items() if not alive]
    if any(table.state[s] is not LENT for s in returned):
        return _GENERAL, tokens
    for s in returned:
        del bases[s]
        table.give_back(s)
    for slot in list(table.tasks):
        if tokens <= 0:
            break
        if table.state[slot] is not IN_FLIGHT or header(mm, slot, Field.STATE) != DONE:
            continue
        task = table.tasks[slot]
        if (header(mm, slot, Field.R_SEQ) != task.seq or header(mm, slot, Field.R_EPOCH) != task.epoch
                or header(mm, slot, Field.STATUS) == Status.NEED_MEMORY or header(mm, slot, Field.REGION) == Region.PIPE
                or task.epoch != table.epoch):
            return _GENERAL, tokens
        table.done(slot)
        tokens -= 1
    if seq not in table.ready:
        return -1, tokens
    slot = table.ready[seq]
    if header(mm, slot, Field.STATUS) != Status.OK:
        return _GENERAL, tokens
    table.take(seq)
    return slot, tokens


def publish(mm: mmap.mmap, table: SlotTable, slot: int, rng: random.Random) -> None:
    task = table.tasks[slot]
    fields = {Field.R_SEQ: task.seq, Field.R_EPOCH: task.epoch, Field.STATUS: Status.OK, Field.REGION: Region.SLOT}
    twist = rng.random()
    if twist < 0.05:
        fields[Field.R_SEQ] = task.seq + 1  # torn
    elif twist < 0.1:
        fields[Field.STATUS] = Status.NEED_MEMORY
    elif twist < 0.15:
        fields[Field.REGION] = Region.PIPE
    elif twist < 0.2:
        fields[Field.STATUS] = rng.choice([Status.STOP, Status.ERROR])
    for f, v in fields.items():
        struct.pack_into("q", mm, HEADERS[slot] + 8 * f, int(v))
    struct.pack_into("q", mm, HEADERS[slot] + 8 * Field.STATE, DONE)
    _native.sem_post(mm, SEM)


def plain(mm: mmap.mmap, table: SlotTable, slot: int) -> None:
    task = table.tasks[slot]
    for f, v in {Field.R_SEQ: task.seq, Field.R_EPOCH: task.epoch, Field.STATUS: Status.OK, Field.REGION: Region.SLOT}.items():
        struct.pack_into("q", mm, HEADERS[slot] + 8 * f, int(v))


@pytest.mark.parametrize("seed", range(40))
def test_steady_take_makes_slot_tables_transitions(seed: int) -> None:
    rng = random.Random(seed)
    mm = mmap.mmap(-1, 64 + SLOTS * N_FIELDS * 8)
    _native.sem_init(mm, SEM)
    table = SlotTable(SLOTS, WORKERS)
    bases: dict[int, Any] = {}  # the native call's lease table: slot -> base
    held: dict[int, Any] = {}  # what the user still holds
    banked, seq, next_seq, unposted = 0, 0, 0, 0
    for _ in range(300):
        # Random events between two calls: tasks dispatched and published, batches dropped,
        # a new epoch (tasks in flight go stale), tokens posted late.
        for _ in range(rng.randrange(4)):
            if table.free and rng.random() < 0.7:
                struct.pack_into("q", mm, HEADERS[table.free[-1]] + 8 * Field.STATE, 0)
                table.dispatch(rng.randrange(WORKERS), next_seq, [next_seq])
                next_seq += 1
        for slot in [s for s, st in enumerate(table.state) if st is IN_FLIGHT]:
            if header(mm, slot, Field.STATE) != DONE and rng.random() < 0.5:
                publish(mm, table, slot, rng)
                if rng.random() < 0.1:  # its token comes later: DONE is seen first
                    _native.sem_wait(mm, SEM, 0.0)
                    unposted += 1
        while unposted and rng.random() < 0.5:
            _native.sem_post(mm, SEM)
            unposted -= 1
        for slot in list(held):
            if rng.random() < 0.5:
                del held[slot]
        if rng.random() < 0.03:
            table.new_epoch()
            seq = next_seq
        tokens = banked
        while _native.sem_wait(mm, SEM, 0.0):
            tokens += 1
        for _ in range(tokens - banked):
            _native.sem_post(mm, SEM)
        want_table = copy.deepcopy(table)
        want_bases = {s: s in held for s in bases}
        want, want_tokens = model(want_table, want_bases, mm, tokens, seq)

        got, banked, gone = _native.steady_take(mm, SEM, HEADERS, banked, table.tasks, table.state, table.ready,
                                                table.load, table.free, bases, table.epoch, seq, _STEADY)
        table.outstanding -= gone
        assert (got, banked) == (want, want_tokens)
        assert (table.state, table.free, table.tasks, table.ready, table.load, table.outstanding) == (
            want_table.state, want_table.free, want_table.tasks, want_table.ready, want_table.load,
            want_table.outstanding)
        assert sorted(bases) == sorted(s for s in want_bases)
        table.check()
        if got >= 0:
            seq += 1
            base = object()
            bases[got], held[got] = base, base
            del base
        elif got == _GENERAL:
            # What the general path makes of what stopped the call: a stale result is dropped
            # (its token taken), a twisted one is read as the plain batch it stands for here.
            for slot in [s for s in list(table.tasks) if table.state[s] is IN_FLIGHT
                         and header(mm, s, Field.STATE) == DONE]:
                if table.tasks[slot].epoch != table.epoch:
                    table.done(slot)
                    if banked:
                        banked -= 1
                    elif not _native.sem_wait(mm, SEM, 0.0):
                        unposted -= 1
                else:
                    plain(mm, table, slot)
            if seq in table.ready:
                plain(mm, table, table.ready[seq])


def test_steady_take_refuses_what_is_not_a_slot_table() -> None:
    mm = mmap.mmap(-1, 64 + SLOTS * N_FIELDS * 8)
    _native.sem_init(mm, SEM)
    table = SlotTable(SLOTS, WORKERS)

    def call(**kw: Any) -> Any:
        args = dict(buffer=mm, sem=SEM, headers=HEADERS, banked=0, tasks=table.tasks, state=table.state,
                    ready=table.ready, load=table.load, free=table.free, bases={}, epoch=0, seq=0, consts=_STEADY)
        args.update(kw)
        return _native.steady_take(*args.values())

    assert call() == (-1, 0, 0)
    with pytest.raises(TypeError, match="wrong container types"):
        call(tasks=[])
    with pytest.raises(TypeError, match="wrong container types"):
        call(consts=_STEADY[:-1])
    with pytest.raises(ValueError, match="one header offset per slot"):
        call(headers=HEADERS[:-1])
    with pytest.raises(ValueError, match="does not fit the buffer"):
        call(headers=(*HEADERS[:-1], len(mm) - 8))
    with pytest.raises(ValueError, match="does not fit the buffer"):
        call(headers=(*HEADERS[:-1], HEADERS[-1] + 4))
    with pytest.raises(ValueError, match="semaphore lies outside"):
        call(sem=len(mm))
    with pytest.raises(ValueError, match="field index outside the header"):
        call(consts=(*_STEADY[:-2], N_FIELDS, N_FIELDS))  # R_SEQ past the header
    with pytest.raises(TypeError):
        _native.steady_take(mm)
    assert table.state == [FREE] * SLOTS and table.free == list(range(SLOTS - 1, -1, -1))
