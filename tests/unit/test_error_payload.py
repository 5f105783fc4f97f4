"""A worker's error never leaves its slot: payloads of cap - 1, cap, cap + 1 and 10 x cap bytes
(ASCII and 4-byte characters) are written inside the slot, the neighbouring slots' headers
and data are untouched, and the error keeps its type, its first line and its message's end."""

from __future__ import annotations

import mmap
import pickle

import pytest
from torch._utils import ExceptionWrapper

from shmloader._errors import fit_error
from shmloader.wire.layout import RingGeometry
from shmloader.wire.ring import _Views
from shmloader.worker.loop import _write_error


def wrapper(message: str, exc: type[Exception] = ValueError) -> ExceptionWrapper:
    try:
        raise exc(message)
    except Exception:
        return ExceptionWrapper(where="in DataLoader worker process 0")  # type: ignore[no-untyped-call]


def sized(nbytes: int, char: str) -> ExceptionWrapper:
    """An error whose pickle is exactly ``nbytes`` long: ``char`` repeated in its message, then
    ASCII padding to land on the byte."""
    base = len(pickle.dumps(wrapper("")))
    n = (nbytes - base) // len(char.encode()) - 8
    for k in range(max(0, n - 8), n + 8):
        for pad in range(0, 40):
            w = wrapper(char * k + "p" * pad)
            if len(pickle.dumps(w)) == nbytes:
                return w
    raise AssertionError(f"no message pickles to exactly {nbytes} bytes")


class Ring(_Views):
    ready = task = None


@pytest.mark.parametrize("char", ["x", "\U0001F600"])
@pytest.mark.parametrize("delta", [-1, 0, 1, 9 * 8192])
def test_error_payload_stays_inside_its_slot(delta: int, char: str) -> None:
    g = RingGeometry(num_workers=1, num_slots=3, data_bytes=8192)
    ring = Ring(g, mmap.mmap(-1, g.total_bytes))
    for s in (0, 2):  # neighbours: known headers and data
        for f in range(len(ring.headers[s])):
            ring.headers[s][f] = f + 1000 * s
        ring.bytes[g.data_offset(s) : g.data_offset(s) + g.data_bytes] = s + 7
    before = bytes(ring.mm)
    cap = g.data_bytes
    error = sized(cap + delta, char)
    message = str(error.exc_msg)
    length = _write_error(ring, 1, error)  # type: ignore[arg-type]
    after = bytes(ring.mm)
    start, end = g.data_offset(1), g.data_offset(1) + cap
    assert after[: g.slot_offset(1)] == before[: g.slot_offset(1)]  # slot 0 and the control area
    assert after[end:] == before[end:]  # slot 2
    assert 0 < length <= cap  # from the data region's start (the published PICKLED_OFF is 0)
    got = pickle.loads(after[start : start + length])
    assert got.exc_type is ValueError
    if delta <= 0:
        assert got.exc_msg == message  # it fitted: nothing cut
    else:
        assert "characters of the traceback cut so that the error fits its ring slot" in got.exc_msg
        assert got.exc_msg.startswith(message[:20]) and got.exc_msg.endswith(message[-20:])


def test_an_unpicklable_exception_class_travels_as_runtime_error_naming_it() -> None:
    class Local(Exception):
        pass

    got = pickle.loads(fit_error(wrapper("disk on fire", Local), 4096))
    assert got.exc_type is RuntimeError and got.exc_msg.rstrip().endswith("Local: disk on fire")
    assert "Local, which cannot be pickled) in DataLoader worker process 0" in got.where
