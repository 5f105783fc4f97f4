"""The native types and the codec at their edges: an instance never exists half made, a torn
leaf table is a CorruptSlotError wherever it is read, and an interpreter the extension was not
designed for is refused at import with a reason."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from shmloader import CorruptSlotError, _native
from shmloader.wire.layout import Field
from tests.unit.test_header_validation import written


def test_a_scheduler_without_its_arguments_is_never_made() -> None:
    with pytest.raises(TypeError, match="missing required argument 'num_slots'"):
        _native.Scheduler.__new__(_native.Scheduler)
    made = _native.Scheduler.__new__(_native.Scheduler, 2, 1)  # __new__ makes it whole
    assert made.has_unposted is False and made.take_unposted() == [] and made.n_free == 2
    made.check()


def test_a_scheduler_in_a_reference_cycle_is_collected() -> None:
    class Sampler:
        pass

    table = _native.Scheduler(2, 1)
    sampler = Sampler()
    sampler.table = table  # type: ignore[attr-defined]
    table.dispatch(0, 0, sampler)  # the task's index is the sampler: a cycle through the table
    del table, sampler
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is Sampler]


@pytest.mark.parametrize("where", ["magic", "count", "dtype", "length"])
def test_a_torn_leaf_table_is_a_corrupt_slot_error_from_the_codec_itself(where: str) -> None:
    views, writer = written()
    start = views.data_offsets[0] + writer.table_off
    if where == "length":
        views.headers[0][Field.TABLE_LEN] = 4
    else:
        offset = {"magic": 0, "count": 4, "dtype": 8}[where]
        views.bytes[start + offset] ^= 0xFF
    hdr, data, cap = views.header_offsets[0], views.data_offsets[0], views.geometry.data_bytes
    with pytest.raises(CorruptSlotError):
        _native.read_slot(views.mm, hdr, views.mm, data, cap, views.mm, data, cap, b"")
    with pytest.raises(CorruptSlotError):
        _native.decode_table(views.mm, start, max(0, int(views.headers[0][Field.TABLE_LEN])), cap)


def test_a_free_threaded_interpreter_is_refused_at_import() -> None:
    code = "import sys\nsys._is_gil_enabled = lambda: False  # as a 3.13t build run with PYTHON_GIL=0\nimport shmloader\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1
    assert "ImportError: shmloader does not support a free-threaded Python without its GIL" in done.stderr
