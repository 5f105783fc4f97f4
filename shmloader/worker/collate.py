"""Collate into a slot (worker side).

``SlotWriter`` is a bump allocator over one slot's data region. The default collate
runs torch's own ``collate`` recursion with a function map whose tensor entry stacks
the samples straight into slot memory (``torch.stack(..., out=view)``), so no
intermediate batch tensor exists. Whatever else the batch holds (a custom
``collate_fn``'s tensors, numpy arrays, numbers) is copied in once while the batch's
skeleton is pickled: the pickler's ``persistent_id`` turns every tensor and numpy
array into a leaf of the slot, so only metadata is pickled.

A batch of the default collate like the last one at its slot is made again in one step
(``SlotWriter.restack``, whose plans ``worker.restack`` holds).

When a batch does not fit, the writer keeps measuring and reports the bytes it needed:
the default collate still stacks into private memory (those tensors are the batch), but
what would be copied in is not copied (a later writer copies it from the batch). A writer
without a segment (the probe that sizes the ring) measures only.
"""

from __future__ import annotations

import functools
import io
import math
import operator
import pickle
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data._utils import collate as torch_collate

from shmloader import _native
from shmloader._accel import STACK_INTO
from shmloader.wire.layout import (
    CODE_OF_DTYPE,
    CODE_OF_NP_DTYPE,
    LEAF_ALIGN,
    LONE_LEAF,
    STORAGE,
    TORCH_ONLY_CODES,
    TYPED_STORAGE,
    VIEW,
    Kind,
    round_up,
    table_bytes,
    view_leaf,
)
from shmloader.worker.restack import Column, Layout, Restack, numbers_into_slot

Leaf = tuple[int, int, int, tuple[int, ...]]  # (dtype code, kind, offset, shape)
# A tensor viewing a leaf's storage: (VIEW, leaf, dtype name, storage offset, size, stride, number);
# the number tells the tensors of a batch apart (the same one twice is one object, as pickle keeps it).
View = tuple[str, int, str, int, tuple[int, ...], tuple[int, ...], int]
_TENSOR, _NUMPY = int(Kind.TENSOR), int(Kind.NUMPY)
_TENSOR_DTYPES = {dtype: (code, dtype.itemsize) for dtype, code in CODE_OF_DTYPE.items()}
# A tensor viewing part of a storage brings the whole storage when it spans at least 1/ALIAS_SPAN of it.
ALIAS_SPAN = 4
_VIEW_CACHE = 256  # leaf views a writer keeps (a batch with many leaves, shapes that vary: start over)

# torch.stack into a slot as one memcpy per plain sample (None: this torch's tensors are not known)
_stack_into = STACK_INTO


class SlotWriter:
    """Allocates leaves in one slot's data region and records the leaf table."""

    def __init__(self, mm: Any = None) -> None:
        self._mm = mm
        self._bytes = None if mm is None else np.frombuffer(mm, dtype=np.uint8)
        self._views: dict[tuple[int, int, int, tuple[int, ...]], Any] = {}  # (offset, code, kind, shape) -> view
        # (data offset, bytes used, leaf) -> layout of a one-leaf batch's skeleton and table (_finish_lone)
        self._lone: dict[tuple[int, int, Leaf], Layout] = {}
        # data offset -> how the last batch of the default collate was stacked there (restack)
        self._stacks: dict[int, Restack] = {}
        # Set before a batch of the default collate is collated: its samples' type (a batch
        # ``restack`` may stack again is remembered by ``finish``); None: nothing remembered
        self.samples_type: type | None = None
        self.begin(0, 0)

    def begin(self, data_off: int, capacity: int) -> None:
        self.data_off = data_off
        self.capacity = capacity if self._mm is not None else 0
        self.used = 0
        self.fits = self._mm is not None  # a probe writer only measures
        self.leaves: list[Leaf] = []
        self._ids: dict[int, int | View] = {}  # id of a batch's tensor or array -> its leaf, or its view
        # A storage (its _cdata; _keep keeps it alive) -> (first byte, end, leaf) of the leaves of its bytes
        self._storages: dict[int, list[tuple[int, int, int]]] = {}
        self._keep: list[object] = []
        self.stacked: list[Column] = []  # the columns stacked or written into the slot, in order (restack)
        # (mapping, offset, capacity) where finish writes the batch's description (skeleton,
        # leaf table, dataset state), at offsets from there; None: after the leaves
        self._description: tuple[Any, int, int] | None = None

    def describe_in(self, mm: Any, offset: int, capacity: int) -> None:
        """Have ``finish`` write the batch's description (skeleton, leaf table, dataset state)
        at ``offset`` of ``mm``, in ``capacity`` bytes, not after the leaves: the leaves' memory
        then holds the leaves only (``Region.LEAVES``)."""
        self._description = (mm, offset, capacity)

    def _leaf(self, code: int, kind: int, itemsize: int, shape: tuple[int, ...]) -> Any:
        """An uninitialised leaf in the slot (in private memory once the batch overflowed)."""
        nbytes = itemsize * math.prod(shape)
        off = -(-self.used // LEAF_ALIGN) * LEAF_ALIGN
        self.used = off + nbytes
        if self.used > self.capacity:
            self.fits = False
        if not self.fits:
            out = view_leaf(np.empty(nbytes, dtype=np.uint8), code, kind, shape)
        else:
            # A slot gets the same layout batch after batch: its views are made once. Only the
            # batch being written holds them, and it is dropped once written.
            start = self.data_off + off
            key = (start, code, kind, shape)
            out = self._views.get(key)
            if out is None:
                assert self._bytes is not None
                if len(self._views) >= _VIEW_CACHE:
                    self._views.clear()
                out = self._views[key] = view_leaf(self._bytes[start : start + nbytes], code, kind, shape)
        self._ids[id(out)] = len(self.leaves)
        self.leaves.append((code, kind, off, shape))
        self._keep.append(out)
        return out

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        code, itemsize = _TENSOR_DTYPES[dtype]
        out: torch.Tensor = self._leaf(code, _TENSOR, itemsize, shape)
        return out

    def array(self, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
        out: np.ndarray[Any, Any] = self._leaf(CODE_OF_NP_DTYPE[dtype], _NUMPY, dtype.itemsize, shape)
        return out

    def leaf_id(self, obj: object) -> int | View | None:
        """Leaf id for a tensor or array in the batch, copying it into the slot if needed. A
        tensor that views part of a storage is a ``View`` of a leaf holding the bytes it spans,
        which other tensors of the batch viewing those bytes share (as torch's batches do)."""
        known = self._ids.get(id(obj))
        if known is not None:
            return known
        if isinstance(obj, torch.Tensor):
            if (
                type(obj) is not torch.Tensor
                # (nested: strided layout, but no sizes: pickled as torch pickles it, its buffer a storage leaf)
                or obj.is_nested
                or obj.layout is not torch.strided
                or obj.device.type != "cpu"
                or obj.requires_grad
                or obj.is_quantized
            ):
                return None
            if obj.dtype not in CODE_OF_DTYPE:
                return self._by_name(obj)
            storage = None if obj.is_conj() or obj.is_neg() or not obj.numel() else obj.untyped_storage()
            if storage is not None:  # (conjugate and negative views are resolved into a copy)
                view = self._view_of(obj, storage)
                if view is not None:
                    self._ids[id(obj)] = view
                    self._keep.append(obj)
                    return view
            out = self.tensor(obj.dtype, tuple(obj.shape))
            if not self.fits:
                pass  # measuring only (past its capacity, or a probe): its leaves are never published
            elif obj.dtype is torch.bool:  # its bytes as they are (copy_ makes 0x01 of a 0xFF true, as numpy stores it)
                out.view(torch.uint8).copy_(obj.view(torch.uint8))
            elif CODE_OF_DTYPE[obj.dtype] < TORCH_ONLY_CODES and obj.dtype is not torch.bfloat16:
                out.copy_(obj)
            else:  # float8, sub-byte and bit types: torch copies them as bytes only
                out.view(torch.uint8).copy_(obj.view(torch.uint8))
            if storage is not None:  # the whole storage: later tensors viewing it share this leaf
                self._storages.setdefault(storage._cdata, []).append((0, storage.nbytes(), len(self.leaves) - 1))
        elif type(obj) is np.ndarray and obj.dtype in CODE_OF_NP_DTYPE:
            array = self.array(obj.dtype, obj.shape)
            if self.fits:  # (measuring only: never published)
                np.copyto(array, obj, casting="no")
        else:
            return None
        leaf_id = len(self.leaves) - 1
        self._ids[id(obj)] = leaf_id  # the same object twice in a batch is one leaf
        self._keep.append(obj)
        return leaf_id

    def _by_name(self, obj: torch.Tensor) -> View:
        """A tensor of a dtype newer than this shmloader (bcomplex32 in torch 2.14): its bytes,
        viewed by the dtype's name (torch's own pickle of it did not load back); a conjugate or
        negative view's resolved first, as the other dtypes' are."""
        plain = obj.resolve_conj().resolve_neg()
        storage = plain.untyped_storage()
        if plain.numel():
            view = self._view_of(plain, storage, always=True)
            assert view is not None
        else:
            dtype = str(plain.dtype).removeprefix("torch.")
            view = (VIEW, self._bytes_leaf(storage, 0, 0), dtype, 0, tuple(plain.shape), plain.stride(), len(self._ids))
        self._ids[id(obj)] = view
        self._keep += [obj, plain]
        return view

    def _view_of(self, obj: torch.Tensor, storage: torch.UntypedStorage, always: bool = False) -> View | None:
        """``obj`` as a view of a leaf of its storage's bytes, or (unless ``always``) None for a
        tensor that is its whole storage, contiguous, not seen before (the common case: a leaf
        of its own)."""
        itemsize = obj.element_size()
        start = int(obj.storage_offset()) * itemsize
        end = start + (1 + sum((int(n) - 1) * st for n, st in zip(obj.shape, obj.stride()))) * itemsize
        dtype = str(obj.dtype).removeprefix("torch.")
        for first, last, leaf in self._storages.get(storage._cdata, ()):
            if first <= start and end <= last and (start - first) % itemsize == 0:
                return (VIEW, leaf, dtype, (start - first) // itemsize, tuple(obj.shape), obj.stride(), len(self._ids))
        nbytes = int(storage.nbytes())
        if start == 0 and end == nbytes and obj.is_contiguous() and not always:
            return None
        # Its whole storage when that is at most ALIAS_SPAN times what it spans (then x[:1]
        # before x still shares x's leaf); otherwise only its span (a row of a dataset-sized
        # tensor is not the dataset).
        lo, hi = (0, nbytes) if nbytes <= ALIAS_SPAN * (end - start) else (start, end)
        leaf = self._bytes_leaf(storage, lo, hi)
        return (VIEW, leaf, dtype, (start - lo) // itemsize, tuple(obj.shape), obj.stride(), len(self._ids))

    def _bytes_leaf(self, storage: torch.UntypedStorage, lo: int, hi: int) -> int:
        """A uint8 leaf of ``storage``'s bytes [lo, hi), remembered for the tensors that view them."""
        source = torch.empty(0, dtype=torch.uint8).set_(storage, lo, (hi - lo,), (1,))
        out = self.tensor(torch.uint8, (hi - lo,))
        if self.fits:  # (measuring only: never published)
            out.copy_(source)
        leaf = len(self.leaves) - 1
        self._keep.append(source)  # (keeps the storage, and so its _cdata, alive until finish)
        self._storages.setdefault(storage._cdata, []).append((lo, hi, leaf))
        return leaf

    def storage_id(self, storage: torch.UntypedStorage) -> int | None:
        """Leaf id for a CPU storage in the batch: its bytes, as a uint8 tensor leaf in the slot
        (the main process hands back that leaf's storage: zero-copy, leased like a tensor). One
        leaf for a storage and the tensors of the batch that view all of it."""
        if storage.device.type != "cpu":
            return None
        nbytes = storage.nbytes()
        for lo, hi, leaf in self._storages.get(storage._cdata, ()):
            if lo == 0 and hi == nbytes:
                return leaf
        return self._bytes_leaf(storage, 0, nbytes)

    def finish(self, batch: object, dataset_state: bytes = b"") -> int:
        """Pickle ``batch``'s skeleton and write it with the leaf table (and the pickled
        ``dataset_state`` after it, for an IterableDataset that has one).

        Returns the bytes the batch needs (its leaves' only, when ``describe_in`` put the
        rest apart); when that exceeds the slot's capacity nothing usable was written and the
        caller reports the size.
        """
        leaves, description = self.leaves, self._description
        if len(leaves) == 1 and batch is self._keep[0]:  # the common single-tensor batch
            if not dataset_state and self.fits and description is None:
                return self._finish_lone(leaves[0], batch)
            skeleton: bytes | memoryview = LONE_LEAF
        else:
            buf = io.BytesIO()
            _LeafPickler(buf, self).dump(batch)
            skeleton = buf.getbuffer()
        columns = self._columns_of(batch) if self.samples_type is not None and not dataset_state else None
        self.pickled_off = round_up(0 if description else self.used, 8)
        self.pickled_len = len(skeleton)
        self.table_off = round_up(self.pickled_off + self.pickled_len, 8)
        self.table_len = table_bytes(leaf[3] for leaf in self.leaves)
        self.dataset_state_off = round_up(self.table_off + self.table_len, 8)
        self.dataset_state_len = len(dataset_state)
        end = self.dataset_state_off + self.dataset_state_len
        if description is None:
            mm, base, needed = self._mm, self.data_off, end
            fits = self.fits and end <= self.capacity
        else:
            (mm, base, room), needed = description, self.used
            fits = self.fits and end <= room
        if not fits:
            self.fits = False
            return needed
        assert mm is not None
        start = base + self.pickled_off
        mm[start : start + self.pickled_len] = skeleton
        written = _native.encode_table(mm, base + self.table_off, self.table_len, self.leaves)
        if written != self.table_len:
            raise RuntimeError(f"the leaf table took {written} bytes, {self.table_len} were reserved")
        if dataset_state:
            start = base + self.dataset_state_off
            mm[start : start + self.dataset_state_len] = dataset_state
        elif columns is not None and description is None:
            start = base + self.pickled_off
            block = bytes(mm[start : base + self.table_off + self.table_len])
            layout = (self.pickled_off, self.pickled_len, self.table_off, self.table_len, needed, block)
            self._remember(columns, self.samples_type, layout, batch)
        self._keep.clear()
        return needed

    def _columns_of(self, batch: object) -> list[Column] | None:
        """The columns of a batch the default collate made of samples of ``samples_type`` (a
        tuple, list or dict whose items are tensors), when its leaves are exactly the tensors
        ``_stack_into_slot`` stacked into the slot, in order: ``restack`` may stack the next
        such batch into the same views, and write the same skeleton and leaf table."""
        stacked = self.stacked
        if type(batch) is list and self.samples_type in (tuple, list):
            values: list[object] = batch
        elif type(batch) is dict and self.samples_type is dict and all(type(k) is str for k in batch):
            values = list(batch.values())
        else:
            return None
        if not stacked or len(values) != len(stacked) or len(self.leaves) != len(stacked):
            return None  # (an empty container: nothing to stack again)
        return stacked if all(v is c.out for v, c in zip(values, stacked)) else None

    def _remember(self, columns: list[Column], samples_type: type | None, layout: Layout,
                  batch: object = None) -> None:
        assert samples_type is not None
        if len(self._stacks) >= _VIEW_CACHE:
            self._stacks.clear()
        keys = tuple(batch) if type(batch) is dict else None
        self._stacks[self.data_off] = Restack(tuple(columns), samples_type, keys, self.used, layout)

    def _finish_lone(self, leaf: Leaf, batch: object) -> int:
        """``finish`` for a batch that is one leaf, without a dataset state: the skeleton and
        the leaf table are the same batch after batch, so they are laid out once per slot and
        leaf, and written as one block. A batch ``_stack_into_slot`` stacked is remembered for
        ``restack``."""
        key = (self.data_off, self.used, leaf)
        layout = self._lone.get(key)
        if layout is None:
            if len(self._lone) >= _VIEW_CACHE:
                self._lone.clear()
            pickled_off = round_up(self.used, 8)
            table_off = round_up(pickled_off + len(LONE_LEAF), 8)
            table = bytearray(table_bytes([leaf[3]]))
            _native.encode_table(table, 0, len(table), [leaf])
            block = LONE_LEAF + bytes(table_off - pickled_off - len(LONE_LEAF)) + table
            layout = self._lone[key] = (pickled_off, len(LONE_LEAF), table_off, len(table),
                                        round_up(table_off + len(table), 8), block)
        needed = self._write_layout(layout)
        stacked = self.stacked
        if self.fits and len(stacked) == 1 and stacked[0].out is batch:
            self._remember(stacked, stacked[0].number or torch.Tensor, layout)
        return needed

    def _write_layout(self, layout: Layout) -> int:
        """Write a batch's skeleton and leaf table as ``finish`` laid them out for an earlier
        batch at this slot (one block)."""
        self.pickled_off, self.pickled_len, self.table_off, self.table_len, needed, block = layout
        self.dataset_state_off, self.dataset_state_len = needed, 0
        if needed > self.capacity:
            self.fits = False
            return needed
        start = self.data_off + self.pickled_off
        self._mm[start : start + len(block)] = block
        self._keep.clear()
        return needed

    def restack(self, samples: list[Any]) -> Any:
        """The default collate's steady state, in one step: when the last batch written at this
        slot was ``samples``-like (plain tensors, or tuples, lists or dicts of them, stacked by
        ``_stack_into_slot``: the same count, sample shapes and dtypes, keys), stack these
        into the same views (one memcpy per plain sample with ``_native.stack_into``, else
        ``torch.stack``) and write the same skeleton and leaf table; the writer is then as
        ``finish`` leaves it. Returns the batch (a new list or dict of those views, as
        default_collate makes), or None when the samples are not like that (the general way
        collates them, and writes the slot again)."""
        plan = self._stacks.get(self.data_off)
        if plan is None or plan.layout[4] > self.capacity:
            return None
        batch = plan.stack(samples, _stack_into)
        if batch is None:
            return None
        self.used = plan.used
        self._write_layout(plan.layout)
        return batch


class _LeafPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, writer: SlotWriter) -> None:
        super().__init__(file, protocol=5)  # LONE_LEAF assumes protocol 5
        self._leaf_id = writer.leaf_id
        self._storage_id = writer.storage_id

    def persistent_id(self, obj: object) -> int | View | tuple[str, int] | tuple[str, int, str] | None:
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            return self._leaf_id(obj)
        if type(obj) is torch.UntypedStorage:
            leaf = self._storage_id(obj)
            return None if leaf is None else (STORAGE, leaf)
        if type(obj) is torch.TypedStorage:
            leaf = self._storage_id(obj._untyped_storage)
            return None if leaf is None else (TYPED_STORAGE, leaf, str(obj.dtype).removeprefix("torch."))
        return None


_STRIDED = torch.strided
_dtype_of = operator.attrgetter("dtype")


def _stack_into_slot(
    writer: SlotWriter, batch: list[torch.Tensor], *, collate_fn_map: dict[Any, Callable[..., Any]] | None = None
) -> torch.Tensor:
    """``collate_tensor_fn`` that stacks into slot memory instead of a new segment."""
    elem = batch[0]
    if elem.is_nested or elem.layout is not _STRIDED or not elem.is_cpu:
        return _torch_collate_tensor(batch, collate_fn_map)
    try:
        dtype = _native.same_attr(batch, "dtype")  # one dtype (the common case), or None: promote as default_collate
    except AttributeError:
        return _torch_collate_tensor(batch, collate_fn_map)  # (a number among tensors: torch's workers' own error)
    if dtype is None:
        try:
            dtype = functools.reduce(torch.promote_types, map(_dtype_of, batch))
        except (TypeError, AttributeError):
            return _torch_collate_tensor(batch, collate_fn_map)  # not all tensors: torch's own error
    if dtype not in CODE_OF_DTYPE:
        return torch.stack(batch, 0)  # (quantized: as default_collate stacks them in the main process)
    shape = elem.shape
    out = writer.tensor(dtype, (len(batch), *shape))
    if _stack_into is not None and _stack_into(batch, out):  # plain samples: one memcpy each
        stacked = out
    else:
        try:
            stacked = torch.stack(batch, 0, out=out)
        except RuntimeError:
            return torch.stack(batch, 0)  # unequal shapes: torch's own error, as default_collate raises
    if stacked is out:  # (a tensor subclass's __torch_function__ may return another object)
        writer.stacked.append(Column(len(batch), shape, dtype, out))
    return stacked


def _torch_collate_tensor(batch: list[Any], collate_fn_map: dict[Any, Callable[..., Any]] | None) -> torch.Tensor:
    """torch's own ``collate_tensor_fn`` (as its workers run it), for samples that are not all
    tensors, or nested or sparse ones: what torch's workers refuse fails with their exception
    (an ndarray among tensors: AttributeError), what they accept is collated as they collate it."""
    result: torch.Tensor = torch_collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    return result


def slot_collate_map(writer: SlotWriter) -> dict[Any, Callable[..., Any]]:
    """torch's ``default_collate_fn_map`` (user additions included) with the tensor
    entry replaced by a stack into ``writer``'s slot, and the int and float entries by their
    tensor written into it."""
    fn_map = dict(torch_collate.default_collate_fn_map)
    if fn_map.get(torch.Tensor) is torch_collate.collate_tensor_fn:
        fn_map[torch.Tensor] = functools.partial(_stack_into_slot, writer)
    for kind, numbers in ((int, torch_collate.collate_int_fn), (float, torch_collate.collate_float_fn)):
        if fn_map.get(kind) is numbers:
            fn_map[kind] = functools.partial(numbers_into_slot, writer, numbers)
    return fn_map
