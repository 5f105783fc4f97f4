"""Collate into a slot and read back, in one process: equal to torch's default_collate."""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate, default_convert

from shmloader import _native
from shmloader.main.lease import copy_leaf, read_batch
from shmloader.wire.layout import Field, RingGeometry, grown_slot_bytes, slot_data_bytes
from shmloader.wire.ring import _Views
from shmloader.worker.collate import SlotWriter, slot_collate_map
from tests.conftest import same
from tests.datasets import Custom, Rich

GEOMETRY = RingGeometry(num_workers=1, num_slots=2, data_bytes=1 << 20)


def round_trip(batch_or_samples: Any, fused: bool, copy: bool = False) -> tuple[Any, SlotWriter]:
    mm = mmap.mmap(-1, GEOMETRY.total_bytes)
    views = _Views(GEOMETRY, mm)
    writer = SlotWriter(mm)
    writer.begin(views.data_offsets[1], GEOMETRY.data_bytes)
    if fused:
        batch = torch.utils.data._utils.collate.collate(batch_or_samples, collate_fn_map=slot_collate_map(writer))
    else:
        batch = batch_or_samples
    writer.finish(batch)
    hdr = views.headers[1]
    hdr[Field.TABLE_OFF], hdr[Field.TABLE_LEN] = writer.table_off, writer.table_len
    hdr[Field.PICKLED_OFF], hdr[Field.PICKLED_LEN] = writer.pickled_off, writer.pickled_len
    out, _, _ = read_batch(views, 1, copy_leaf if copy else None)  # type: ignore[arg-type]
    return out, writer


def test_fused_collate_equals_default_collate() -> None:
    samples = [Rich()[i] for i in range(7)]
    out, writer = round_trip(samples, fused=True)
    same(out, default_collate(samples))
    assert writer.fits


def test_fused_collate_writes_tensors_into_the_slot_without_a_batch_copy() -> None:
    samples = [torch.full((4,), float(i)) for i in range(8)]
    out, writer = round_trip(samples, fused=True)
    assert len(writer.leaves) == 1
    same(out, default_collate(samples))


@pytest.mark.parametrize("copy", [False, True])
def test_custom_batches_round_trip(copy: bool) -> None:
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)

    batch = {
        "noncontig": base.t(),
        "strided": base[:, ::2],
        "zero_dim": torch.tensor(3.5),
        "empty": torch.empty(0, 5),
        "np": np.arange(6, dtype=np.uint16).reshape(2, 3),
        "np_str": np.array(["a", "bc"]),
        "obj": Custom(torch.ones(2)),
        "none": None,
        "shared": [base, base],
    }
    out, _ = round_trip(batch, fused=False, copy=copy)
    # Views of one tensor stay views of one storage, with their own strides (torch's batches too)
    assert out["noncontig"].stride() == (1, 6) and out["strided"].stride() == (6, 2)
    storage = out["shared"][0].untyped_storage().data_ptr()
    assert out["noncontig"].untyped_storage().data_ptr() == out["strided"].untyped_storage().data_ptr() == storage
    for key in ("noncontig", "strided", "zero_dim", "empty"):
        same(out[key], batch[key].contiguous())
    same(out["np"], batch["np"])
    assert out["np_str"].tolist() == ["a", "bc"]
    assert out["obj"] == batch["obj"] and out["none"] is None
    assert out["shared"][0] is out["shared"][1]


@pytest.mark.parametrize(
    "dtype",
    [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
     torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128],
)
def test_every_dtype_is_bit_exact(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (5, 3 * 16), dtype=torch.uint8, generator=g)
    samples = [raw[i].view(dtype) if dtype is not torch.bool else raw[i] % 2 == 0 for i in range(5)]
    out, _ = round_trip(samples, fused=True)
    same(out, default_collate(samples))


def foreign_batches() -> list[tuple[str, Any]]:
    base = torch.arange(24, dtype=torch.float16).view(4, 6)
    z = torch.complex(torch.arange(6.0), -torch.arange(6.0)).view(2, 3)
    return [("a tensor", base), ("a row of it", base[1]), ("its transpose", base.t()), ("empty", base[:, :0]),
            ("a negative view", torch._neg_view(base)), ("a conjugate view", z.conj()),
            ("two views of one storage", (base[0], base[1:3], base)),
            ("a 0-dim tensor", torch.tensor(1.5, dtype=torch.float16))]


@pytest.mark.parametrize("name, batch", foreign_batches(), ids=[n for n, _ in foreign_batches()])
def test_a_dtype_newer_than_shmloader_crosses_as_its_bytes_viewed_by_name(
        name: str, batch: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from shmloader.worker import collate

    # float16 and complex64 made unknown to the writer, as bcomplex32 is under torch 2.14
    known = {dt: code for dt, code in collate.CODE_OF_DTYPE.items() if dt not in (torch.float16, torch.complex64)}
    monkeypatch.setattr(collate, "CODE_OF_DTYPE", known)
    out, writer = round_trip(batch, fused=False)
    sent = batch if isinstance(batch, tuple) else (batch,)
    got = out if isinstance(out, tuple) else (out,)
    same(got, tuple(t.resolve_conj().resolve_neg() for t in sent))  # (a bit resolved, as torch's pickle does)
    for g, t in zip(got, sent):
        assert (g.shape, g.dtype, g.is_conj(), g.is_neg()) == (t.shape, t.dtype, False, False)
        assert g.stride() == t.stride() or t.is_conj() or t.is_neg()
    if name == "two views of one storage":  # (as torch's batches do: one storage, shared)
        assert out[0].untyped_storage().data_ptr() == out[2].untyped_storage().data_ptr()


def test_mixed_dtypes_promote_like_default_collate() -> None:
    samples = [torch.tensor([1], dtype=torch.int64), torch.tensor([1.5], dtype=torch.float64)]
    out, _ = round_trip(samples, fused=True)
    same(out, default_collate(samples))


class _HalfTensor(torch.Tensor):
    """A tensor subclass that says another dtype (a property shadows the getter)."""

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        return torch.float16


class _Intercepting:
    def __getattribute__(self, name: str) -> Any:
        return torch.float32 if name == "dtype" else object.__getattribute__(self, name)


def test_same_dtype_check_answers_as_getattr() -> None:
    """The fused collate's one-dtype check calls a type's dtype getter directly: whatever a
    subclass or an instance says instead is still what it reads."""
    plain = [torch.zeros(2, dtype=torch.float32) for _ in range(3)]
    assert _native.same_attr(plain, "dtype") is torch.float32
    assert _native.same_attr(plain + [torch.zeros(2).as_subclass(_HalfTensor)], "dtype") is None
    assert _native.same_attr([torch.zeros(2).as_subclass(_HalfTensor)] * 2, "dtype") is torch.float16
    assert _native.same_attr(plain + [_Intercepting()], "dtype") is torch.float32
    assert _native.same_attr([1, 1, 1], "real") == 1  # a builtin type's getter
    with pytest.raises(AttributeError):
        _native.same_attr(plain + [object()], "dtype")


def test_unequal_shapes_raise_torchs_error() -> None:
    samples = [torch.zeros(2), torch.zeros(3)]
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        round_trip(samples, fused=True)


def test_default_convert_path() -> None:
    sample = {"a": np.arange(3), "b": 4, "c": "s"}
    out, _ = round_trip(default_convert(sample), fused=False)
    same(out, default_convert(sample))


def test_overflow_measures_what_the_batch_needs() -> None:
    mm = mmap.mmap(-1, GEOMETRY.total_bytes)
    writer = SlotWriter(mm)
    writer.begin(GEOMETRY.data_offset(0), 1000)
    needed = writer.finish({"x": torch.zeros(10_000, dtype=torch.uint8), "y": torch.zeros(10)})
    assert not writer.fits
    assert needed > 10_000 + 80
    probe = SlotWriter(None)
    probe.begin(0, 0)
    assert probe.finish({"x": torch.zeros(10_000, dtype=torch.uint8), "y": torch.zeros(10)}) == needed


def test_slot_sizing_policy() -> None:
    assert slot_data_bytes(0) == mmap.PAGESIZE  # exact fit: a batch larger than its slot overflows
    assert slot_data_bytes(mmap.PAGESIZE) == mmap.PAGESIZE
    assert slot_data_bytes(1_000_000) == -(-1_000_000 // mmap.PAGESIZE) * mmap.PAGESIZE
    assert grown_slot_bytes(1_000_000) >= 1_125_000 and grown_slot_bytes(1_000_000) % mmap.PAGESIZE == 0
    g = RingGeometry(num_workers=3, num_slots=6, data_bytes=8192)
    assert g.data_offset(0) % mmap.PAGESIZE == 0
    assert g.total_bytes == g.control_bytes + 6 * (mmap.PAGESIZE + 8192)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_empty_leaves_round_trip_and_measure(dtype: torch.dtype) -> None:
    samples = [torch.empty(0, 2, dtype=dtype) for _ in range(3)]
    out, _ = round_trip(samples, fused=True)
    same(out, default_collate(samples))
    probe = SlotWriter(None)
    probe.begin(0, 0)
    batch = torch.utils.data._utils.collate.collate(samples, collate_fn_map=slot_collate_map(probe))
    assert batch.shape == (3, 0, 2) and probe.finish(batch) > 0


def true_bytes(n: int, kind: str) -> Any:
    """n booleans stored as 0xFF, as numpy stores a PIL mode "1" mask's True."""
    raw = np.full(n, 0xFF, dtype=np.uint8)
    return raw.view(np.bool_) if kind == "numpy" else torch.from_numpy(raw).view(torch.bool)


def bytes_of(x: Any) -> bytes:
    return bytes(torch.as_tensor(x).contiguous().view(torch.uint8).reshape(-1).numpy())


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("path", ["stacked", "stacked by torch.stack", "written as is", "a numpy batch",
                                  "held: copied out"])
def test_bool_bytes_reach_the_batch_as_the_dataset_made_them(kind: str, path: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from shmloader.worker import collate

    if path == "stacked by torch.stack":
        monkeypatch.setattr(collate, "_stack_into", None)
    samples = [true_bytes(8, kind) for _ in range(4)]
    if path.startswith("stacked"):  # default_collate: torch.as_tensor, then a stack
        want, (got, _) = default_collate(samples), round_trip(samples, fused=True)
    elif path == "written as is":  # a batch the collate made: its leaves copied into the slot
        batch = torch.as_tensor(samples[0]) if kind == "torch" else samples[0]
        want, (got, _) = batch, round_trip(batch, fused=False)
    elif path == "a numpy batch":
        want, (got, _) = np.stack(samples), round_trip(np.stack(samples), fused=False)
    else:  # a batch the loop holds while the ring is full: copied out of its slot
        want, (got, _) = default_collate(samples), round_trip(samples, fused=True, copy=True)
    assert bytes_of(got) == bytes_of(want) == b"\xff" * len(bytes_of(want))
