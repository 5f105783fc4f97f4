"""``shmloader.share(obj)``: a dataset's index in shared memory once, not once per worker.

A list (or tuple, or dict) of millions of Python objects is copied page by page into every
worker as the workers touch reference counts ("copy-on-read"). ``share`` stores each element
serialized in one anonymous, sealed memory file (``memfd``) and returns a read-only container
with the same read interface; reading an element builds a fresh copy of it (arrays and
tensors inside it are views of the shared bytes), so a worker's reads never write to the
shared pages and its memory stays flat whatever it reads.

An element made only of exact None, bool, int, float, str, bytes, list, tuple and dict (an
index entry: a path, a label, a size) is stored with ``marshal``, which reads back exactly
those types, and ``SharedList[i]`` builds it in C (``_native.Items``) without a Python frame.
Anything else (arrays, tensors, subclasses, a container held twice) is a pickle.

Layout of the file (little-endian)::

    header   magic u64 | kind u64 (list, tuple, dict) | n u64 | blob offset u64 | data offset u64 | total u64
    offsets  u64[n + 1]: element i is blob[offsets[i]:offsets[i + 1]]
    codes    u64[n]: how element i is stored: MARSHAL (``marshal`` version 2), PICKLE (a
             protocol-5 pickle) or VIEWS (a pickle holding arrays or tensors)
    (dict)   keys u64[n + 1] (key i: blob[keys[i]:keys[i + 1]]), then hashes u64[n] sorted and
             the element index of each, u64[n]: a key is found by binary search on its hash
             (``_key_hash``: the same for equal keys in every process, whatever its hash seed)
    blob     the pickles
    data     the bytes of every array and tensor, 64-byte aligned (pickled as persistent ids)

Nothing has a name: no ``/dev/shm`` entry exists at any moment, whoever dies when. The file
is sealed once written (nobody can change it); every process maps it copy-on-write, so a
write to an array view changes only that process's copy. It pickles as a handle (the file
descriptor, passed as multiprocessing passes descriptors), not as data: torch's DataLoader
and shmloader's send it to spawn and forkserver workers that way, and fork workers inherit
the mapping.
"""

from __future__ import annotations

import array
import collections.abc
import decimal
import fcntl
import fractions
import hashlib
import io
import marshal
import mmap
import operator
import os
import pickle
import sys
from multiprocessing import reduction
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from shmloader import _native

MAGIC = 0x53484D53_48415245  # "SHMSHARE"
KINDS: dict[type, int] = {list: 0, tuple: 1, dict: 2}
MARSHAL, PICKLE, VIEWS = 0, 1, 2  # element codes (MARSHAL is read in C: native/_share.c)
_MARSHAL_VERSION = 2  # binary floats; no references (plain_value refuses a container held twice)
_HEADER = 6 * 8
_ALIGN = 64
# Once written: no more seals, no size change, no write (through any descriptor or mapping).
_SEALS = (getattr(fcntl, "F_SEAL_SEAL", 1) | getattr(fcntl, "F_SEAL_SHRINK", 2) | getattr(fcntl, "F_SEAL_GROW", 4)
          | getattr(fcntl, "F_SEAL_WRITE", 8))


def share(obj: Any) -> Any:
    """A read-only, shared-memory copy of ``obj``: ``SharedList`` for a list or tuple (a tuple
    stays a tuple) or an iterator (its entries are stored as they come, so the whole list
    never exists as Python objects), ``SharedDict`` for a dict; the values picklable. A numpy
    array or CPU tensor is shared as it is and comes back as a view. Elements come back as
    fresh copies, their arrays and tensors as views of the shared bytes (copy-on-write)."""
    if isinstance(obj, (np.ndarray, torch.Tensor)):
        return share([obj])[0]
    kind = KINDS.get(type(obj))
    if kind is None:
        if isinstance(obj, collections.abc.Mapping):
            kind = KINDS[dict]
        elif isinstance(obj, (list, tuple)):
            kind = KINDS[tuple if isinstance(obj, tuple) else list]
        elif isinstance(obj, collections.abc.Iterator):
            kind = KINDS[list]  # a generator: the entries are stored as they come, never all held
        else:
            raise TypeError(f"share() takes a list, tuple, dict, iterator, numpy array or CPU tensor, "
                            f"not {type(obj).__name__}")
    keys: list[Any] = []
    values: Iterable[Any] = obj
    if kind == KINDS[dict]:
        keys = list(obj.keys())
        values = (obj[k] for k in keys)
    fd, size = _write(kind, keys, values)
    return _open(fd, size)


# --------------------------------------------------------------------- writing
class _Leaves:
    """Arrays and tensors of the elements, laid out for the data area."""

    def __init__(self) -> None:
        self.chunks: list[tuple[int, np.ndarray[Any, Any]]] = []  # (offset in data area, bytes)
        self.size = 0

    def add(self, array: np.ndarray[Any, Any]) -> int:
        off = -(-self.size // _ALIGN) * _ALIGN
        raw = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        self.chunks.append((off, raw))
        self.size = off + raw.nbytes
        return off


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, leaves: _Leaves) -> None:
        super().__init__(file, protocol=5)
        self._leaves = leaves

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is np.ndarray and obj.dtype.hasobject is False and not obj.dtype.fields:
            off = self._leaves.add(obj)
            return ("a", off, obj.dtype.str, obj.shape)
        if type(obj) is torch.Tensor and obj.layout is torch.strided and obj.device.type == "cpu":
            if obj.requires_grad:
                raise TypeError("share(): a tensor that requires grad cannot be shared (detach() it first)")
            t = obj.detach().contiguous()
            off = self._leaves.add(t.view(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8))
            return ("t", off, str(obj.dtype).removeprefix("torch."), tuple(obj.shape))
        return None


def _serialized(values: Iterable[Any], leaves: _Leaves) -> tuple[bytes, array.array[int], array.array[int]]:
    """The elements one after the other, each marshalled or pickled; their offsets; their
    codes. (Arrays of machine ints, not lists: millions of int objects freed here would be
    reused by forked workers, page by page.)"""
    buf = io.BytesIO()
    offsets = array.array("Q", [0])
    codes = array.array("Q")
    pickler = _Pickler(buf, leaves)
    for value in values:
        if _native.plain_value(value):
            buf.write(marshal.dumps(value, _MARSHAL_VERSION))
            codes.append(MARSHAL)
        else:
            before = len(leaves.chunks)
            pickler.dump(value)
            pickler.clear_memo()  # every element unpickles on its own
            codes.append(VIEWS if len(leaves.chunks) > before else PICKLE)
        offsets.append(buf.tell())
    return buf.getvalue(), offsets, codes


_NUMBERS = (int, float, complex, fractions.Fraction, decimal.Decimal)


def _key_hash(key: Any) -> int:
    """A 64-bit hash of a dict key that equal keys share in every process, whatever their
    ``PYTHONHASHSEED``: str and bytes hash (so tuples and frozensets of them) is salted per
    process, which a spawn or forkserver worker does not share. Numbers use Python's own hash
    (not salted, and equal for 1, 1.0 and True, as dict needs); tuples combine their items'
    in order, frozensets in sorted order; any other key hashes its pickle."""
    if isinstance(key, _NUMBERS):
        return hash(key) & _MASK
    if isinstance(key, str):
        data = b"s" + key.encode("utf-8", "surrogatepass")
    elif isinstance(key, bytes):
        data = b"b" + key
    elif key is None:
        data = b"n"
    elif isinstance(key, tuple):
        data = b"t" + np.asarray([_key_hash(k) for k in key], dtype="<u8").tobytes()
    elif isinstance(key, frozenset):
        data = b"f" + np.asarray(sorted(_key_hash(k) for k in key), dtype="<u8").tobytes()
    else:
        data = b"p" + pickle.dumps(key, protocol=5)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


_MASK = (1 << 64) - 1


def _write(kind: int, keys: list[Any], values: Iterable[Any]) -> tuple[int, int]:
    leaves = _Leaves()
    value_blob, value_offsets, codes = _serialized(values, leaves)
    n = len(codes)
    parts = [np.frombuffer(value_offsets, dtype=np.uint64).astype("<u8"),
             np.frombuffer(codes, dtype=np.uint64).astype("<u8")]
    blob = value_blob
    if kind == KINDS[dict]:
        key_pickles = [pickle.dumps(k, protocol=5) for k in keys]
        key_offsets = [len(blob)]
        for kp in key_pickles:
            key_offsets.append(key_offsets[-1] + len(kp))
        blob = blob + b"".join(key_pickles)
        hashes = np.asarray([_key_hash(k) for k in keys], dtype="<u8")
        order = np.argsort(hashes, kind="stable").astype("<u8")
        parts += [np.asarray(key_offsets, dtype="<u8"), hashes[order], order]
    tables = b"".join(p.tobytes() for p in parts)
    blob_off = _HEADER + len(tables)
    data_off = -(-(blob_off + len(blob)) // _ALIGN) * _ALIGN
    total = max(data_off + leaves.size, 1)
    header = np.asarray([MAGIC, kind, n, blob_off, data_off, total], dtype="<u8").tobytes()
    fd = os.memfd_create("shmloader-share", os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 2))
    try:
        os.ftruncate(fd, total)
        with mmap.mmap(fd, total) as mm:
            mm[:_HEADER] = header
            mm[_HEADER:blob_off] = tables
            mm[blob_off : blob_off + len(blob)] = blob
            target = np.frombuffer(mm, dtype=np.uint8)
            for off, raw in leaves.chunks:
                target[data_off + off : data_off + off + raw.nbytes] = raw
            del target
        fcntl.fcntl(fd, getattr(fcntl, "F_ADD_SEALS", 1033), _SEALS)  # nobody may change it from here on
    except BaseException:
        os.close(fd)
        raise
    return fd, total


# --------------------------------------------------------------------- reading
def _open(fd: int, size: int) -> Any:
    store, kind = _Store.attach(fd, size)
    if kind == KINDS[dict]:
        return SharedDict(store)
    return SharedList(store, tuple_=kind == KINDS[tuple])


class _Store:
    """The mapped file, its tables, and element decoding (shared by the containers). It
    pickles as its file descriptor."""

    def __init__(self, fd: int, mm: mmap.mmap, n: int, blob_off: int, data_off: int) -> None:
        self.fd, self.mm, self.n, self.blob_off, self.data_off = fd, mm, n, blob_off, data_off
        # Tables are read in place through memoryviews: an index makes a fresh int. (A list of
        # ints here would be millions of objects whose reference counts every read writes:
        # the very copy-on-read this module exists to end.)
        self.offsets = _u64s(mm, _HEADER, n + 1)
        self.codes = _u64s(mm, _HEADER + (n + 1) * 8, n)
        self.tables_end = _HEADER + (2 * n + 1) * 8
        self.bytes = np.frombuffer(mm, dtype=np.uint8)
        self.blob = memoryview(mm)[blob_off:data_off]  # pickle.loads reads it without a copy
        self.size = len(mm)

    @classmethod
    def attach(cls, fd: int, size: int) -> tuple[_Store, int]:
        """Map ``fd`` (owned from here on) copy-on-write: a write stays this process's."""
        try:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE)
            head = np.frombuffer(mm, dtype="<u8", count=6)
            if int(head[0]) != MAGIC or int(head[5]) != size:
                raise ValueError("not a shmloader.share() file (or a truncated one)")
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, mm, int(head[2]), int(head[3]), int(head[4])), int(head[1])

    def element(self, i: int) -> Any:
        offsets = self.offsets
        data = self.blob[int(offsets[i]) : int(offsets[i + 1])]
        code = self.codes[i]
        if code == MARSHAL:
            return marshal.loads(data)
        if code == PICKLE:
            return pickle.loads(data)  # the C unpickler, nothing to map
        return _Unpickler(bytes(data), self).load()

    def view(self, pid: tuple[Any, ...]) -> Any:
        kind, off, dtype, shape = pid
        dt = np.dtype(dtype) if kind == "a" else getattr(torch, dtype)
        count = 1
        for d in shape:
            count *= d
        start = self.data_off + off
        nbytes = count * dt.itemsize
        if not (0 <= start and start + nbytes <= self.size):
            raise ValueError(f"share(): a view [{start}, +{nbytes}) lies outside the file")
        raw = self.bytes[start : start + nbytes]
        if kind == "a":
            out = raw.view(dt).reshape(shape)
            out.flags.writeable = False  # numpy can refuse writes; torch cannot (see the README)
            return out
        if count == 0:
            return torch.empty(shape, dtype=dt)
        return torch.from_numpy(raw).view(dt).view(shape)

    def __reduce__(self) -> Any:
        # The descriptor, as multiprocessing passes them (to a process it starts, or through
        # its resource sharer): never the data.
        return (_attach, (reduction.DupFd(self.fd), self.size))

    def __del__(self) -> None:
        fd = getattr(self, "fd", -1)
        if fd >= 0:
            self.fd = -1
            os.close(fd)


def _u64s(mm: mmap.mmap, offset: int, count: int) -> Any:
    """``count`` little-endian u64 at ``offset``, indexable as ints without copying them."""
    if sys.byteorder == "little":
        return memoryview(mm)[offset : offset + 8 * count].cast("Q")
    return np.frombuffer(mm, dtype="<u8", count=count, offset=offset)  # (slower: numpy scalars)


def _attach(dup: Any, size: int) -> _Store:
    return _Store.attach(dup.detach(), size)[0]


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, store: _Store) -> None:
        super().__init__(io.BytesIO(data))
        self._store = store

    def persistent_load(self, pid: Any) -> Any:
        return self._store.view(pid)


class SharedList(_native.Items, collections.abc.Sequence):  # type: ignore[type-arg]
    """A read-only list (or tuple) in shared memory: ``len``, indexing (negative too), slicing
    (a list of copies), iteration, ``in``, ``index``, ``count``. Each read returns a fresh
    copy of the element; its arrays and tensors are views of the shared bytes.

    ``shared[i]`` of a marshalled element is answered by ``_native.Items`` in C; the rest
    (slices, pickled elements, bad indices) by ``_item``."""

    __slots__ = ("_store", "_tuple")

    def __init__(self, store: _Store, tuple_: bool = False) -> None:
        self._store = store
        self._tuple = tuple_
        blob = store.blob_off
        super().__init__(store.mm, store.n, _HEADER, _HEADER + (store.n + 1) * 8, blob, store.data_off - blob)

    def _item(self, i: Any) -> Any:
        store = self._store
        if isinstance(i, slice):
            items = [store.element(j) for j in range(*i.indices(store.n))]
            return tuple(items) if self._tuple else items
        i = operator.index(i)
        if i < 0:
            i += store.n
        if not 0 <= i < store.n:
            raise IndexError(f"shared {'tuple' if self._tuple else 'list'} index out of range")
        return store.element(i)

    def __iter__(self) -> Iterator[Any]:
        element = self._store.element
        for i in range(self._store.n):
            yield element(i)

    def __reduce__(self) -> Any:
        return (SharedList, (self._store, self._tuple))

    def __repr__(self) -> str:
        return f"<shmloader shared {'tuple' if self._tuple else 'list'} of {len(self):,} elements>"


class SharedDict(collections.abc.Mapping):  # type: ignore[type-arg]
    """A read-only dict in shared memory: ``len``, ``d[key]``, ``get``, ``in``, iteration and
    ``keys()`` / ``values()`` / ``items()`` in insertion order. Keys are found by a binary
    search on their hash in the shared file (no per-process index is built)."""

    __slots__ = ("_store", "_keys", "_hashes", "_order")

    def __init__(self, store: _Store) -> None:
        self._store = store
        n = store.n
        base = store.tables_end
        self._keys = _u64s(store.mm, base, n + 1)
        self._hashes = np.frombuffer(store.mm, dtype="<u8", count=n, offset=base + (n + 1) * 8)
        self._order = np.frombuffer(store.mm, dtype="<u8", count=n, offset=base + (2 * n + 1) * 8)

    def _key_bytes(self, j: int) -> bytes:
        s = self._store
        return s.mm[s.blob_off + int(self._keys[j]) : s.blob_off + int(self._keys[j + 1])]

    def _index(self, key: Any) -> int:
        hash(key)  # an unhashable key: TypeError, as from a dict
        try:
            h = _key_hash(key)
        except Exception:  # (a key that does not pickle is none of ours)
            raise KeyError(key) from None
        pos = int(np.searchsorted(self._hashes, np.uint64(h)))
        while pos < self._store.n and int(self._hashes[pos]) == h:
            j = int(self._order[pos])
            if pickle.loads(self._key_bytes(j)) == key:
                return j
            pos += 1
        raise KeyError(key)

    def __getitem__(self, key: Any) -> Any:
        return self._store.element(self._index(key))

    def __contains__(self, key: object) -> bool:
        try:
            self._index(key)
        except KeyError:
            return False
        return True

    def __len__(self) -> int:
        return self._store.n

    def __iter__(self) -> Iterator[Any]:
        for j in range(self._store.n):
            yield pickle.loads(self._key_bytes(j))

    def items(self) -> Any:
        return [(pickle.loads(self._key_bytes(j)), self._store.element(j)) for j in range(self._store.n)]

    def values(self) -> Any:
        return [self._store.element(j) for j in range(self._store.n)]

    def __reduce__(self) -> Any:
        return (SharedDict, (self._store,))

    def __repr__(self) -> str:
        return f"<shmloader shared dict of {len(self):,} items>"

