"""The ring's memory layout, described once for the writer (worker) and the reader (main).

Segment::

    [control page(s)]  semaphores (ready, then one task semaphore per worker; process-shared,
                       SEM_STRIDE bytes each), the doorbell word, the wake semaphore and the
                       awaited word (SEM_STRIDE bytes each), per-worker task queues, per-worker
                       counters (int64), page aligned
    [slot 0]           header page | data region
    [slot 1]           ...

A slot's header page is an int64 array whose fields are named below. The main
process writes the task fields, the worker writes the result fields and sets
``STATE`` to ``DONE`` last, then posts the ready semaphore (and the wake semaphore, when
the awaited word names that result). The task payload
(pickled indices) sits at the start of the data region; the worker reads it
before it writes the batch over it. The batch's leaves come first in the data
region, 64-byte aligned; then, 8-byte aligned each, the pickled skeleton (or a pickled
exception), the leaf table (see ``native/_native.c``) and an IterableDataset's pickled
state (``SlotWriter.finish`` writes them in this order).

This module owns no memory and starts no process.
"""

from __future__ import annotations

import dataclasses
import enum
import mmap
from typing import Any, Final, Iterable

import numpy as np
import torch

from shmloader import _native

PAGE: Final = mmap.PAGESIZE
SEM_STRIDE: Final = _native.SEM_STRIDE  # bytes a process-shared semaphore takes (native/_sync.c)
HEADER_BYTES: Final = PAGE
LEAF_ALIGN: Final = 64


class Field:
    """Fields of a slot header (int64 each); plain ints, read on every batch.

    Publication: a worker writes the batch and every result field, then stores STATE=DONE
    with release ordering and posts the ready semaphore, and the wake semaphore when a
    sleeping consumer waits for it (one call, ``_native.publish``); the consumer reads STATE
    with acquire ordering (``Scheduler.step``, ``Scheduler.wanted``) before it reads any
    other field or byte of the slot. So a DONE slot is complete on ARM as on x86.
    (``_native.store_release`` and ``load_acquire`` are the same orderings for one word: the
    consumer resets a granted slot's STATE with the first; ``tests/unit/test_sync.py`` checks
    both across processes.)
    """

    STATE = 0  # IDLE while the task is pending, DONE once the result is complete (release/acquire)
    # (written in the main process by the scheduler alone: its posts and set_idle; in a worker by publish)
    EPOCH = 1  # task: epoch the task belongs to
    SEQ = 2  # task: sequence number within the epoch
    TASK_LEN = 3  # task: bytes of the pickled index at the start of the data region; -1: the index came
    # over the worker's connection; -2 - n: the index is a list of n ints, as int64 at the data region's start
    STATUS = 4  # result: a Status value
    WORKER = 5  # result: id of the worker that wrote it
    TABLE_OFF = 6  # result: offset of the leaf table in the data region
    TABLE_LEN = 7
    PICKLED_OFF = 8  # result: offset of the pickled bytes: the batch's skeleton, or (ERROR) the exception
    PICKLED_LEN = 9
    NEEDED = 10  # result: bytes the batch needs (with Status.NEED_MEMORY: the overflow memory asked for)
    R_EPOCH = 11  # result: the task's epoch, echoed by the worker (checked when the slot is collected)
    R_SEQ = 12  # result: the task's seq, echoed by the worker (checked when the slot is collected)
    DATASET_STATE_OFF = 13  # result: the pickled IterableDataset state_dict() after this batch (or 0 bytes)
    DATASET_STATE_LEN = 14
    REGION = 15  # result: where the batch lies, a Region value (offsets above are relative to it;
    # with LEAVES, the leaf table's to the overflow memory, the others' to the slot's data region)
    OWN = 16  # task: 1 when the batch goes into memory of its own (the consumer holds the ring), not its slot


N_FIELDS: Final = 17
# The fields _native.read_slot and _native.take_task read, and _native.post_task writes (STATE is
# field 0) (fixed in native/): checked here, once.
def _agree(what: str, python: object, native: object) -> None:
    """The layout as Python writes it and as the extension reads it must agree (checked at
    import, also under ``python -O``): a stale build of native/ would read other fields."""
    if python != native:
        from shmloader._reinstall import reinstall_command

        raise ImportError(f"shmloader._native was built for another slot layout ({what}: {native!r} in C, "
                          f"{python!r} here); rebuild it: {reinstall_command()}")


class Counter:
    """Per-worker counters in the control area (int64 each), written by the worker only."""

    STARTED_NS = 0  # time.monotonic_ns() when the worker attached to the ring
    BUSY_NS = 1  # time spent producing batches (fetch + collate + write)
    BATCHES = 2  # results written (batches, stops and errors)


N_COUNTERS: Final = 4
IDLE: Final = 0
DONE: Final = 1
RESIZE_TASK: Final = -2  # a task-queue entry: attach to the new ring the setup connection carries
STOP_TASK: Final = -1  # a task-queue entry: exit


class Status(enum.IntEnum):
    OK = 0
    STOP = 1  # an IterableDataset shard is exhausted
    ERROR = 2  # the skeleton is a pickled ExceptionWrapper of this batch's error; the next batches go on
    NEED_MEMORY = 3  # the batch did not fit; NEEDED holds its size; the worker waits for overflow memory
    PROBED = 4  # the probe's reply: the first batch was made privately and measures NEEDED bytes
    INIT_ERROR = 5  # the skeleton is a pickled ExceptionWrapper from worker_init_fn: each of its batches fails


class Region(enum.IntEnum):
    SLOT = 0  # the slot's own data region
    OVERFLOW = 1  # the overflow memory the consumer granted for this task (see shmloader/main/overflow.py)
    PIPE = 2  # pickled over the worker's connection: memory_budget had no room while the caller held it
    LEAVES = 3  # the leaves in the overflow memory granted for this task; the rest (skeleton, leaf
    # table, dataset state) in the slot's own data region: a batch of whole pages costs just those


# native/_layout.h, the same layout for the C side: every field and code it names, checked here.
_agree("the header fields", {f"F_{name}": value for name, value in vars(Field).items() if name.isupper()}
       | {"N_HEADER_FIELDS": N_FIELDS},
       {name: value for name, value in _native.LAYOUT.items() if name.startswith(("F_", "N_HEADER"))})
_agree("STATE's values", (IDLE, DONE), (_native.LAYOUT["STATE_IDLE"], _native.LAYOUT["STATE_DONE"]))
_agree("the statuses", (Status.OK, Status.NEED_MEMORY),
       (_native.LAYOUT["STATUS_OK"], _native.LAYOUT["STATUS_NEED_MEMORY"]))
_agree("the regions", {f"REGION_{r.name}": int(r) for r in Region},
       {name: value for name, value in _native.LAYOUT.items() if name.startswith("REGION_")})

# The awaited word's values (``RingGeometry.awaited_word``); a result's seq s reads as s + 1.
AWAIT_NONE: Final = _native.LAYOUT["AWAIT_NONE"]  # the consumer does not sleep (a fresh segment's 0)
AWAIT_ANY: Final = _native.LAYOUT["AWAIT_ANY"]  # any result wakes it


class Kind(enum.IntEnum):
    TENSOR = 0
    NUMPY = 1


# Dtype codes: the order must match ITEMSIZE in native/_native.c. Codes are never reused;
# a dtype this torch lacks (an older version) keeps its code with no dtype behind it.
_DTYPE_NAMES: Final = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
    "complex64", "complex128", "uint16", "uint32", "uint64",
    # Carried through torch only (numpy has no such types), like bfloat16:
    "complex32", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
    "int1", "int2", "int3", "int4", "int5", "int6", "int7",
)
DTYPES: Final[tuple[torch.dtype | None, ...]] = tuple(getattr(torch, name, None) for name in _DTYPE_NAMES)
CODE_OF_DTYPE: Final = {dt: i for i, dt in enumerate(DTYPES) if dt is not None}
TORCH_ONLY_CODES: Final = 15  # the codes from complex32 on; before it numpy has them all but bfloat16
_NUMPY_MAX_NDIM: Final = 32  # numpy 1.x's limit (2.x: 64); a tensor with more dimensions is viewed through torch
# The C codec has its own item-size table (native/_native.c) and kind count: they must agree.
if (len(DTYPES) != len(_native.ITEMSIZES) or len(Kind) != _native.N_KINDS
        or any(dt is not None and dt.itemsize != size for dt, size in zip(DTYPES, _native.ITEMSIZES))):
    from shmloader._reinstall import reinstall_command

    raise ImportError(
        f"shmloader._native's dtype table {_native.ITEMSIZES} (kinds: {_native.N_KINDS}) does not match "
        f"wire.layout.DTYPES {tuple(dt and dt.itemsize for dt in DTYPES)} (kinds: {len(Kind)}): rebuild it: "
        f"{reinstall_command()}"
    )


def table_bytes(shapes: Iterable[tuple[int, ...]]) -> int:
    """Bytes of the leaf table for leaves of these shapes (what ``encode_table`` writes)."""
    return _native.TABLE_HEAD + sum(_native.ENTRY_FIXED + 8 * len(shape) for shape in shapes)
# numpy dtype per code, None where numpy has no such type (bfloat16).
NP_DTYPES: Final[tuple[np.dtype[np.generic] | None, ...]] = tuple(
    np.dtype(torch.empty(0, dtype=dt).numpy().dtype) if i < TORCH_ONLY_CODES and dt is not torch.bfloat16 else None
    for i, dt in enumerate(DTYPES)
)
CODE_OF_NP_DTYPE: Final = {d: i for i, d in enumerate(NP_DTYPES) if d is not None}


# The skeleton of a batch that is one leaf: pickle protocol 5 of persistent id 0.
LONE_LEAF: Final = b"\x80\x05\x95\x04\x00\x00\x00\x00\x00\x00\x00K\x00Q."
# Persistent ids of storages in a skeleton: (STORAGE, leaf) and (TYPED_STORAGE, leaf, dtype
# name); the leaf is a uint8 tensor of the storage's bytes.
STORAGE: Final = "storage"
TYPED_STORAGE: Final = "typed_storage"
# A tensor that views a storage (a slice, a transpose, one of several views of one tensor):
# (VIEW, leaf, dtype name, storage offset, size, stride, number) over the storage of that leaf's
# bytes; the number tells the batch's tensors apart.
VIEW: Final = "view"


def view_leaf(raw: np.ndarray[Any, Any], code: int, kind: int, shape: tuple[int, ...]) -> Any:
    """The leaf ``(code, kind, shape)`` as a view of ``raw`` (uint8, exactly its bytes).

    Writer and reader both build leaves here. numpy views are the cheapest to make, so
    tensors are numpy views wrapped by ``torch.from_numpy``; dtypes numpy lacks (bfloat16,
    float8, complex32, ...) and tensors of more than 32 dimensions are viewed through torch.
    Raises ValueError for a numpy leaf of such a dtype, or a code this torch has no dtype for.
    """
    np_dtype = NP_DTYPES[code]
    if np_dtype is None or (kind == Kind.TENSOR and (len(shape) > _NUMPY_MAX_NDIM or raw.size == 0)):
        dtype = DTYPES[code]
        if dtype is None:
            raise ValueError(f"dtype code {code} names a dtype this torch ({torch.__version__}) does not have")
        if kind != Kind.TENSOR:
            raise ValueError(f"numpy leaf with dtype {dtype}, which numpy lacks")
        if raw.size == 0:
            # Nothing to share, and numpy refuses shapes whose product of the other dimensions
            # overflows (torch.empty(0, 2**61)): torch makes its own empty tensor.
            return torch.empty(shape, dtype=dtype)
        return torch.from_numpy(raw).view(dtype).view(shape)
    arr = raw.view(np_dtype).reshape(shape)
    return torch.from_numpy(arr) if kind == Kind.TENSOR else arr


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclasses.dataclass(frozen=True)
class RingGeometry:
    """Where everything lives in the segment; shared by main and workers."""

    num_workers: int
    num_slots: int
    data_bytes: int  # bytes of each slot's data region (page multiple)

    @property
    def queue_len(self) -> int:
        """Entries of each worker's task queue: one per slot, plus room for a stop."""
        return self.num_slots + 1

    @property
    def sems_bytes(self) -> int:
        """The semaphores and the two words, each in SEM_STRIDE bytes of its own."""
        return (4 + self.num_workers) * SEM_STRIDE

    @property
    def doorbell_flag(self) -> int:
        """Offset of the doorbell word: nonzero while an ``async for`` consumer waits, so a
        worker that publishes writes the eventfd doorbell only then (a synchronous consumer
        waits on the wake semaphore)."""
        return (1 + self.num_workers) * SEM_STRIDE

    @property
    def wake_sem(self) -> int:
        """Offset of the wake semaphore, the one a synchronous consumer sleeps on: a worker posts
        it after publishing a result that the awaited word names (or, while a consumer sleeps,
        one that asks it for memory or comes over the pipe)."""
        return (2 + self.num_workers) * SEM_STRIDE

    @property
    def awaited_word(self) -> int:
        """Offset of the awaited word: AWAIT_NONE, AWAIT_ANY, or the seq + 1 of the one batch
        that wakes a sleeping synchronous consumer (in order, the next it takes). Batches it
        does not name post the ready semaphore alone, and wake nobody (a result that asks the
        consumer for memory or its pipe wakes it whatever the word names)."""
        return (3 + self.num_workers) * SEM_STRIDE

    @property
    def control_bytes(self) -> int:
        return round_up(self.sems_bytes + self.num_workers * (self.queue_len + N_COUNTERS) * 8, PAGE)

    @property
    def ready_sem(self) -> int:
        """Offset of the ready semaphore: a worker posts it after publishing a slot."""
        return 0

    def task_sem(self, worker: int) -> int:
        """Offset of ``worker``'s task semaphore: the consumer posts it after queueing a task."""
        return (1 + worker) * SEM_STRIDE

    @property
    def slot_stride(self) -> int:
        return HEADER_BYTES + self.data_bytes

    @property
    def total_bytes(self) -> int:
        return self.control_bytes + self.num_slots * self.slot_stride

    def slot_offset(self, slot: int) -> int:
        return self.control_bytes + slot * self.slot_stride

    def data_offset(self, slot: int) -> int:
        return self.slot_offset(slot) + HEADER_BYTES

    def queue_offset(self, worker: int) -> int:
        return self.sems_bytes + worker * self.queue_len * 8

    def counters_offset(self, worker: int) -> int:
        return self.sems_bytes + (self.num_workers * self.queue_len + worker * N_COUNTERS) * 8

    def state_offset(self, slot: int) -> int:
        """Offset of a slot's STATE field, published with release and read with acquire."""
        return self.slot_offset(slot) + Field.STATE * 8


def slot_data_bytes(batch_bytes: int) -> int:
    """Data-region size of a slot for batches of ``batch_bytes``: an exact fit, rounded up to
    a page. A larger batch later takes the overflow path and the ring grows (see
    ``grown_slot_bytes``), so no headroom is reserved up front."""
    return round_up(max(batch_bytes, 1), PAGE)


def grown_slot_bytes(batch_bytes: int) -> int:
    """Data-region size a ring grows to after a batch of ``batch_bytes`` overflowed: the batch
    plus 1/8, so a slowly rising maximum (dynamic padding) grows the ring a few times, not
    once per new maximum."""
    return round_up(batch_bytes + batch_bytes // 8, PAGE)
