"""The C++ extension ``_tensors``. ``stack_into``: torch.stack(samples, 0, out=out) as one
memcpy per plain sample; ``from_array``: torch.from_numpy for the array a lent batch is made of.

``stack_into`` must stack exactly what torch.stack stacks, bit for bit, and refuse (False,
nothing written) every sample whose copy is not a plain memcpy, so that torch.stack then does
it or raises its own error. ``from_array`` must make what torch.from_numpy makes, and keep the
array alive exactly as long as the tensor's memory. ``make`` builds it (torch is installed before the package): the default
test run checks it is there, so the fast path is the one under test.
"""

from __future__ import annotations

import gc
import mmap
import os
import sys
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from shmloader import _accel, _tensors

from shmloader.worker import collate as _collate

from shmloader.main import lease as _lease
from shmloader.worker.collate import SlotWriter, slot_collate_map
from shmloader.wire.layout import CODE_OF_DTYPE, Kind
from tests.unit.test_device import mapped
from tests.conftest import same

stack_into = _tensors.stack_into
SENTINEL = 0x5A  # out's bytes before a refused call: a refusal writes none


def fresh_out(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype)
    out.view(torch.uint8).fill_(SENTINEL) if out.numel() else None
    return out


def untouched(out: torch.Tensor) -> bool:
    return bool((out.contiguous().view(torch.uint8) == SENTINEL).all()) if out.numel() else True


def samples_of(dtype: torch.dtype, n: int = 5, shape: tuple[int, ...] = (3, 4)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    raw = torch.randint(0, 256, (n, 16 * max(1, torch.Size(shape).numel())), dtype=torch.uint8, generator=g)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return [raw[i, : itemsize * torch.Size(shape).numel()].view(dtype).view(shape) for i in range(n)]


@pytest.mark.skipif(bool(os.environ.get("SHMLOADER_NO_TENSORS")), reason="SHMLOADER_NO_TENSORS: asked to run without it")
def test_the_extension_is_built_for_this_torch() -> None:
    assert _tensors.TORCH_VERSION == torch.__version__
    assert _collate._stack_into is stack_into
    assert _lease._from_array is _tensors.from_array


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", list(CODE_OF_DTYPE), ids=str)
def test_every_dtype_is_stacked_as_torch_stacks_it(dtype: torch.dtype) -> None:
    samples = samples_of(dtype)
    want = torch.empty((5, 3, 4), dtype=dtype)
    torch.stack(samples, 0, out=want)
    out = fresh_out((5, 3, 4), dtype)
    assert stack_into(samples, out) is True
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("shape", [(), (0,), (1,), (2, 0, 3), (7, 1, 1)], ids=str)
def test_odd_sample_shapes(shape: tuple[int, ...]) -> None:
    samples = [torch.full(shape, float(i)) for i in range(4)]
    out = torch.empty((4, *shape))
    assert stack_into(samples, out) is True
    same(out, torch.stack(samples))
    assert stack_into(tuple(samples), out) is True  # torch's collate hands tuples of a sequence's fields


def test_a_write_is_counted_in_the_version_as_stack_counts_it() -> None:
    samples, out = samples_of(torch.float32), torch.empty((5, 3, 4))
    before = out._version
    assert stack_into(samples, out)
    assert out._version == before + 1


class Sub(torch.Tensor):
    pass


def refusals() -> list[tuple[str, Any, torch.Tensor]]:
    base = samples_of(torch.float32)
    out = fresh_out((5, 3, 4), torch.float32)
    wide = [torch.zeros(4, 3) for _ in range(5)]
    complex_ = [torch.zeros(3, 4, dtype=torch.complex64) for _ in range(5)]
    cases = [
        ("a subclass", base[:4] + [base[4].as_subclass(Sub)], out),
        ("not contiguous", base[:4] + [wide[0].t()], out),
        ("another dtype", base[:4] + [base[4].double()], out),
        ("another shape", base[:4] + [torch.zeros(3, 5)], out),
        ("another count", base[:4], out),
        ("more dims", base[:4] + [torch.zeros(1, 3, 4)], out),
        ("requires grad", base[:4] + [torch.zeros(3, 4, requires_grad=True)], out),
        ("a conjugate view", complex_[:4] + [complex_[4].conj()], fresh_out((5, 3, 4), torch.complex64)),
        ("a negative view", base[:4] + [torch._neg_view(base[4])], out),
        ("sparse", base[:4] + [torch.zeros(3, 4).to_sparse()], out),
        ("not a tensor", base[:4] + [3.0], out),
        ("a generator", (t for t in base), out),
        ("empty", [], fresh_out((0, 3, 4), torch.float32)),
        ("out not contiguous", base, fresh_out((4, 3, 5), torch.float32).transpose(0, 2)),
        ("out needs grad", base, fresh_out((5, 3, 4), torch.float32).requires_grad_()),
    ]
    inside = fresh_out((5, 3, 4), torch.float32)
    cases.append(("a sample inside out", [inside[i] for i in range(5)], inside))
    return cases


@pytest.mark.parametrize("name, samples, out", refusals(), ids=[c[0] for c in refusals()])
def test_refused_samples_leave_out_untouched(name: str, samples: Any, out: torch.Tensor) -> None:
    assert stack_into(samples, out) is False
    if name != "a sample inside out":
        assert untouched(out.detach())


def test_a_torch_function_mode_sees_torch_stack() -> None:
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    samples, out = samples_of(torch.float32), fresh_out((5, 3, 4), torch.float32)
    with Count():
        assert stack_into(samples, out) is False
    assert untouched(out)


def test_a_non_tensor_out_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="stack_into takes"):
        stack_into([torch.zeros(2)], [torch.zeros(2)])  # type: ignore[arg-type]


@pytest.mark.parametrize("fast", [True, False], ids=["stack_into", "torch.stack"])
@pytest.mark.parametrize(
    "samples",
    [
        [torch.arange(12.0).view(3, 4) + i for i in range(6)],
        [{"x": torch.arange(4) * i, "y": (torch.ones(2, dtype=torch.bool), torch.tensor(i))} for i in range(6)],
        [torch.arange(8.0).view(2, 4).t() + i for i in range(6)],  # not contiguous: torch.stack
        [torch.tensor([i], dtype=torch.int64 if i % 2 else torch.float64) for i in range(6)],  # promoted
    ],
    ids=["tensors", "dict of tuples", "transposed", "mixed dtypes"],
)
def test_collate_into_a_slot_equals_default_collate_with_and_without_it(
        samples: list[Any], fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    stacked: list[bool] = []  # what stack_into answered, batch after batch
    if fast:
        monkeypatch.setattr(_collate, "_stack_into", lambda s, out: stacked.append(stack_into(s, out)) or stacked[-1])
    else:
        monkeypatch.setattr(_collate, "_stack_into", None)
    mm = mmap.mmap(-1, 1 << 16)
    writer = SlotWriter(mm)
    fn_map = slot_collate_map(writer)
    for _ in range(3):  # the first batch the general way, the next ones stack_lone's
        writer.begin(4096, 1 << 15)
        batch = writer.stack_lone(samples) if isinstance(samples[0], torch.Tensor) else None
        if batch is None:
            batch = torch.utils.data._utils.collate.collate(samples, collate_fn_map=fn_map)
            writer.finish(batch)
        same(batch, default_collate(samples))
    if fast:  # plain samples went through stack_into; the transposed and mixed ones through torch.stack
        plain = isinstance(samples[0], dict) or samples[0].is_contiguous() and samples[0].dtype == samples[1].dtype
        assert any(stacked) == plain and stacked, stacked


def test_a_build_for_another_torch_or_the_environment_variable_leaves_it_unused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_tensors, "TORCH_VERSION", "0.0.0")
    with pytest.warns(RuntimeWarning, match=r"built for torch 0\.0\.0, and torch .* runs: reinstall shmloader"):
        assert _accel.load() is None
    monkeypatch.undo()
    assert _accel.load() is _tensors
    monkeypatch.setenv("SHMLOADER_NO_TENSORS", "1")
    assert _accel.load() is None


def test_its_functions_have_text_signatures() -> None:
    import inspect

    assert str(inspect.signature(stack_into)) == "(samples, out, /)"
    assert str(inspect.signature(_tensors.from_array)) == "(array, /)"
    assert str(inspect.signature(_tensors.copy_out)) == "(tensor, /)"


NP_DTYPES = [np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64,
             np.complex64, np.complex128, np.uint16, np.uint32, np.uint64]


@pytest.mark.parametrize("dtype", NP_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3, 4)], ids=str)
def test_from_array_makes_what_from_numpy_makes(dtype: Any, shape: tuple[int, ...]) -> None:
    array = (np.arange(int(np.prod(shape))) % 7).astype(dtype).reshape(shape)
    want, got = torch.from_numpy(array), _tensors.from_array(array)
    assert (got.dtype, got.shape) == (want.dtype, want.shape)
    assert torch.equal(got, want) and not got.requires_grad
    if array.size:  # (an empty tensor's strides mean nothing; lend_lone leaves empty batches to read_batch)
        assert got.stride() == want.stride()
        assert got.data_ptr() == array.ctypes.data  # shared, not copied
        got.view(-1)[0] = 1
        assert array.reshape(-1)[0] == 1


def test_from_array_keeps_its_exporter_from_resizing_what_the_tensor_views() -> None:
    data = bytearray(16)
    tensor = _tensors.from_array(data)
    with pytest.raises(BufferError):
        data.extend(b"more")  # exported: a resize would leave the tensor viewing freed memory
    tensor[0] = 7
    assert data[0] == 7
    del tensor
    data.extend(b"more")  # released with the tensor's memory


def test_from_array_keeps_the_array_as_long_as_its_memory_lives() -> None:
    array = np.arange(12, dtype=np.float32)
    before = sys.getrefcount(array)
    tensor = _tensors.from_array(array)
    row = tensor[4:]
    del tensor
    gc.collect()
    assert sys.getrefcount(array) == before + 1  # the view keeps the storage, which keeps the array
    del row
    gc.collect()
    assert sys.getrefcount(array) == before


@pytest.mark.parametrize(
    "array, error",
    [
        (np.arange(12, dtype=np.float32).reshape(3, 4).T, "contiguous"),
        (np.frombuffer(b"abcd", dtype=np.uint8), "writable|read-only"),
        (np.zeros(3, dtype="datetime64[s]"), "format|dtype|buffer"),
        (np.zeros(2, dtype=">f4"), "dtype torch has no tensor of"),
    ],
    ids=["transposed", "read-only", "datetime", "big-endian"],
)
def test_from_array_refuses_what_it_cannot_share(array: Any, error: str) -> None:
    with pytest.raises((TypeError, BufferError, ValueError), match=error):
        _tensors.from_array(array)


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8, torch.bool, torch.complex64, torch.bfloat16], ids=str)
def test_copy_out_is_a_clone_in_pages_of_its_own(dtype: torch.dtype) -> None:
    src = torch.arange(3 * 70_000).reshape(3, 70_000).to(dtype)
    out = _tensors.copy_out(src)
    assert out is not None
    assert (out.dtype, out.shape, out.stride()) == (src.dtype, src.shape, src.stride())
    assert torch.equal(out, src) and out.data_ptr() != src.data_ptr() and out.data_ptr() % 4096 == 0
    src.zero_()  # independent of its source
    assert torch.equal(out, torch.arange(3 * 70_000).reshape(3, 70_000).to(dtype))


def test_copy_out_gives_its_pages_back_with_its_last_view() -> None:
    out = _tensors.copy_out(torch.ones(1 << 20, dtype=torch.uint8))
    assert out is not None
    row = out[10:]
    ptr = out.data_ptr()
    del out  # (no cycle: freed here, not by the collector)
    assert mapped(ptr) and int(row.sum()) == (1 << 20) - 10
    del row
    assert not mapped(ptr)  # unmapped with the last view, before anything else could map there


@pytest.mark.parametrize(
    "tensor",
    [torch.zeros(4, 5).t(), torch.zeros(0), torch.zeros(3, dtype=torch.complex64).conj(), torch.zeros(3).to_sparse(),
     torch.zeros(3, requires_grad=True), torch.zeros(3).as_subclass(Sub)],
    ids=["transposed", "empty", "conjugate", "sparse", "requires grad", "subclass"],
)
def test_copy_out_leaves_other_tensors_to_clone(tensor: torch.Tensor) -> None:
    assert _tensors.copy_out(tensor) is None


def test_copy_leaf_copies_large_tensors_out_and_small_ones_by_clone() -> None:
    big, small = torch.arange(1 << 15, dtype=torch.float32), torch.arange(16)
    for leaf in (big, small):
        out = _lease.copy_leaf(leaf, int(Kind.TENSOR))
        assert torch.equal(out, leaf) and out.data_ptr() != leaf.data_ptr()
    assert _lease.copy_leaf(big, int(Kind.TENSOR)).data_ptr() % 4096 == 0  # its own pages


def copies_mapped() -> int:
    """Mappings of held batches' copies (``copy_out``'s memory files) in this process."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if line.rstrip().endswith("/memfd:shmloader-copy (deleted)")
                   or line.rstrip().endswith("/memfd:shmloader-copy"))


def test_copy_out_is_a_memory_file_of_its_own_unmapped_with_the_tensor() -> None:
    src = torch.arange(70_000, dtype=torch.float32)
    before = copies_mapped()
    out = _tensors.copy_out(src)
    assert out is not None and torch.equal(out, src) and out.data_ptr() != src.data_ptr()
    assert copies_mapped() == before + 1
    del out
    assert copies_mapped() == before


def test_a_failed_from_blob_gives_back_the_buffer_and_the_mapping() -> None:
    mm = mmap.mmap(-1, 4096)
    array = np.frombuffer(mm, dtype=np.float32)
    before = copies_mapped()
    _tensors._fail_from_blob(2)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            _tensors.from_array(array)
        with pytest.raises(RuntimeError, match="injected"):
            _tensors.copy_out(torch.ones(70_000))
    finally:
        _tensors._fail_from_blob(0)
    assert copies_mapped() == before  # copy_out's memory file unmapped
    del array
    mm.close()  # BufferError if from_array had left its buffer exported

