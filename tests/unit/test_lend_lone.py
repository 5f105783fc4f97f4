"""``_native.lend_lone`` builds what ``read_batch`` builds for a batch that is one tensor in its
slot, and lends it as ``Leases.lend`` would; for anything else it answers None and changes
nothing, so that ``read_batch`` builds that batch or says what is wrong with it. The tensor it
lends over the slot's array is ``torch.from_numpy``'s."""

from __future__ import annotations

import gc
import mmap
import sys
from typing import Any

import numpy as np
import pytest
import torch

from shmloader import CorruptSlotError, _native
from shmloader.main.lease import lone_args, read_batch
from shmloader.wire.layout import Field, Region, RingGeometry
from shmloader.wire.ring import _Views
from shmloader.worker.collate import SlotWriter

GEOMETRY = RingGeometry(num_workers=1, num_slots=3, data_bytes=1 << 19)
MOST_LENT = 2  # Delivery.most_lent() of this ring: one slot left to its one worker


def written(batch: Any, slot: int = 1) -> _Views:
    views = _Views(GEOMETRY, mmap.mmap(-1, GEOMETRY.total_bytes))
    writer = SlotWriter(views.mm)
    writer.begin(views.data_offsets[slot], GEOMETRY.data_bytes)
    writer.finish(batch)
    hdr = views.headers[slot]
    hdr[Field.TABLE_OFF], hdr[Field.TABLE_LEN] = writer.table_off, writer.table_len
    hdr[Field.PICKLED_OFF], hdr[Field.PICKLED_LEN] = writer.pickled_off, writer.pickled_len
    hdr[Field.REGION] = int(Region.SLOT)
    return views


def lend(views: _Views, bases: dict[int, Any], slot: int = 1) -> tuple[Any, int] | None:
    return _native.lend_lone(slot, bases, lone_args(views, MOST_LENT))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(32 * 16, dtype=torch.float32).reshape(32, 16) / 7,
        torch.arange(64 * 512, dtype=torch.int64).reshape(64, 512) - 5000,
        torch.arange(2 * 3 * 4 * 5, dtype=torch.uint8).reshape(2, 3, 4, 5),
        torch.tensor([True, False, True]),
        torch.tensor(-3, dtype=torch.int16),  # 0-d
        torch.arange(6, dtype=torch.float64).reshape(2, 3).t().contiguous(),
        torch.arange(8, dtype=torch.float32).to(torch.complex64) * 1j,
    ],
    ids=["f32", "i64", "u8-4d", "bool", "0d", "f64", "c64"],
)
def test_builds_what_read_batch_builds_over_the_same_bytes(tensor: torch.Tensor) -> None:
    views = written(tensor)
    bases: dict[int, Any] = {}
    built = lend(views, bases)
    assert built is not None
    batch, nbytes = built
    want, _, want_nbytes = read_batch(views, 1)  # type: ignore[arg-type]
    assert type(batch) is torch.Tensor and batch.dtype == tensor.dtype and batch.shape == tensor.shape
    assert torch.equal(batch, tensor) and torch.equal(batch, want)
    assert nbytes == want_nbytes == tensor.nbytes
    assert batch.data_ptr() == want.data_ptr()  # a view of the slot, not a copy
    assert list(bases) == [1] and type(bases[1]) is np.ndarray
    assert not batch.requires_grad and batch.is_contiguous()


def test_the_slot_comes_back_when_the_last_view_is_gone() -> None:
    views = written(torch.arange(100, dtype=torch.int32).reshape(10, 10))
    bases: dict[int, Any] = {}
    built = lend(views, bases)
    assert built is not None
    batch = built[0]
    del built
    row = batch[3]
    del batch
    gc.collect()
    assert _native.unviewed(bases, False) == []  # a row of it still views the slot
    assert torch.equal(row, torch.arange(30, 40, dtype=torch.int32))
    del row
    assert _native.unviewed(bases, True) == [1] and bases == {}


def test_writes_to_the_batch_land_in_the_slot() -> None:
    views = written(torch.zeros(4, dtype=torch.int64))
    built = lend(views, {})
    assert built is not None
    built[0][2] = 7
    again, _, _ = read_batch(views, 1)  # type: ignore[arg-type]
    assert again.tolist() == [0, 0, 7, 0]


@pytest.mark.parametrize(
    "batch",
    [
        {"x": torch.arange(4)},
        (torch.arange(4), torch.arange(4)),
        [torch.arange(4)],
        np.arange(4),  # a numpy batch: read_batch's own path
        torch.arange(4, dtype=torch.bfloat16),  # no numpy dtype
        torch.zeros(0, 3),  # no bytes
    ],
    ids=["dict", "tuple", "list", "numpy", "bf16", "empty"],
)
def test_anything_but_one_tensor_is_left_to_read_batch(batch: Any) -> None:
    views = written(batch)
    bases: dict[int, Any] = {}
    assert lend(views, bases) is None
    assert bases == {}
    read_batch(views, 1)  # type: ignore[arg-type]  # which builds it


@pytest.mark.parametrize(
    "field, value, message",
    [
        (Field.REGION, int(Region.OVERFLOW), "header says region 1, expected SLOT"),
        (Field.TABLE_OFF, 1 << 19, "leaf table .* lies outside"),
        (Field.TABLE_LEN, -8, "leaf table .* lies outside"),
        (Field.PICKLED_OFF, -8, "skeleton .* lies outside"),
        (Field.TABLE_LEN, 4, "shorter than its head"),
    ],
)
def test_a_header_that_does_not_check_is_left_for_read_batch_to_report(field: int, value: int, message: str) -> None:
    views = written(torch.arange(16))
    views.headers[1][field] = value
    bases: dict[int, Any] = {}
    assert lend(views, bases) is None and bases == {}
    with pytest.raises(CorruptSlotError, match=message):
        read_batch(views, 1)  # type: ignore[arg-type]


def test_a_torn_table_is_left_for_read_batch_to_report() -> None:
    views = written(torch.arange(16))
    views.bytes[views.data_offsets[1] + views.headers[1][Field.TABLE_OFF]] ^= 0xFF  # the table's magic
    bases: dict[int, Any] = {}
    assert lend(views, bases) is None and bases == {}
    with pytest.raises(CorruptSlotError, match="magic"):
        read_batch(views, 1)  # type: ignore[arg-type]


def test_when_the_workers_would_be_left_one_slot_it_lends_nothing() -> None:
    """Never a worker's last slot: with most_lent slots lent the caller decides whether to copy."""
    views = written(torch.arange(16))
    held = {0: np.zeros(1), 2: np.zeros(1)}
    bases = dict(held)
    assert lend(views, bases) is None and bases == held
    del bases[2]
    built = lend(views, bases)
    assert built is not None and set(bases) == {0, 1}


def test_it_refuses_what_is_not_its_arguments() -> None:
    views = written(torch.arange(16))
    args = lone_args(views, MOST_LENT)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        _native.lend_lone(1, [], args)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        _native.lend_lone(1, {}, args[:-1])
    with pytest.raises(TypeError):
        _native.lend_lone(1, {})  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="slot 3"):
        _native.lend_lone(3, {}, args)
    with pytest.raises(ValueError, match="slot -1"):
        _native.lend_lone(-1, {}, args)
    refs = sys.getrefcount(views.mm)
    for _ in range(100):
        assert _native.lend_lone(1, {0: 0, 2: 0}, args) is None
    after = sys.getrefcount(views.mm)
    assert after == refs  # nothing kept
