"""``_native.stack_into``: torch.stack(samples, 0, out=out) as one memcpy per plain sample,
reading torch's tensors without torch's C++ API (``_accel.learn`` teaches it this torch's
layout, checked against torch's own answers); and ``lease.copy_out``: a held batch's copy in a
memory file of its own.

``stack_into`` must stack exactly the bytes torch.stack stacks and refuse (False, nothing
written) every sample whose copy is not a plain memcpy, so that torch.stack then does it or
raises its own error. (It does not bump ``out``'s version counter as stack(out=) does: ``out`` is
a worker's view of its slot, which no autograd graph holds.) The default test run checks that
it learned this torch, so the fast path is the one under test.
"""

from __future__ import annotations

import gc
import mmap
import os
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from shmloader import _accel, _native
from shmloader.main import lease as _lease
from shmloader.wire.layout import CODE_OF_DTYPE, Kind
from shmloader.worker import collate as _collate
from shmloader.worker.collate import SlotWriter, slot_collate_map
from tests.conftest import same
from tests.unit.test_device import mapped

stack_into = _native.stack_into
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


@pytest.fixture
def relearn() -> Any:
    """Teach stack_into this torch again after a test that unlearned it."""
    yield
    assert _accel.learn() == (stack_into, None)


@pytest.mark.skipif(bool(os.environ.get(_accel.OFF_VARIABLE)), reason="SHMLOADER_NO_FAST_PATH: asked to run without it")
def test_stack_into_knows_this_torch() -> None:
    assert (_accel.STACK_INTO, _accel.WHY_OFF) == (stack_into, None)
    assert _collate._stack_into is stack_into


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


def accepted() -> list[tuple[str, list[torch.Tensor]]]:
    rows = torch.arange(60.0).view(5, 3, 4)
    with torch.inference_mode():
        inferred = [torch.full((3, 4), float(i)) for i in range(5)]
    once_graded = [torch.zeros(3, 4).requires_grad_().requires_grad_(False) for _ in range(5)]
    with torch.no_grad():
        detached = [(torch.ones(3, 4, requires_grad=True) * i) for i in range(5)]
    return [("views of one tensor", [rows[i] for i in range(5)]), ("made in inference mode", inferred),
            ("needed grad once", once_graded), ("made under no_grad from tensors that need it", detached),
            ("from numpy", [torch.from_numpy(np.full((3, 4), i, dtype=np.float32)) for i in range(5)])]


@pytest.mark.parametrize("name, samples", accepted(), ids=[c[0] for c in accepted()])
def test_plain_samples_however_made_are_stacked(name: str, samples: list[torch.Tensor]) -> None:
    out = fresh_out((5, 3, 4), torch.float32)
    assert stack_into(samples, out) is True
    assert torch.equal(out, torch.stack(samples))


def test_a_batch_of_a_mebibyte_or_more_is_stacked_as_torch_stacks_it_and_its_storages_let_go() -> None:
    import sys

    samples = [torch.full((256, 256), float(i)) for i in range(5)]  # 1.25 MiB: copied without the GIL
    out = torch.empty(5, 256, 256)
    storages = [s.untyped_storage() for s in (*samples, out)]  # (the objects stack_into keeps for the copy)
    counts = [sys.getrefcount(s) for s in (*samples, *storages)]
    assert stack_into(samples, out) is True
    assert torch.equal(out, torch.stack(samples))
    assert [sys.getrefcount(s) for s in (*samples, *storages)] == counts  # (kept for the copy, then let go)


def test_python_code_run_while_a_large_batch_s_storages_are_taken_cannot_make_it_write_amiss() -> None:
    samples = [torch.full((256, 256), float(i)) for i in range(5)]
    out = torch.zeros(5, 256, 256)
    original = samples[0]

    class Shrinking(list):  # (a list subclass is refused outright; a gc callback is what could run)
        pass


    def meddle(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and samples:
            samples.clear()
            out.resize_(1)

    gc.callbacks.append(meddle)
    try:
        threshold = gc.get_threshold()
        gc.set_threshold(1)  # (a collection at stack_into's first allocation)
        result = stack_into(samples, out)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(meddle)
    assert result is False and samples == [] and out.shape == (1,)  # out changed under it: refused
    assert original.shape == (256, 256)


@pytest.mark.skipif(not hasattr(torch, "_lazy_clone"), reason="no copy-on-write tensors in this torch")
def test_a_copy_on_write_sample_is_read_and_stays_shared_as_torch_stack_leaves_it() -> None:
    samples = [torch._lazy_clone(torch.full((3, 4), float(i))) for i in range(5)]
    out = fresh_out((5, 3, 4), torch.float32)
    assert stack_into(samples, out) is True and torch.equal(out, torch.stack(samples))
    assert all(torch._C._is_cow_tensor(s) for s in samples)  # (read through the shim's const pointer)


def inference_out() -> torch.Tensor:
    with torch.inference_mode():  # (stack(out=) refuses it outside inference mode)
        return fresh_out((5, 3, 4), torch.float32)


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
        ("the imaginary part of a conjugate", [torch.zeros(1, dtype=torch.complex64).conj().imag for _ in range(5)],
         fresh_out((5, 1), torch.float32)),
        ("a zero tensor", base[:4] + [torch._efficientzerotensor(3, 4)], out),
        ("on the meta device", base[:4] + [torch.empty(3, 4, device="meta")], out),
        ("a view of a tensor that needs grad", base[:4] + [torch.zeros(2, 3, 4, requires_grad=True)[1]], out),
        ("a result that needs grad", base[:4] + [torch.zeros(3, 4, requires_grad=True) * 2], out),

        ("sparse", base[:4] + [torch.zeros(3, 4).to_sparse()], out),
        ("not a tensor", base[:4] + [3.0], out),
        ("a generator", (t for t in base), out),
        ("empty", [], fresh_out((0, 3, 4), torch.float32)),
        ("out not contiguous", base, fresh_out((4, 3, 5), torch.float32).transpose(0, 2)),
        ("out needs grad", base, fresh_out((5, 3, 4), torch.float32).requires_grad_()),
        ("out made in inference mode", base, inference_out()),
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


def test_a_torch_dispatch_mode_sees_torch_stack() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    samples, out = samples_of(torch.float32), fresh_out((5, 3, 4), torch.float32)
    with Record():
        assert stack_into(samples, out) is False
    assert untouched(out) and not seen


def test_a_non_tensor_out_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="stack_into takes"):
        stack_into([torch.zeros(2)], [torch.zeros(2)])  # type: ignore[arg-type]


def made(writer: SlotWriter, fn_map: dict[Any, Any], samples: list[Any]) -> tuple[Any, bool]:
    """One batch at the writer's slot as a worker makes it: in one step when ``restack`` can
    (True), else the general way (its columns remembered for the next one)."""
    writer.begin(4096, 1 << 15)
    batch = writer.restack(samples)
    if batch is not None:
        return batch, True
    writer.samples_type = type(samples[0])
    batch = torch.utils.data._utils.collate.collate(samples, collate_fn_map=fn_map)
    writer.finish(batch)
    return batch, False


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
    for _ in range(3):  # the first batch the general way, the next ones restack's
        batch, _ = made(writer, fn_map, samples)
        same(batch, default_collate(samples))
    if fast:  # plain samples went through stack_into; the transposed and mixed ones through torch.stack
        plain = isinstance(samples[0], dict) or samples[0].is_contiguous() and samples[0].dtype == samples[1].dtype
        assert any(stacked) == plain and stacked, stacked


@pytest.mark.parametrize("fast", [True, False], ids=["stack_into", "torch.stack"])
@pytest.mark.parametrize(
    "samples",
    [
        [(torch.arange(12.0).view(3, 4) + i, torch.tensor(i)) for i in range(6)],
        [(torch.arange(12.0).view(3, 4) + i, i) for i in range(6)],  # torchvision's (image, class)
        [[torch.arange(4) * i, i / 3, torch.ones(2, dtype=torch.bool)] for i in range(6)],
        [{"input_ids": torch.arange(8) + i, "label": i % 2, "score": i / 7} for i in range(6)],
        [torch.arange(3) + i for i in range(6)],
        list(range(6)),
        [(torch.arange(2) * i, i % 3 == 0) for i in range(6)],
    ],
    ids=["tensor pairs", "int labels", "lists", "dicts", "tensors", "ints", "bool labels"],
)
def test_a_batch_like_the_last_one_at_its_slot_is_stacked_again_in_one_step(
        samples: list[Any], fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``restack``: the first batch the general way (its columns remembered), the next ones in one
    step, each default_collate's batch, with the same skeleton and leaf table in the slot."""
    if not fast:
        monkeypatch.setattr(_collate, "_stack_into", None)
    mm = mmap.mmap(-1, 1 << 16)
    writer = SlotWriter(mm)
    fn_map = slot_collate_map(writer)
    restacked, described = [], []
    for _ in range(3):
        batch, again = made(writer, fn_map, samples)
        restacked.append(again)
        same(batch, default_collate(samples))
        at, end = 4096 + writer.pickled_off, 4096 + writer.table_off + writer.table_len
        described.append((writer.pickled_off, writer.pickled_len, writer.table_off, writer.table_len,
                          writer.dataset_state_off, bytes(mm[at : at + writer.pickled_len]), bytes(mm[4096 + writer.table_off : end])))
    assert restacked == [False, True, True]
    assert described[0] == described[1] == described[2]


@pytest.mark.parametrize("label", [2**63, 2.5, True, np.int64(3)], ids=["overflow", "a float", "a bool", "a numpy int"])
def test_labels_unlike_the_last_batch_s_are_collated_the_general_way(label: Any) -> None:
    """After a batch of int labels, one whose labels are not all Python ints is not written as
    ints: its tensor is torch's (promoted, or its error)."""
    mm = mmap.mmap(-1, 1 << 16)
    writer = SlotWriter(mm)
    fn_map = slot_collate_map(writer)
    first = [(torch.arange(3), i) for i in range(4)]
    writer.begin(4096, 1 << 15)
    writer.samples_type = tuple
    writer.finish(torch.utils.data._utils.collate.collate(first, collate_fn_map=fn_map))
    odd = [*first[:2], (torch.arange(3), label), first[3]]
    writer.begin(4096, 1 << 15)
    assert writer.restack(odd) is None
    try:
        want = default_collate(odd)
    except Exception as exc:
        with pytest.raises(type(exc), match=str(exc)):
            torch.utils.data._utils.collate.collate(odd, collate_fn_map=fn_map)
    else:
        same(torch.utils.data._utils.collate.collate(odd, collate_fn_map=fn_map), want)


@pytest.mark.parametrize("samples", [[()] * 4, [[]] * 4, [{}] * 4], ids=["tuples", "lists", "dicts"])
def test_empty_samples_are_collated_as_torch_collates_them_batch_after_batch(samples: list[Any]) -> None:
    mm = mmap.mmap(-1, 1 << 16)
    writer = SlotWriter(mm)
    fn_map = slot_collate_map(writer)
    for _ in range(3):
        batch, _ = made(writer, fn_map, samples)
        assert batch == default_collate(samples) and type(batch) is type(default_collate(samples))


def test_numbers_of_two_types_under_a_default_dtype_numpy_lacks_are_torchs() -> None:
    """An int, then a float, under torch.set_default_dtype(torch.bfloat16): torch's collate makes
    one bfloat16 tensor of them; so does the slot's, batch after batch."""
    samples = [(torch.ones(2), 1), (torch.ones(2), 2.5)]
    mm = mmap.mmap(-1, 1 << 16)
    writer = SlotWriter(mm)
    fn_map = slot_collate_map(writer)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        for _ in range(3):
            batch, _ = made(writer, fn_map, samples)
            same(batch, default_collate(samples))
            assert batch[1].dtype == torch.bfloat16
    finally:
        torch.set_default_dtype(before)


def test_restack_leaves_a_user_s_collate_entry_for_containers_alone() -> None:
    """A collate map entry of the user's for tuples (``default_collate_fn_map`` extended) is called
    for every batch: such samples are not stacked again in one step."""
    calls = []

    def tuples(batch: list[Any], *, collate_fn_map: Any = None) -> Any:
        calls.append(len(batch))
        return [torch.utils.data._utils.collate.collate(list(c), collate_fn_map=collate_fn_map) for c in zip(*batch)]

    from shmloader.worker.produce import Producer, WorkerConfig
    cfg = WorkerConfig(worker_id=0, num_workers=1, dataset=[(torch.arange(3) + i, i) for i in range(8)],
                       iterable=False, auto_collation=True, collate_fn=default_collate, drop_last=False, base_seed=0,
                       worker_init_fn=None, parent_pid=os.getpid())
    mm = mmap.mmap(-1, 1 << 16)
    writer = SlotWriter(mm)
    fn_map = {tuple: tuples, **slot_collate_map(writer)}
    producer = Producer(cfg)
    for k in range(3):
        writer.begin(4096, 1 << 15)
        outcome, batch = producer.produce(0, [2 * k, 2 * k + 1], writer, fn_map)
        same(batch, [torch.stack([torch.arange(3) + 2 * k, torch.arange(3) + 2 * k + 1]), torch.tensor([2 * k, 2 * k + 1])])
    assert calls == [2, 2, 2]


def test_the_environment_variable_turns_it_off_and_says_how_to_turn_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_accel.OFF_VARIABLE, "1")
    assert _accel.learn() == (None, ("SHMLOADER_NO_FAST_PATH is set in the environment", "unset SHMLOADER_NO_FAST_PATH"))


def test_a_torch_whose_tensors_do_not_match_leaves_it_unlearned(relearn: None) -> None:
    requires_grad, untyped_storage, modes, dtypes, probes, fresh, graded = _accel._probes()
    elsewhere = [(t, cdata + 8, *rest) for t, cdata, *rest in probes]  # (no word holds these)
    why = _native.learn_tensors(_accel.TORCH_LIB, torch.Tensor, requires_grad, untyped_storage, modes, dtypes,
                                elsewhere, fresh, graded)
    assert why == f"no word of a {torch.Tensor.__basicsize__}-byte tensor object holds its TensorImpl"
    assert _native.tensor_offsets() is None
    samples, out = samples_of(torch.float32), fresh_out((5, 3, 4), torch.float32)
    assert stack_into(samples, out) is False and untouched(out)  # (unlearned: nothing read, nothing written)


def test_a_shim_that_says_otherwise_than_torch_leaves_it_unlearned(relearn: None) -> None:
    requires_grad, untyped_storage, modes, dtypes, probes, fresh, graded = _accel._probes()
    t, cdata, keys, data, shape, stride = probes[0]
    probes[0] = (t, cdata, keys, data, (*shape[:-1], shape[-1] + 1), stride)
    why = _native.learn_tensors(_accel.TORCH_LIB, torch.Tensor, requires_grad, untyped_storage, modes, dtypes,
                                probes, fresh, graded)
    assert why == "torch's C shim does not say what torch says of a probe"
    assert _native.tensor_offsets() is None


def test_learning_under_no_grad_inference_mode_or_a_mode_finds_the_same(relearn: None) -> None:
    from torch.overrides import TorchFunctionMode

    learned = _native.tensor_offsets()
    assert learned is not None and learned[0] >= 16 and 0 <= learned[2] < learned[1] < 320
    for context in (torch.no_grad(), torch.inference_mode(), torch.enable_grad(), TorchFunctionMode()):
        with context:
            assert _accel.learn() == (stack_into, None), context
        assert _native.tensor_offsets() == learned


def test_its_functions_have_text_signatures() -> None:
    import inspect

    assert str(inspect.signature(stack_into)) == "(samples, out, /)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8, torch.bool, torch.complex64, torch.bfloat16], ids=str)
def test_copy_out_is_a_clone_in_pages_of_its_own(dtype: torch.dtype) -> None:
    src = torch.arange(3 * 70_000).reshape(3, 70_000).to(dtype)
    out = _lease.copy_out(src)
    assert out is not None
    assert (out.dtype, out.shape, out.stride()) == (src.dtype, src.shape, src.stride())
    assert torch.equal(out, src) and out.data_ptr() != src.data_ptr() and out.data_ptr() % 4096 == 0
    src.zero_()  # independent of its source
    assert torch.equal(out, torch.arange(3 * 70_000).reshape(3, 70_000).to(dtype))


def test_copy_out_gives_its_pages_back_with_its_last_view() -> None:
    out = _lease.copy_out(torch.ones(1 << 20, dtype=torch.uint8))
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
    assert _lease.copy_out(tensor) is None


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
    out = _lease.copy_out(src)
    assert out is not None and torch.equal(out, src) and out.data_ptr() != src.data_ptr()
    assert copies_mapped() == before + 1
    del out
    assert copies_mapped() == before


def test_no_file_descriptor_left_means_a_clone_and_nothing_left_behind() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fds, before = len(os.listdir("/proc/self/fd")), copies_mapped()
    lowest_free = os.dup(0)
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # (memfd_create: EMFILE)
    try:
        copied = _lease.copy_out(torch.ones(70_000))
        held = _lease.copy_leaf(torch.ones(70_000), int(Kind.TENSOR))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert copied is None and torch.equal(held, torch.ones(70_000))  # (copy_leaf cloned it)
    assert len(os.listdir("/proc/self/fd")) == fds and copies_mapped() == before


@pytest.mark.parametrize("address, nbytes", [(0, 16), (4096, 0), (4096, -1)])
def test_copy_pages_refuses_a_null_address_or_no_bytes(address: int, nbytes: int) -> None:
    with pytest.raises(ValueError, match="non-null address and a positive size"):
        _native.copy_pages(address, nbytes)
