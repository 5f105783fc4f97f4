"""From a ready slot to the user's batch, and back to the ring.

``read_batch`` validates a slot's header and leaf table, then builds the batch from
views of slot memory (or copies, when the ring must keep a slot for the workers).
``Leases`` tracks which slots the user still holds: every delivered batch gets a
fresh numpy base array over its slot; every tensor and array of the batch keeps
that base alive, and once nothing else does the slot is back. ``release`` returns
one early.
"""

from __future__ import annotations

import collections
import collections.abc
import io
import pickle
import threading
import weakref
from typing import Any, Callable

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from shmloader import _native
from shmloader._errors import CorruptSlotError
from shmloader.wire.layout import (
    _NUMPY_MAX_NDIM,
    LONE_LEAF,
    NP_DTYPES,
    STORAGE,
    TYPED_STORAGE,
    VIEW,
    Field,
    Kind,
    Region,
    view_leaf,
)
from shmloader.wire.ring import Ring

_TENSOR = int(Kind.TENSOR)
_U8 = np.dtype(np.uint8)
_SLOT, _OVERFLOW, _LEAVES = int(Region.SLOT), int(Region.OVERFLOW), int(Region.LEAVES)
_REGION = Field.REGION


class Leases:
    """Slots lent to the user. Every delivered batch has a fresh numpy base array over its slot,
    which each of its tensors and arrays keeps alive; this table holds one more reference. A slot
    is back once that is the base's only reference (the scheduler's step looks, in C, no
    callback and no lock on the per-batch path: ``Scheduler.reclaim``), or once ``release``
    retired it, early, from any thread: a key leaves ``bases`` exactly once, by ``dict.pop`` or
    by the scheduler, each atomic under the GIL, so a slot comes back once and a lent-again slot
    never for a stale reason."""

    def __init__(self) -> None:
        self.bases: dict[int, np.ndarray[Any, Any]] = {}  # slot -> base; read by Scheduler.step
        self.released: collections.deque[int] = collections.deque()  # released early, not yet back
        # The memory of every batch released early that is still alive (``memory_key``), so a
        # second release of it is refused: its slot may be lent to a later batch by then.
        self._gone: dict[int, Any] = {}
        self._releasing = threading.Lock()  # (release_views only: never on the per-batch path)

    def lend(self, slot: int, base: np.ndarray[Any, Any]) -> None:
        self.bases[slot] = base

    def release(self, slot: int) -> bool:
        """Return ``slot`` now, whoever still views it. False if it was not lent."""
        if self.bases.pop(slot, None) is None:
            return False
        self.released.append(slot)
        return True

    def release_views(self, views: list[tuple[int, Any]]) -> int:
        """Return the slots that ``views`` (slot, tensor or array of a batch) view, now; how many
        were lent. Raises ValueError, returning none, when any of them was released before:
        its slot may be lent to a later batch by now, which must not be taken from its holder.
        Checked and returned under one lock, so two threads releasing one batch return it once."""
        with self._releasing:
            self._gone = {key: alive for key, alive in self._gone.items() if alive()}
            keys = [(slot, view, memory_key(view)) for slot, view in views]
            for slot, view, (key, _) in keys:
                if key in self._gone:
                    what = f"{type(view).__name__} of shape {tuple(view.shape)}"
                    raise ValueError(
                        f"release(): this batch was already released (its {what} viewed ring slot {slot}, "
                        "which may hold a later batch by now); release a batch once, and do not use it after "
                        "release()"
                    )
            count = sum(self.release(slot) for slot in {slot for slot, _ in views})
            self._gone.update(key for _, _, key in keys)
            return count

    def take_released(self) -> list[int]:
        """The slots released early since the last call (the scheduler gives them back)."""
        out = []
        released = self.released
        while released:
            out.append(released.popleft())
        return out

    def viewed_count(self) -> int:
        """How many slots the user views right now (``viewed()``, counted)."""
        return len(self.bases) - len(_native.unviewed(self.bases, False))

    def viewed(self) -> set[int]:
        """The lent slots the user views right now (a batch, or a view of one, is alive)."""
        return set(self.bases) - set(_native.unviewed(self.bases, False))


def memory_key(view: Any) -> tuple[int, Callable[[], bool]]:
    """What identifies the memory a batch's tensor or array views for as long as the batch
    lives, and whether it still lives. A tensor: its storage (each delivered batch has storages
    of its own; a weak reference keeps the key unique while it is held). An array: the array
    at the root of its bases (the batch's own, over the slot)."""
    if isinstance(view, torch.Tensor):
        ref = StorageWeakRef(view.untyped_storage())  # type: ignore[no-untyped-call]
        return ref.cdata, lambda: not ref.expired()  # type: ignore[no-untyped-call]
    root = view
    while isinstance(root.base, np.ndarray):
        root = root.base
    alive = weakref.ref(root)
    return id(root), lambda: alive() is not None


class _LeafUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, leaves: list[Any]) -> None:
        super().__init__(io.BytesIO(data))
        self._leaves = leaves
        self._views: dict[Any, torch.Tensor] = {}

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is int and 0 <= pid < len(self._leaves):
            return self._leaves[pid]
        if type(pid) is tuple and len(pid) == 7 and pid[0] == VIEW:
            view = self._views.get(pid[6])  # (the same tensor twice in the batch: one object)
            if view is None:
                view = self._views[pid[6]] = self._view(*pid[1:6])
            return view
        if type(pid) is tuple and len(pid) in (2, 3) and type(pid[1]) is int and 0 <= pid[1] < len(self._leaves):
            leaf = self._leaves[pid[1]]  # a storage: its bytes' leaf (uint8), handed back as a storage of it
            if type(leaf) is torch.Tensor and leaf.dtype is torch.uint8 and leaf.dim() == 1:
                if pid[0] == STORAGE and len(pid) == 2:
                    return leaf.untyped_storage()
                dtype = getattr(torch, pid[2], None) if pid[0] == TYPED_STORAGE and len(pid) == 3 else None
                if isinstance(dtype, torch.dtype):
                    return torch.TypedStorage(wrap_storage=leaf.untyped_storage(), dtype=dtype, _internal=True)  # type: ignore[no-untyped-call]
        raise CorruptSlotError(f"batch skeleton refers to leaf {pid!r} of {len(self._leaves)}")


    def _view(self, leaf_id: Any, dtype_name: Any, offset: Any, size: Any, stride: Any) -> torch.Tensor:
        """A tensor over the storage of leaf ``leaf_id`` (``worker.collate.View``), bounds checked."""
        dtype = getattr(torch, dtype_name, None) if type(dtype_name) is str else None
        leaf = self._leaves[leaf_id] if type(leaf_id) is int and 0 <= leaf_id < len(self._leaves) else None
        ok = (isinstance(dtype, torch.dtype) and type(leaf) is torch.Tensor and type(offset) is int and offset >= 0
              and type(size) is tuple and type(stride) is tuple and len(size) == len(stride)
              and all(type(n) is int and n >= 0 for n in size + stride))
        if ok:
            assert isinstance(dtype, torch.dtype) and isinstance(leaf, torch.Tensor)
            storage = leaf.untyped_storage()
            itemsize = torch.empty(0, dtype=dtype).element_size()
            last = offset + sum((n - 1) * st for n, st in zip(size, stride)) if all(size) else -1
            if (last + 1) * itemsize <= storage.nbytes():
                return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)
        raise CorruptSlotError(f"batch skeleton has a view {(leaf_id, dtype_name, offset, size, stride)!r:.200} "
                               f"outside its {len(self._leaves)} leaves")


def _span(hdr: memoryview, off_field: int, len_field: int, cap: int, what: str, slot: int) -> tuple[int, int]:
    """The (offset, length) header ``hdr`` gives ``what`` in fields ``off_field``, ``len_field``,
    checked against the ``cap`` bytes of slot ``slot``'s data. (Six parameters: the header
    fields and what the error names, kept apart so the per-batch path builds no tuple.)"""
    off, length = hdr[off_field], hdr[len_field]
    if off < 0 or length < 0 or off > cap or length > cap - off:
        raise CorruptSlotError(
            f"slot {slot}: {what} [{off}, +{length}) lies outside the slot's {cap}-byte data region"
        )
    return off, length


# Where a slot's result lies: (mapping, offset of the data region in it, its capacity).
Where = tuple[Any, int, int]


def in_slot(ring: Ring, slot: int) -> Where:
    return ring.mm, ring.data_offsets[slot], ring.geometry.data_bytes


def described_at(ring: Ring, slot: int, where: Where | None) -> Where:
    """Where the skeleton, leaf table and dataset state of ``slot``'s result lie: with its
    leaves (``where``: overflow memory, or the slot), or, with ``Region.LEAVES``, in the
    slot's own data region."""
    if where is None or ring.headers[slot][_REGION] == _LEAVES:
        return in_slot(ring, slot)
    return where


def read_pickled(ring: Ring, slot: int, where: Where | None = None) -> bytes:
    """A slot's pickled bytes: the batch's skeleton, or (status ERROR) the worker's exception."""
    return _read(ring, slot, where, Field.PICKLED_OFF, Field.PICKLED_LEN, "pickled skeleton or error")


def read_dataset_state(ring: Ring, slot: int, where: Where | None = None) -> bytes:
    """The pickled dataset state a worker stored after the batch (b"" when none)."""
    return _read(ring, slot, where, Field.DATASET_STATE_OFF, Field.DATASET_STATE_LEN, "dataset state")


def _read(ring: Ring, slot: int, where: Where | None, off_field: int, len_field: int, what: str) -> bytes:
    """The bytes of ``what`` (header fields ``off_field``, ``len_field``) of ``slot``'s result,
    read from ``where`` it lies. (Six parameters: ``_span``'s, for its two callers.)"""
    mm, data_off, cap = described_at(ring, slot, where)
    off, length = _span(ring.headers[slot], off_field, len_field, cap, what, slot)
    return mm[data_off + off : data_off + off + length]  # type: ignore[no-any-return]


LeafConverter = Callable[[Any, int], Any]


def copy_leaf(leaf: Any, kind: int) -> Any:
    """A converter that makes a leaf independent of the slot."""
    if kind != _TENSOR:
        return leaf.copy()
    if leaf.nbytes >= _COPY_OUT_FROM:
        out = copy_out(leaf)
        if out is not None:
            return out
    if leaf.dtype is torch.bool:  # its bytes as they are (clone makes 0x01 of a 0xFF true, as numpy stores it)
        out = torch.empty_like(leaf)
        out.view(torch.uint8).copy_(leaf.view(torch.uint8))
        return out
    return leaf.clone()


def read_batch(ring: Ring, slot: int, convert: LeafConverter | None = None,
               where: Where | None = None) -> tuple[Any, np.ndarray[Any, Any], int]:
    """Build the batch held by ``slot`` (in its own data region, or ``where`` its header says:
    overflow memory). Returns (batch, base, leaf bytes): each leaf is a view of that memory
    that keeps ``base`` alive, or ``convert(view, kind)`` of it when given (a copy, a device
    transfer), which then decides whether the memory is still viewed."""
    region = ring.headers[slot][_REGION]
    if where is None:
        if region != _SLOT:
            raise CorruptSlotError(f"slot {slot}: header says region {region}, expected SLOT")
        mm, data_off, cap = ring.mm, ring.data_offsets[slot], ring.geometry.data_bytes
    else:
        if region != _OVERFLOW and region != _LEAVES:
            raise CorruptSlotError(f"slot {slot}: header says region {region}, expected OVERFLOW or LEAVES")
        mm, data_off, cap = where
    described, at, room = described_at(ring, slot, where)
    try:  # the header's spans, the leaf table, and whether the batch is one leaf: one call
        table, lone = _native.read_slot(ring.mm, ring.header_offsets[slot], described, at, room, mm, data_off, cap,
                                        LONE_LEAF)
    except CorruptSlotError as exc:
        raise CorruptSlotError(f"slot {slot}: {exc}") from None
    if lone and len(table) == 1:
        code, kind, off, nbytes, shape = table[0]
        np_dtype = NP_DTYPES[code]
        if np_dtype is not None and nbytes and len(shape) <= _NUMPY_MAX_NDIM:
            # The batch is one leaf (a tensor, most often): its own fresh array is the base
            # the lease watches (what every view of the batch keeps alive).
            arr = np.ndarray(shape, np_dtype, mm, data_off + off)
            leaf = torch.from_numpy(arr) if kind == _TENSOR else arr
            return (leaf if convert is None else convert(leaf, kind)), arr, nbytes
    # A fresh array over the data region: every leaf views it (and nothing else), so it
    # lives exactly as long as the batch's last view (the lease table watches its references).
    base = np.ndarray((cap,), _U8, mm, data_off)
    leaves: list[Any] = []
    total = 0
    for code, kind, off, nbytes, shape in table:
        total += nbytes
        np_dtype = NP_DTYPES[code]
        if np_dtype is not None and nbytes and len(shape) <= _NUMPY_MAX_NDIM:
            # view_leaf's common case in one call (decode_table checked the bounds and size)
            arr = np.ndarray(shape, np_dtype, base, off)
            leaf = torch.from_numpy(arr) if kind == _TENSOR else arr
        else:
            try:
                leaf = view_leaf(base[off : off + nbytes], code, kind, shape)
            except ValueError as exc:
                raise CorruptSlotError(f"slot {slot}: {exc}") from None
        leaves.append(leaf if convert is None else convert(leaf, kind))
    if lone and len(leaves) == 1:
        return leaves[0], base, total
    skeleton = read_pickled(ring, slot, where)
    try:
        batch = _LeafUnpickler(skeleton, leaves).load()
    except (ImportError, AttributeError, CorruptSlotError):
        raise  # a class the main process cannot find (defined only in the worker?): said as is
    except Exception as exc:
        raise CorruptSlotError(f"slot {slot}: the batch's skeleton does not unpickle ({exc!r}): a torn write") from exc
    if where is None and len(RECIPES) < _MOST_RECIPES:
        learn_recipe(skeleton, batch, leaves)
    return batch, base, total


# The skeletons of batches that are a list, tuple or dict (of str keys) of their leaves in
# order, as the default collate makes them: skeleton -> (container, leaves, keys), from which
# lend_lone builds such a batch in its one native call, as it builds a batch of one tensor.
# read_batch learns one from the first batch of each skeleton it unpickles.
RECIPES: dict[bytes, tuple[int, int, tuple[str, ...] | None]] = {}
_MOST_RECIPES = 64  # (a batch whose keys vary without end is unpickled, as before)
_CONTAINERS: dict[type, int] = {list: 0, tuple: 1, dict: 2}  # (native/_native.c's R_LIST, R_TUPLE, R_DICT)


class _StandIn:
    """Leaf ``i`` of a batch, as the worker's pickler (``worker.collate._LeafPickler``) writes it."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


class _StandInPickler(pickle.Pickler):
    def persistent_id(self, obj: object) -> int | None:
        return obj.i if type(obj) is _StandIn else None


def learn_recipe(skeleton: bytes, batch: Any, leaves: list[Any]) -> None:
    """Remember ``skeleton`` when ``batch``, which it unpickled to over ``leaves``, is a list, tuple
    or dict of str keys of those leaves in order, and the skeleton is exactly what the worker's
    pickler writes for such a batch (nothing else in it): then building the container of the
    leaves (``lend_lone``) is what unpickling it does."""
    container = _CONTAINERS.get(type(batch))
    if container is None:
        return
    keys = tuple(batch) if type(batch) is dict else None
    items = list(batch.values()) if keys is not None else batch
    if (not leaves or len(items) != len(leaves) or any(a is not b for a, b in zip(items, leaves))
            or (keys is not None and not all(type(k) is str for k in keys)) or skeleton in RECIPES):
        return  # (the skeleton hashed last: a batch of other objects may have a long one, its strings)
    stand_ins = [_StandIn(i) for i in range(len(leaves))]
    shaped = dict(zip(keys, stand_ins)) if keys is not None else type(batch)(stand_ins)
    buf = io.BytesIO()
    _StandInPickler(buf, protocol=5).dump(shaped)
    if buf.getvalue() == skeleton:
        RECIPES[skeleton] = (container, len(leaves), keys)


# A tensor of this many bytes or more is copied out of its slot into a memory file of its own
# (copy_out: shared memory nobody else maps, as torch's batches are); smaller ones come from the
# allocator's heap (clone)
_COPY_OUT_FROM = 1 << 16


def copy_out(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor.clone()`` for a leaf ``read_batch`` made (a plain contiguous CPU tensor over
    slot memory) into a memory file of its own (``_native.copy_pages``: shared memory that no
    other process maps, as torch's held batches are). None for any other tensor, or when no
    memory file or mapping could be had (clone it)."""
    if (type(tensor) is not torch.Tensor or tensor.layout != torch.strided or not tensor.is_contiguous()
            or tensor.nbytes == 0 or tensor.device.type != "cpu" or tensor.requires_grad or tensor.is_conj()
            or tensor.is_neg()):
        return None
    pages = _native.copy_pages(tensor.data_ptr(), tensor.nbytes)
    if pages is None:
        return None
    shape = tuple(tensor.shape)  # (view(*ints) parses in a third of view(torch.Size)'s time)
    return torch.frombuffer(pages, dtype=tensor.dtype).view(*shape) if shape else torch.frombuffer(
        pages, dtype=tensor.dtype).view(())


def lone_args(ring: Ring, most_lent: int) -> tuple[Any, ...]:
    """What ``_native.lend_lone`` needs of ``ring``: ``read_batch``'s common cases (a batch that is
    one tensor in its slot, or a list, tuple or dict of them: ``RECIPES``) and ``Leases.lend`` in
    one call, while fewer than ``most_lent`` slots are lent (else the caller decides whether to
    copy: see ``RingScope.most_lent``)."""
    return (ring.mm, ring.header_offsets, ring.data_offsets, ring.geometry.data_bytes, LONE_LEAF, int(_REGION),
            _SLOT, _TENSOR, NP_DTYPES, _NUMPY_MAX_NDIM, np.ndarray, torch.from_numpy, most_lent, _U8, RECIPES)


def slot_of(ring: Ring, obj: Any) -> int | None:
    """The slot whose memory ``obj`` (a tensor or array) views, if any."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            return None
        ptr = obj.untyped_storage().data_ptr()
    elif isinstance(obj, np.ndarray):
        ptr = obj.__array_interface__["data"][0]
    else:
        return None
    origin = ring.bytes.__array_interface__["data"][0]
    g = ring.geometry
    rel = ptr - origin - g.control_bytes
    if rel < 0 or rel >= g.num_slots * g.slot_stride:
        return None
    return int(rel // g.slot_stride)


# What a batch may hold that views no memory of ours and has nothing inside.
_ATOMIC = (str, bytes, bytearray, int, float, complex, bool, type(None), range, slice, torch.dtype,
           torch.device, torch.Size, np.generic, np.dtype, type)


def leaves_of(batch: Any) -> list[Any]:
    """Tensors and arrays in a (nested) batch: the containers ``default_collate`` makes (and
    custom collates commonly do) are walked (mappings, sequences, namedtuples, sets, objects
    with ``__dict__`` or ``__slots__``). Raises TypeError naming what cannot be looked into,
    rather than release less than the batch."""
    found: list[Any] = []
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(batch, "batch")]
    while stack:
        obj, path = stack.pop()
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            found.append(obj)
            continue
        if isinstance(obj, _ATOMIC) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, collections.abc.Mapping):
            stack.extend((v, f"{path}[{k!r}]") for k, v in obj.items())
        elif isinstance(obj, (list, tuple, collections.abc.Set, collections.deque)):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(obj))
        elif hasattr(obj, "__dict__") or hasattr(type(obj), "__slots__"):
            fields = dict(getattr(obj, "__dict__", {}))
            for cls in type(obj).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if isinstance(name, str) and hasattr(obj, name):
                        fields[name] = getattr(obj, name)
            stack.extend((v, f"{path}.{k}") for k, v in fields.items())
        else:
            raise TypeError(
                f"release(): cannot look inside {type(obj).__module__}.{type(obj).__qualname__} at {path}, "
                "so the slots its tensors view cannot be found; pass those tensors (or a list of them) "
                "to release() instead"
            )
    return found
