"""Every dtype torch's own DataLoader delivers, and tensors of many dimensions, through torch's
loader and shmloader's on the same job: equal batches (type, dtype, shape, bytes) or the same
exception type. The dtypes are enumerated from torch, not listed."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch
from torch.utils.data import Dataset

import shmloader

ALL_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def sample_of(dtype: torch.dtype) -> Callable[[int], torch.Tensor]:
    """Sample i: 6 elements of ``dtype`` whose bytes depend on i (quantized: from floats)."""
    if dtype in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4):
        return lambda i: torch.quantize_per_tensor(torch.arange(6.0) + i, 0.5, 1, dtype)
    if dtype is torch.bool:  # a bool byte is 0 or 1
        return lambda i: torch.arange(6) % (i + 2) == 0
    raw = 6 * dtype.itemsize
    return lambda i: (torch.arange(raw, dtype=torch.int32) * 7 + i).to(torch.uint8).view(dtype)


class Samples(Dataset):  # type: ignore[type-arg]
    def __init__(self, make: Callable[[int], Any]) -> None:
        self.make = make

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return self.make(i)


def outcome(loader: Any) -> Any:
    """The batches as (dtype, shape, bytes), or the exception's type. The iterator's workers
    are stopped before it returns (torch's, left to the garbage collector after an error,
    can take its whole 5-second join timeout per worker)."""
    it = iter(loader)
    try:
        out = []
        for batch in it:
            if batch.is_quantized:
                out.append((batch.dtype, tuple(batch.shape), batch.int_repr().tolist(), batch.q_scale()))
            else:
                out.append((batch.dtype, tuple(batch.shape), bytes(batch.contiguous().view(-1).view(torch.uint8).numpy())))
        return out
    except Exception as exc:
        return type(exc)
    finally:
        getattr(it, "_shutdown_workers", lambda: None)()


def both(make: Callable[[int], Any]) -> tuple[Any, Any]:
    """torch's outcome with workers, and ours. Where torch's workers fail, the reference is
    torch's ``default_collate`` in the main process (``num_workers=0``): its workers' failure
    can be an artifact of their shared-memory path (``elem.new(storage)`` refuses quantized
    tensors with a RuntimeError, bits16 with a TypeError), which shmloader does not have.
    Then shmloader must deliver what default_collate delivers, bit for bit, or raise what it
    raises."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors' deprecation
        theirs = outcome(torch.utils.data.DataLoader(Samples(make), batch_size=2, num_workers=2))
        if not isinstance(theirs, list):
            theirs = outcome(torch.utils.data.DataLoader(Samples(make), batch_size=2))
        ours = outcome(shmloader.DataLoader(Samples(make), batch_size=2, num_workers=2))
    return theirs, ours


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_as_torch_delivers_it(dtype: torch.dtype) -> None:
    try:
        make = sample_of(dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            make(0)
    except Exception as exc:
        pytest.skip(f"torch cannot make a {dtype} tensor here ({type(exc).__name__})")
    theirs, ours = both(make)
    assert ours == theirs
    if isinstance(theirs, list):
        assert len(theirs) == 2 and theirs[0][0] == dtype


@pytest.mark.parametrize("ndim", [31, 32, 33, 40, 63])
def test_tensors_of_many_dimensions(ndim: int) -> None:
    theirs, ours = both(lambda i: torch.full((1,) * (ndim - 1) + (2,), float(i)))
    assert ours == theirs and isinstance(theirs, list) and len(theirs[0][1]) == ndim + 1


def test_mixed_dtypes_are_promoted_not_truncated() -> None:
    # int32 first, then an int64 that int32 cannot hold: torch.stack (and default_collate in the
    # main process) promotes to int64; shmloader keeps that, whatever torch's workers do.
    def make(i: int) -> torch.Tensor:
        return torch.tensor([i], dtype=torch.int32) if i % 2 == 0 else torch.tensor([2**40 + i])

    want = outcome(torch.utils.data.DataLoader(Samples(make), batch_size=2))
    ours = outcome(shmloader.DataLoader(Samples(make), batch_size=2, num_workers=2))
    assert ours == want and want[0][0] == torch.int64
    assert torch.equal(next(iter(shmloader.DataLoader(Samples(make), batch_size=2, num_workers=2))),
                       torch.tensor([[0], [2**40 + 1]]))


@pytest.mark.parametrize("kind", ["requires grad", "conjugate view", "negative view"])
def test_samples_torchs_workers_cannot_stack_arrive_as_in_the_main_process(kind: str) -> None:
    # torch's workers stack into shared memory with out=, which refuses all three (a
    # RuntimeError); default_collate in the main process stacks them. shmloader delivers that
    # batch: the same values and flags, and a batch that requires grad is a leaf (no graph
    # crosses processes).
    def make(i: int) -> torch.Tensor:
        t = torch.arange(12.0).reshape(3, 4) + i
        if kind == "requires grad":
            return t.requires_grad_()
        z = torch.complex(t, -t).conj()
        return z if kind == "conjugate view" else z.imag  # a conjugate's imag is a negative view

    assert outcome(torch.utils.data.DataLoader(Samples(make), batch_size=2, num_workers=2)) is RuntimeError
    with torch.no_grad():
        theirs, ours = both(make)
    assert isinstance(theirs, list) and ours == theirs
    want = next(iter(torch.utils.data.DataLoader(Samples(make), batch_size=2)))
    got = next(iter(shmloader.DataLoader(Samples(make), batch_size=2, num_workers=2)))
    assert torch.equal(got.detach().resolve_conj().resolve_neg(), want.detach().resolve_conj().resolve_neg())
    assert (got.requires_grad, got.is_conj(), got.is_neg()) == (want.requires_grad, want.is_conj(), want.is_neg())
    assert got.is_leaf and got.grad_fn is None


Point = __import__("collections").namedtuple("Point", "x y")
ODD_VALUES: dict[str, Callable[[int], Any]] = {
    "0-d tensor": lambda i: torch.tensor(float(i)),
    "empty tensor": lambda i: torch.empty(0, 3),
    "empty with a huge dimension": lambda i: torch.empty(0, 2**40),
    "empty with a dimension numpy cannot hold": lambda i: torch.empty(0, 2**61),
    "non-contiguous tensor": lambda i: torch.arange(12.0).reshape(3, 4).t() + i,
    "negative-stride numpy view": lambda i: __import__("numpy").arange(6)[::-1] + i,
    "numpy big-endian": lambda i: __import__("numpy").arange(4, dtype=">i4") + i,
    "numpy 0-d": lambda i: __import__("numpy").float32(i),
    "nested containers": lambda i: {"a": [torch.tensor([i]), (i, "s")], "b": {"c": torch.ones(2) * i}},
    "namedtuple": lambda i: Point(torch.tensor([i]), i),
    "OrderedDict": lambda i: __import__("collections").OrderedDict([("z", i), ("a", torch.tensor([i]))]),
    "non-string dict keys": lambda i: {1: torch.tensor([i]), (2, 3): i},
    "huge Python int": lambda i: 2**70 + i,
    "NaN and inf": lambda i: torch.tensor([float("nan"), float("inf"), -float("inf"), i]),
    "strings and bytes": lambda i: (f"s{i}", bytes([i])),
    "None": lambda i: None,
}


def canonical(batch: Any) -> Any:
    """A comparable form: tensors and arrays as (type, dtype, shape, bytes), containers kept."""
    import numpy as np

    if isinstance(batch, torch.Tensor):
        return ("tensor", batch.dtype, tuple(batch.shape), bytes(batch.contiguous().view(-1).view(torch.uint8).numpy()))
    if isinstance(batch, np.ndarray):
        return ("ndarray", batch.dtype.str, batch.shape, batch.tobytes())
    if isinstance(batch, dict):
        return (type(batch).__name__, [(k, canonical(v)) for k, v in batch.items()])
    if isinstance(batch, (list, tuple)):
        return (type(batch).__name__, [canonical(v) for v in batch])
    return (type(batch).__name__, repr(batch))


def outcomes_of(make: Callable[[int], Any], loader: Any, **kw: Any) -> Any:
    it = iter(loader(Samples(make), **kw))
    try:
        return [canonical(b) for b in it]
    except Exception as exc:
        return type(exc)
    finally:
        getattr(it, "_shutdown_workers", lambda: None)()  # (as in outcome)


@pytest.mark.parametrize("collate", [None, "identity"])
@pytest.mark.parametrize("name", list(ODD_VALUES))
def test_odd_values_as_torch_delivers_them(name: str, collate: Any) -> None:
    kw: dict[str, Any] = {"batch_size": 2}
    if collate == "identity":
        kw["collate_fn"] = list  # a custom collate: its result is copied into the slot once
    make = ODD_VALUES[name]
    theirs = outcomes_of(make, torch.utils.data.DataLoader, num_workers=2, **kw)
    if not isinstance(theirs, list):  # its workers' shared-memory path: default_collate in process
        theirs = outcomes_of(make, torch.utils.data.DataLoader, **kw)
    assert outcomes_of(make, shmloader.DataLoader, num_workers=2, **kw) == theirs


def storage_outcome(loader: Any) -> Any:
    """Batches of storages (or lists of them) as (type, dtype, bytes), or the exception's type."""
    def seen(s: Any) -> Any:
        if isinstance(s, list):
            return [seen(x) for x in s]
        return type(s).__name__, getattr(s, "dtype", None), bytes(s.untyped() if type(s) is torch.TypedStorage else s)

    it = iter(loader)
    try:
        return [seen(batch) for batch in it]
    except Exception as exc:
        return type(exc)
    finally:
        getattr(it, "_shutdown_workers", lambda: None)()


@pytest.mark.parametrize("typed", [False, True], ids=["UntypedStorage", "TypedStorage"])
@pytest.mark.parametrize("collation", ["none", "custom", "default"])
def test_storages_as_samples(typed: bool, collation: str) -> None:
    def make(i: int) -> Any:
        t = torch.arange(i, i + 5, dtype=torch.int32)
        return t.storage() if typed else t.untyped_storage()

    kw: dict[str, Any] = {"batch_size": None} if collation == "none" else {"batch_size": 2}
    if collation == "custom":
        kw["collate_fn"] = list
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage's deprecation
        theirs = storage_outcome(torch.utils.data.DataLoader(Samples(make), num_workers=2, **kw))
        ours = storage_outcome(shmloader.DataLoader(Samples(make), num_workers=2, **kw))
    assert ours == theirs
    if collation == "default":
        assert theirs is TypeError  # default_collate refuses storages, in both
    else:
        assert isinstance(theirs, list) and len(theirs) == (4 if collation == "none" else 2)


def test_a_storage_is_a_zero_copy_leased_view_of_its_slot() -> None:
    loader = shmloader.DataLoader(Samples(lambda i: torch.full((4,), i, dtype=torch.int64).untyped_storage()),
                                  batch_size=None, num_workers=2)
    it = iter(loader)
    storage = next(it)
    assert isinstance(storage, torch.UntypedStorage) and bytes(storage) == bytes(torch.zeros(4, dtype=torch.int64).numpy())
    ring = it.ring
    assert ring is not None
    origin = ring.bytes.__array_interface__["data"][0]
    assert origin <= storage.data_ptr() < origin + ring.geometry.total_bytes  # in the ring: not a copy
    assert it.held_count() == 1  # the storage holds its slot...
    kept = next(it)
    assert it.held_count() == 2
    del storage
    assert it.held_count() == 1 and bytes(kept) == bytes(torch.ones(4, dtype=torch.int64).numpy())  # ...until dropped
    it._shutdown_workers()


def test_a_tensor_and_an_ndarray_fail_with_torchs_exception() -> None:
    import numpy as np

    def make(i: int) -> Any:
        return torch.zeros(2) if i % 2 == 0 else np.zeros(2)

    theirs = outcomes_of(make, torch.utils.data.DataLoader, num_workers=2, batch_size=2)
    assert theirs is AttributeError  # (torch's workers: 'numpy.ndarray' object has no attribute 'numel')
    assert outcomes_of(make, shmloader.DataLoader, num_workers=2, batch_size=2) is theirs


def nested_outcome(loader: Any) -> Any:
    """Batches with their nested tensors as (layout, is_nested, [components' bytes])."""
    def seen(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: seen(v) for k, v in x.items()}
        if isinstance(x, torch.Tensor) and x.is_nested:
            return "nested", x.layout, [(t.dtype, tuple(t.shape), t.tolist()) for t in x.unbind()]
        return canonical(x)

    it = iter(loader)
    try:
        return [seen(batch) for batch in it]
    finally:
        getattr(it, "_shutdown_workers", lambda: None)()


def ragged(i: int) -> torch.Tensor:
    return torch.arange(float(i + 1)) * (i + 1)


@pytest.mark.parametrize("shape", ["alone", "in a dict", "a sample"])
def test_strided_nested_tensors_as_torch_delivers_them(shape: str) -> None:
    def collate(samples: list[torch.Tensor]) -> Any:
        nested = torch.nested.nested_tensor(samples)  # the strided layout: no sizes, one buffer
        return nested if shape == "alone" else {"x": nested, "n": torch.tensor([len(samples)])}

    kw: dict[str, Any] = {"batch_size": 2, "collate_fn": collate}
    make: Callable[[int], Any] = ragged
    if shape == "a sample":
        kw = {"batch_size": None}
        make = lambda i: torch.nested.nested_tensor([ragged(i), ragged(i + 1)])  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors' prototype warning
        theirs = nested_outcome(torch.utils.data.DataLoader(Samples(make), num_workers=2, **kw))
        ours = nested_outcome(shmloader.DataLoader(Samples(make), num_workers=2, **kw))
    assert ours == theirs and len(theirs) == (4 if shape == "a sample" else 2)


@pytest.mark.parametrize("collate", [None, "identity"])
def test_views_of_one_tensor_share_their_storage_as_in_torch(collate: Any) -> None:
    # A sample of several views of one tensor: torch's batch keeps them one storage, with each
    # view's strides and offset; so does shmloader's, and a write through one shows in all.
    def make(i: int) -> Any:
        x = torch.arange(12.0).reshape(3, 4) + i
        return x[1:], x, x.t(), {"row": x[2, ::2], "bits": x.view(torch.int32)}

    def views(sample: Any) -> Any:
        tensors = [sample[0], sample[1], sample[2], sample[3]["row"], sample[3]["bits"]]
        base = tensors[0].untyped_storage().data_ptr()
        return [(t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage().data_ptr() == base,
                 t.tolist()) for t in tensors]

    kw: dict[str, Any] = {"batch_size": None} if collate is None else {"batch_size": 2, "collate_fn": list}

    def run(loader: Any) -> list[Any]:
        out = []
        for batch in loader(Samples(make), num_workers=2, **kw):
            for sample in [batch] if collate is None else batch:
                out.append(views(sample))
                sample[1][0, 0] = -1.0
                assert sample[0].untyped_storage().data_ptr() != sample[1].untyped_storage().data_ptr() or (
                    sample[2][0, 0].item() == -1.0)
        return out

    theirs = run(torch.utils.data.DataLoader)
    assert all(shared for sample in theirs for *_, shared, _ in sample)
    assert run(shmloader.DataLoader) == theirs


def test_a_row_of_a_large_tensor_does_not_bring_the_whole_tensor() -> None:
    # A dataset that returns rows of one tensor in memory (TensorDataset, batch_size=None): each
    # batch is its row, not a view of the whole table (torch moves the whole table to shared
    # memory once; a slot would take it every batch).
    table = torch.arange(40_000.0).reshape(10_000, 4)
    dataset = torch.utils.data.TensorDataset(table)
    it = iter(shmloader.DataLoader(dataset, batch_size=None, num_workers=2))
    try:
        rows = [next(it) for _ in range(5)]
        assert [r[0].tolist() for r in rows] == [table[i].tolist() for i in range(5)]
        assert it.ring is not None and it.ring.geometry.data_bytes < table.numel() * 4
    finally:
        it._shutdown_workers()
