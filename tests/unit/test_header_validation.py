"""The main process validates every slot header before it builds a tensor."""

from __future__ import annotations

import mmap
import pickle

import pytest
import torch

from shmloader import CorruptSlotError
from shmloader.main.lease import read_batch
from shmloader.wire.layout import Field, RingGeometry
from shmloader.wire.ring import _Views
from shmloader.worker.collate import SlotWriter

GEOMETRY = RingGeometry(num_workers=1, num_slots=1, data_bytes=1 << 16)


def written() -> tuple[_Views, SlotWriter]:
    views = _Views(GEOMETRY, mmap.mmap(-1, GEOMETRY.total_bytes))
    writer = SlotWriter(views.mm)
    writer.begin(views.data_offsets[0], GEOMETRY.data_bytes)
    writer.finish({"x": torch.arange(10), "y": "label"})
    hdr = views.headers[0]
    hdr[Field.TABLE_OFF], hdr[Field.TABLE_LEN] = writer.table_off, writer.table_len
    hdr[Field.PICKLED_OFF], hdr[Field.PICKLED_LEN] = writer.pickled_off, writer.pickled_len
    return views, writer


def test_a_valid_slot_reads() -> None:
    views, _ = written()
    batch, _, nbytes = read_batch(views, 0)  # type: ignore[arg-type]
    assert torch.equal(batch["x"], torch.arange(10)) and batch["y"] == "label" and nbytes == 80


@pytest.mark.parametrize(
    "field, value, message",
    [
        (Field.TABLE_OFF, 1 << 16, "leaf table .* lies outside the slot's 65536-byte data region"),
        (Field.TABLE_OFF, -8, "leaf table .* lies outside"),
        (Field.TABLE_LEN, 1 << 40, "leaf table .* lies outside"),
        (Field.PICKLED_OFF, (1 << 16) - 2, "skeleton .* lies outside"),
        (Field.PICKLED_LEN, -1, "skeleton .* lies outside"),
        (Field.TABLE_LEN, 4, "outside buffer|leaf table"),
        (Field.REGION, 1, "header says region 1, expected SLOT"),  # overflow memory nobody granted
    ],
)
def test_corrupt_header_fields(field: int, value: int, message: str) -> None:
    views, _ = written()
    views.headers[0][field] = value
    with pytest.raises(CorruptSlotError, match=message):
        read_batch(views, 0)  # type: ignore[arg-type]


def test_corrupt_table_and_skeleton() -> None:
    views, writer = written()
    start = views.data_offsets[0] + writer.table_off
    views.bytes[start] ^= 0xFF  # the table's magic
    with pytest.raises(CorruptSlotError, match="magic"):
        read_batch(views, 0)  # type: ignore[arg-type]
    views, writer = written()
    bad = b"\x80\x05K\x07Q."  # persistent id 7 of a 1-leaf table
    start = views.data_offsets[0] + writer.pickled_off
    views.bytes[start : start + len(bad)] = list(bad)
    views.headers[0][Field.PICKLED_LEN] = len(bad)
    with pytest.raises(CorruptSlotError, match="refers to leaf 7 of 1"):
        read_batch(views, 0)  # type: ignore[arg-type]
    assert pickle.loads(b"\x80\x05K\x07.") == 7  # (the bytes above are a valid pickle otherwise)


def test_a_skeleton_that_does_not_unpickle_is_a_corrupt_slot() -> None:
    views, writer = written()
    start = views.data_offsets[0] + writer.pickled_off
    views.headers[0][Field.PICKLED_LEN] = writer.pickled_len - 3  # torn: its end is missing
    with pytest.raises(CorruptSlotError, match=r"slot 0: the batch's skeleton does not unpickle \(.*\): a torn write"):
        read_batch(views, 0)  # type: ignore[arg-type]
    views, writer = written()
    views.bytes[start] = 0x00  # no pickle opcode
    with pytest.raises(CorruptSlotError, match="does not unpickle"):
        read_batch(views, 0)  # type: ignore[arg-type]
