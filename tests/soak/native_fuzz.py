"""Fuzz every function of ``shmloader._native`` with hostile input, in a process of its own.

Run by ``test_native_under_sanitizers`` against the extension built with AddressSanitizer and
UBSan (``python native_fuzz.py PATH_TO_SO SEED COUNT``), so a read or write outside a buffer,
a use after free or undefined behaviour aborts the process with the sanitizer's report. It
imports neither torch nor shmloader: only the module at PATH_TO_SO.

Each round checks what the functions promise, not only that they survive:
- ``decode_table`` of random bytes, and of valid tables with bytes flipped, either raises
  ValueError or returns leaves that lie inside the data region, aligned, with a byte size
  that matches their shape;
- ``encode_table`` round-trips through ``decode_table``; malformed entries (lists, negative
  or huge dimensions, unknown codes, a dimension whose ``__index__`` empties the caller's list)
  raise TypeError or ValueError, never write past ``limit``;
- ``post_task`` stores a list of exact ints that fit int64 as int64 values and reads back
  through ``take_task`` as the same list; anything else (bools, floats, tuples, ints out of
  range) it refuses with -1, an index larger than the data region with 0, queueing nothing; a
  range stands for the list of its values (refused with -1 when one does not fit int64);
- ``unviewed`` returns (and with ``remove`` drops) exactly the keys whose value only the dict
  references, and refuses anything but a dict; the ``Scheduler`` attached with odd offsets and
  driven with hostile calls over garbage headers answers or raises, and its ``check()`` holds
  after every call (its logic: ``tests/unit/test_slots.py``, ``tests/unit/test_step.py``);
- ``Items`` (the shared list's reader) refuses tables outside its buffer with ValueError; over
  random offset and code tables, ``items[i]`` returns the marshalled element, raises
  ValueError for offsets outside the blob, or hands the key to ``_item``; ``plain_value``
  agrees with a Python model on random nested values;
- ``read_slot`` over headers pointing anywhere, its leaves with the description or apart from it:
  ValueError, or leaves inside their data region and a lone flag that is right; ``lend_lone`` over the same (and a recipe's skeleton): ValueError or None with nothing lent,
  or one array lent inside the data region with its table's byte size; ``same_attr`` over getters that raise or empty the caller's list,
  and over builtin types' getters (called directly) answering as getattr does;
- the synchronisation calls (``sem_*``, ``load_acquire``, ``store_*``,
  ``post_task``, ``publish``, ``take_task``) refuse offsets outside the buffer or misaligned, with
  ValueError, and leave the bytes around their target untouched.
"""

from __future__ import annotations

import collections
import importlib.machinery
import importlib.util
import marshal
import mmap
import random
import struct
import sys
from typing import Any

SIZE = 1 << 16  # the buffer every call gets; a guard zone on each side is checked after each call
GUARD = 4096
SEMS = 4096  # the buffer's first bytes hold semaphores; other calls write only after them


def load(path: str) -> Any:
    loader = importlib.machinery.ExtensionFileLoader("_native", path)
    spec = importlib.util.spec_from_loader("_native", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


class Guarded:
    """A buffer of SIZE bytes inside a mapping whose guard zones must stay 0xA5."""

    def __init__(self) -> None:
        self.mm = mmap.mmap(-1, SIZE + 2 * GUARD)
        self.mm[:] = b"\xa5" * len(self.mm)
        self.view = memoryview(self.mm)[GUARD : GUARD + SIZE]

    def check(self, what: str) -> None:
        if self.mm[:GUARD].count(0xA5) != GUARD or self.mm[GUARD + SIZE :].count(0xA5) != GUARD:
            raise SystemExit(f"{what}: a write left the buffer")


def random_shape(rng: random.Random, ndim: int) -> tuple[int, ...]:
    return tuple(rng.choice([0, 1, 2, 3, 7, 64, rng.randrange(100)]) for _ in range(ndim))


def random_table(native: Any, rng: random.Random, size: int, offsets: int, ndim: int,
                 leaves: int) -> tuple[bytearray, int] | None:
    """A valid leaf table of 1 to ``leaves - 1`` random leaves in a buffer of ``size`` bytes,
    and its length; None when the leaves do not fit."""
    entries = [(rng.randrange(native.N_CODES), rng.randrange(native.N_KINDS), 64 * rng.randrange(offsets),
                random_shape(rng, rng.randrange(0, ndim))) for _ in range(rng.randrange(1, leaves))]
    buf = bytearray(size)
    try:
        return buf, native.encode_table(buf, 0, len(buf), entries)
    except ValueError:
        return None


def fuzz_decode(native: Any, rng: random.Random, g: Guarded) -> None:
    limit = rng.choice([0, 64, 4096, SIZE, 2**40, -1])
    if rng.random() < 0.5:  # random bytes behind a valid head (magic, count)
        n = rng.randrange(0, 512)
        raw = struct.pack("<II", 0x544C4853 if rng.random() < 0.9 else rng.randrange(2**32),
                          rng.randrange(0, 40)) + rng.randbytes(n)
    else:  # a valid table with a few bytes flipped
        encoded = random_table(native, rng, 4096, offsets=64, ndim=6, leaves=5)
        if encoded is None:
            return
        buf, n = encoded
        for _ in range(rng.randrange(1, 6)):
            buf[rng.randrange(n)] = rng.randrange(256)
        raw = bytes(buf[: n + rng.randrange(-8, 8) if n > 8 else n])
    if rng.random() < 0.5:  # inside the mapping
        off = rng.choice([SEMS, SEMS + 8, SIZE - len(raw)])
        g.view[off : off + len(raw)] = raw
        buffer: Any = g.view
        length = rng.choice([len(raw), len(raw) + 8, SIZE - off, rng.randrange(0, len(raw) + 1), -1, 2**62])
    else:  # a bytes object of its exact size: with PYTHONMALLOC=malloc, a read past it is ASan's to see
        off, buffer = 0, bytes(raw)
        length = rng.choice([len(raw), len(raw) + 8, rng.randrange(0, len(raw) + 1), -1, 2**62])
    try:
        table = native.decode_table(buffer, off, length, limit)
    except ValueError:
        g.check("decode_table")
        return
    g.check("decode_table")
    for code, kind, loff, nbytes, shape in table:
        items = 1
        for d in shape:
            assert d >= 0, shape
            items *= d
        assert 0 <= code < native.N_CODES and 0 <= kind < native.N_KINDS, (code, kind)
        assert loff % native.LEAF_ALIGN == 0 and 0 <= loff and loff + nbytes <= limit, (loff, nbytes, limit)
        assert len(shape) <= native.MAX_NDIM
        assert nbytes == items * native.ITEMSIZES[code], (nbytes, items, code)


def fuzz_read_slot(native: Any, rng: random.Random, g: Guarded) -> None:
    """A slot header (16 int64 fields) pointing anywhere, over a data region holding a table
    (valid or damaged) and a skeleton: ValueError, or leaves inside the region and a lone flag
    that says whether the skeleton is exactly ``lone``."""
    lone = b"\x80\x05\x95\x04\x00\x00\x00\x00\x00\x00\x00K\x00Q."
    header, data = SEMS, SEMS + 256
    cap = rng.choice([0, 512, 4096, SIZE - data, SIZE - data + 8, -1])
    fields = [rng.randrange(-5, 5) for _ in range(native.LAYOUT["N_HEADER_FIELDS"])]
    table_off, table_len, pickled_off, pickled_len = (native.LAYOUT[f] for f in ("F_TABLE_OFF", "F_TABLE_LEN", "F_PICKLED_OFF", "F_PICKLED_LEN"))
    buf, n = random_table(native, rng, 1024, offsets=8, ndim=4, leaves=3) or (bytearray(1024), 8)
    if rng.random() < 0.3:
        buf[rng.randrange(n)] = rng.randrange(256)
    skeleton = lone if rng.random() < 0.5 else rng.randbytes(len(lone))
    g.view[data + 1024 : data + 1024 + n] = buf[:n]
    g.view[data + 2048 : data + 2048 + len(skeleton)] = skeleton
    fields[table_off] = rng.choice([1024, 1024, -8, 2**62, SIZE])
    fields[table_len] = rng.choice([n, n, n - 1, 0, 2**62, -1])
    fields[pickled_off] = rng.choice([2048, 2048, -1, 2**62])
    fields[pickled_len] = rng.choice([len(lone), len(lone), len(lone) - 1, -1, 2**62])
    g.view[header : header + 8 * len(fields)] = struct.pack(f"<{len(fields)}q", *fields)
    hdr = rng.choice([header, header, header + 4, -8, SIZE - 64, SIZE])
    # The leaves with their description, or apart from it (Region.LEAVES), anywhere
    leaves_at, leaves_cap = rng.choice([(data, cap), (data, cap), (data + 4096, rng.choice([0, 512, SIZE - data - 4096])),
                                        (SIZE - 8, 16), (-8, 64), (data, -1)])
    try:
        table, is_lone = native.read_slot(g.view, hdr, g.view, data, cap, g.view, leaves_at, leaves_cap, lone)
    except (ValueError, OverflowError):
        g.check("read_slot")
        return
    g.check("read_slot")
    assert hdr == header and 0 <= fields[table_off] and fields[table_off] + fields[table_len] <= cap
    assert 0 <= leaves_at and 0 <= leaves_cap <= SIZE - leaves_at
    assert is_lone == (fields[pickled_len] == len(lone) and skeleton == lone and fields[pickled_off] == 2048)
    for code, kind, loff, nbytes, shape in table:
        assert 0 <= loff and loff + nbytes <= leaves_cap, (loff, nbytes, leaves_cap)


def fuzz_lend_lone(native: Any, rng: random.Random, g: Guarded) -> None:
    """``lend_lone`` over the headers, tables and skeletons of ``fuzz_read_slot``, and a recipe's
    skeleton (a list, tuple or dict of 1-3 leaves), with stand-ins for ``np.ndarray`` and
    ``torch.from_numpy``: ValueError with nothing lent; None with ``bases`` as it was; or one
    batch lent: a lone leaf whose array lies inside the slot's data region, or the recipe's
    container of leaves over an array of the whole region, each inside it, with the table's byte
    sizes and shapes that match them."""
    lone = b"\x80\x05\x95\x04\x00\x00\x00\x00\x00\x00\x00K\x00Q."
    header, data = SEMS, SEMS + 256
    cap = rng.choice([512, 4096, SIZE - data, SIZE - data, SIZE - data + 8])
    fields = [rng.randrange(-5, 5) for _ in range(native.LAYOUT["N_HEADER_FIELDS"])]
    table_off, table_len, pickled_off, pickled_len = (native.LAYOUT[f] for f in ("F_TABLE_OFF", "F_TABLE_LEN", "F_PICKLED_OFF", "F_PICKLED_LEN"))
    region = native.LAYOUT["F_REGION"]
    buf, n = random_table(native, rng, 1024, offsets=8, ndim=4, leaves=rng.choice([2, 2, 3, 4])) or (bytearray(1024), 8)
    if rng.random() < 0.2:
        buf[rng.randrange(n)] = rng.randrange(256)
    leaves = min(struct.unpack_from("<I", buf, 4)[0], 9)  # (the table's head: magic, count; a flipped byte's)
    container, count = rng.randrange(3), rng.choice([leaves, leaves, leaves, rng.randrange(1, 4)])
    keys = tuple(f"k{i}" for i in range(count)) if container == 2 else None
    recipe_skeleton = rng.randbytes(rng.randrange(1, 40))
    recipes: dict[bytes, Any] = {recipe_skeleton: (container, count, keys)}
    malformed = rng.random() < 0.05
    if malformed:
        recipes[recipe_skeleton] = rng.choice([(container,), (7, count, keys), (2, count, None), "x", (0, "n", None)])
    skeleton = rng.choice([lone, lone, recipe_skeleton, rng.randbytes(len(lone))])
    g.view[data + 1024 : data + 1024 + n] = buf[:n]
    g.view[data + 2048 : data + 2048 + len(skeleton)] = skeleton

    def mostly(valid: Any, *odd: Any) -> Any:  # each field damaged now and then, so batches get lent
        return valid if rng.random() < 0.85 else rng.choice(odd)

    fields[table_off] = mostly(1024, -8, 2**62, SIZE, 1032)
    fields[table_len] = mostly(n, n - 1, 0, -1, 2**62)
    fields[pickled_off] = mostly(2048, -1, 2**62, 2049)
    fields[pickled_len] = mostly(len(skeleton), len(skeleton) - 1, -1)
    fields[region] = mostly(0, 1, 2, -1)
    g.view[header : header + 8 * len(fields)] = struct.pack(f"<{len(fields)}q", *fields)
    hdr = mostly(header, header + 4, -8, SIZE - 64, SIZE)
    codes = len(native.ITEMSIZES)
    np_dtypes = tuple(None if rng.random() < 0.2 else f"dtype{c}" for c in range(rng.choice([codes, codes, 3])))
    made: list[tuple[Any, ...]] = []

    def ndarray(shape: Any, dtype: Any, buffer: Any, offset: int) -> bytearray:
        made.append((shape, dtype, buffer, offset))
        return bytearray(1)  # a fresh object, as the array is

    held = {7: bytearray(1)} if rng.random() < 0.3 else {}
    bases = dict(held)
    max_lent = rng.choice([1, 2, 2])
    args = (g.view, (hdr,), (data,), cap, lone, region, 0, 0, np_dtypes, rng.choice([2, 32]), ndarray,
            lambda a: ("batch", a), max_lent, "u8", recipes)
    try:
        built = native.lend_lone(0, bases, args)
    except (ValueError, OverflowError, TypeError) as e:
        g.check("lend_lone")
        assert bases == held and (malformed or not isinstance(e, TypeError)), e
        return
    g.check("lend_lone")
    if built is None:
        assert bases == held and not made
        return
    batch, nbytes = built
    assert hdr == header and fields[region] == 0 and len(held) < max_lent
    assert fields[pickled_len] == len(skeleton) and skeleton in (lone, recipe_skeleton)
    if skeleton == lone:
        tag, arr = batch
        assert tag == "batch" and bases == {**held, 0: arr} and len(made) == 1
        leaves, within = made, data
    else:
        assert made[0] == ((cap,), "u8", g.view, data) and bases.keys() == {*held, 0}
        leaves, within = made[1:], 0
        assert len(leaves) == count
        items = list(batch.values()) if container == 2 else batch
        assert type(batch) is (list, tuple, dict)[container] and len(items) == count
        assert container != 2 or tuple(batch) == keys
        assert all(tag == "batch" for tag, _ in items)
    total = 0
    for shape, dtype, buffer, offset in leaves:
        code = int(dtype[len("dtype"):])
        assert dtype == np_dtypes[code]
        assert buffer is (g.view if skeleton == lone else bases[0])
        size = native.ITEMSIZES[code]
        for d in shape:
            size *= d
        assert size > 0 and within <= offset and offset + size <= within + cap, (shape, offset, size, cap)
        total += size
    assert total == nbytes


def fuzz_same_attr(native: Any, rng: random.Random, g: Guarded) -> None:
    class Odd:
        def __init__(self, victim: list[Any]) -> None:
            self.victim = victim

        @property
        def tag(self) -> Any:
            if rng.random() < 0.2:
                self.victim.clear()  # the caller's list, emptied mid-call
            if rng.random() < 0.05:
                raise AttributeError("tag")
            return rng.choice(["a", "a", "a", "b"])

    items: list[Any] = []
    items.extend(Odd(items) for _ in range(rng.randrange(0, 6)))
    seq: Any = items if rng.random() < 0.7 else tuple(items)
    try:
        got = native.same_attr(seq, "tag")
    except AttributeError:
        return
    assert got in (None, "a", "b"), got
    # Builtin types' getters, called directly once per type run: the answer getattr gives.
    mixed = [rng.choice([1, 2, True, 1.5, 2**70]) for _ in range(rng.randrange(0, 6))]
    values = [v.real for v in mixed]
    want = values[0] if values and all(v is values[0] for v in values) else None
    assert native.same_attr(mixed, "real") is want, (mixed, want)


class Emptying:
    """A dimension whose ``__index__`` empties the list being encoded (the caller's, mid-call)."""

    def __init__(self, victim: list[Any]) -> None:
        self.victim = victim

    def __index__(self) -> int:
        self.victim.clear()
        return 3


def fuzz_encode(native: Any, rng: random.Random, g: Guarded) -> None:
    leaves: list[Any] = []
    for _ in range(rng.randrange(0, 6)):
        shape: Any = random_shape(rng, rng.choice([0, 1, 3, 32, 64, 65, 200]))
        kind = rng.random()
        if kind < 0.05:
            shape = list(shape)
        elif kind < 0.1:
            shape = (2**63, 2)
        elif kind < 0.15:
            shape = (-1,)
        elif kind < 0.2:
            shape = (Emptying(leaves), 2)
        leaves.append((rng.choice([0, 5, native.N_CODES - 1, native.N_CODES, -1]), rng.choice([0, 1, 2]),
                       rng.choice([0, 64, 63, -64, 2**62]), shape))
    if rng.random() < 0.05:
        leaves.append([0, 0, 0, (1,)])  # a list entry, not a tuple
    off, limit = rng.choice([SEMS, SEMS + 64, SIZE - 256]), rng.choice([0, 8, 100, 256, 4096, SIZE])
    limit = min(limit, SIZE - off) if rng.random() < 0.9 else limit
    g.view[off : min(SIZE, off + limit)] = b"\0" * (min(SIZE, off + limit) - off)
    if rng.random() < 0.3:  # a heap buffer of exactly `limit` bytes (PYTHONMALLOC=malloc: ASan sees past it)
        try:
            native.encode_table(bytearray(max(0, limit)), 0, limit, leaves)
        except (TypeError, ValueError, OverflowError):
            pass
        return
    try:
        n = native.encode_table(g.view, off, limit, leaves)
    except (TypeError, ValueError, OverflowError):
        g.check("encode_table")
        return
    g.check("encode_table")
    assert 0 < n <= limit, (n, limit)
    if off + n <= SIZE:
        assert bytes(g.view[off + n : min(SIZE, off + limit)]).count(0) == min(SIZE, off + limit) - off - n
    try:
        back = native.decode_table(g.view, off, n, 2**62)
    except ValueError:
        return  # a leaf it wrote with a byte size that overflows: refused on the way back, never trusted
    assert len(back) == len(leaves) or not leaves, (len(back), len(leaves))


def sem_offset(native: Any, rng: random.Random) -> int:
    """A semaphore's offset, or one the call must refuse (outside the buffer, misaligned).
    (POSIX leaves a semaphore call on bytes that are not a semaphore undefined: glibc aborts.)"""
    if rng.random() < 0.7:
        return native.SEM_STRIDE * rng.randrange(SEMS // native.SEM_STRIDE)
    return rng.choice([SIZE, SIZE - 8, SIZE + 64, -64, -1, 3, 2**62, -(2**62)])


def data_offset(rng: random.Random) -> int:
    """An offset past the semaphores, or one the call must refuse."""
    if rng.random() < 0.7:
        return rng.choice([SEMS, SIZE - 8, SIZE - 64, rng.randrange(SEMS, SIZE)])
    return rng.choice([SIZE, SIZE + 8, -8, -1, 2**62, -(2**62), rng.randrange(SIZE, 2 * SIZE)])


def fuzz_sync(native: Any, rng: random.Random, g: Guarded) -> None:
    before = bytes(g.view[:SEMS])
    calls = [
        lambda: native.sem_post(g.view, sem_offset(native, rng)),
        lambda: native.sem_wait(g.view, sem_offset(native, rng), 0.0),
        lambda: native.sem_init(g.view, rng.choice([SIZE, -64, 3, 2**62])),
        lambda: native.load_acquire(g.view, rng.choice([data_offset(rng), sem_offset(native, rng)])),
        lambda: native.store_release(g.view, data_offset(rng), rng.randrange(-(2**63), 2**63)),
        lambda: native.store_fenced(g.view, data_offset(rng), rng.randrange(-(2**63), 2**63)),
        lambda: native.post_task(g.view, data_offset(rng), 1, 2, rng.randbytes(rng.randrange(200)), True, data_offset(rng),
                                 rng.choice([0, 64, 4096, SIZE, -8]), data_offset(rng), rng.randrange(8),
                                 sem_offset(native, rng), rng.random() < 0.5),
        lambda: native.publish(g.view, data_offset(rng), rng.randrange(-2, 20), tuple(range(rng.randrange(14))),
                               data_offset(rng), 1, sem_offset(native, rng), data_offset(rng), data_offset(rng),
                               sem_offset(native, rng)),
        lambda: take_task(native, rng, g),
    ]
    try:
        rng.choice(calls)()
    except (ValueError, OverflowError, TypeError):
        pass
    g.check("sync call")
    after = bytes(g.view[:SEMS])
    if after != before:  # only a post or a wait may change a semaphore: its count
        for k in range(0, SEMS, native.SEM_STRIDE):
            a, b = after[k : k + native.SEM_STRIDE], before[k : k + native.SEM_STRIDE]
            assert a == b or a[8:] == b[8:], f"semaphore at {k} changed beyond its count"
    sem = native.SEM_STRIDE * rng.randrange(SEMS // native.SEM_STRIDE)
    while native.sem_wait(g.view, sem, 0.0):
        pass
    native.sem_post(g.view, sem)
    assert native.sem_wait(g.view, sem, 0.0) and not native.sem_wait(g.view, sem, 0.0)


def take_task(native: Any, rng: random.Random, g: Guarded) -> None:
    """A queue entry and a task header with anything in them, at offsets good or bad: the task
    read back stays inside the buffer."""
    entry, header, data = data_offset(rng), data_offset(rng), data_offset(rng)
    cap = rng.choice([0, 8, 64, 4096, SIZE, -8, rng.randrange(0, SIZE)])
    for off, value in ((entry, rng.choice([-2, -1, 0, 1, 2, 2**40])),
                       (header + 24, rng.choice([-1, 0, 7, -2, -3, -2 - 10**6, 2**62, -(2**63)]))):
        if 0 <= off <= SIZE - 8 and off % 8 == 0 and off >= SEMS:
            g.view[off : off + 8] = struct.pack("=q", value)
    sem = sem_offset(native, rng)
    native.sem_post(g.view, sem)
    task = native.take_task(g.view, sem, entry, (header, header), (data, data), cap, 0.0)
    if type(task) is tuple:
        index = task[3]
        assert index is None or len(index) <= max(cap, 0), (len(index), cap)


def fuzz_pack(native: Any, rng: random.Random, g: Guarded) -> None:
    items = [rng.choice([0, -1, 2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 10**30, True, 1.0, "1", None,
                         rng.randrange(-(2**70), 2**70)]) for _ in range(rng.randrange(0, 40))]
    index: Any = items if rng.random() < 0.9 else tuple(items)
    if rng.random() < 0.3:  # a range stands for the list of its values
        ends = [0, 5, -7, 2**63 - 3, 2**63, -(2**63), -(2**63) - 1, 10**30, rng.randrange(-(2**64), 2**64)]
        index = range(rng.choice(ends), rng.choice(ends), rng.choice([1, 2, -1, -3, 2**62, 2**64]))
        try:
            items = list(index) if len(index) <= 64 else [0] * 65  # (a longer one never fits the caps below)
        except OverflowError:  # no length: refused, to be pickled (and refused there)
            assert native.post_task(g.view, SEMS, 3, 4, index, False, SEMS + 512, 512, SEMS + 256, 1, 0, False) == -1
            return
    sem, header, entry, data = 0, SEMS, SEMS + 256, SEMS + 512
    cap = rng.choice([0, 8, 64, 256, 512])
    while native.sem_wait(g.view, sem, 0.0):
        pass
    own = rng.random() < 0.5
    posted = native.post_task(g.view, header, 3, 4, index, False, data, cap, entry, 1, sem, own)
    if type(index) is range:
        fits = len(index) == 0 or all(-(2**63) <= v < 2**63 for v in (index[0], index[-1]))
        exact = fits and len(index) <= 64
        if fits and len(index) > 64:
            assert posted == 0, (index, posted)
            assert not native.sem_wait(g.view, sem, 0.0)
            return
    else:
        exact = type(index) is list and all(type(v) is int and -(2**63) <= v < 2**63 for v in items)
    if not exact:
        assert posted == -1, (items, posted)
    elif 8 * len(items) > cap:
        assert posted == 0, (items, cap, posted)
    else:
        assert posted == 1 and bytes(g.view[data : data + 8 * len(items)]) == struct.pack(f"={len(items)}q", *items), (
            index, posted, cap)
        task = native.take_task(g.view, sem, entry, (0, header), (0, data), cap, 0.0)
        assert task == (1, 3, 4, items, own), (task, items)
        return
    assert not native.sem_wait(g.view, sem, 0.0)  # nothing was queued


def fuzz_unviewed(native: Any, rng: random.Random, g: Guarded) -> None:
    """Keys whose value only the dict holds, and (with remove) only those leave it."""
    held = []
    bases: dict[Any, Any] = {}
    for k in range(rng.randrange(0, 12)):
        value = bytearray(rng.randrange(4))
        if rng.random() < 0.5:
            held.append(value)
        bases[rng.choice([k, str(k), (k,)])] = value
        del value
    want = [k for k, v in bases.items() if not any(v is h for h in held)]
    remove = rng.random() < 0.5
    assert native.unviewed(bases, remove) == want
    assert sorted(map(repr, bases)) == sorted(repr(k) for k, v in list(bases.items()) if not remove or k not in want)
    for bad in ([], None, {1: 2}.items()):
        try:
            native.unviewed(bad, True)
        except TypeError:
            pass
        else:
            raise AssertionError(f"unviewed took {bad!r}")


def fuzz_scheduler(native: Any, rng: random.Random, g: Guarded) -> None:
    """A Scheduler attached to the buffer (offsets good and bad), then random calls with hostile
    arguments (slots and workers out of range, transitions from the wrong state, garbage
    headers published DONE, lease dicts with odd keys, samplers of odd indices): each answers
    or raises, never writes outside the buffer, and ``check()`` holds after every call: the
    table is never left in an impossible state."""
    n, w = rng.randrange(1, 9), rng.randrange(1, 4)
    table = native.Scheduler(n, w, rng.randrange(1, n + 2), in_order=rng.random() < 0.7)

    def off(good: int, size: int) -> Any:
        return rng.choice([good, good + 4, -8, SIZE - size + 8, SIZE, 2**62]) if rng.random() < 0.02 else good

    headers = tuple(off(SEMS + 64 * 8 * s, 128) for s in range(n))
    datas = tuple(off(SEMS + 8192 + 1024 * s, 1024) for s in range(n))
    queues = tuple(off(SEMS + 16384 + 128 * q, 128) for q in range(w))
    sems = tuple(off(native.SEM_STRIDE * rng.randrange(SEMS // native.SEM_STRIDE), 32) for _ in range(w))
    try:
        table.attach(g.view, headers, datas, rng.choice([1024] * 9 + [-8, 2**40]), queues,
                     rng.choice([9] * 9 + [0, -1]), sems, off(0, 32))
    except (ValueError, TypeError, OverflowError):
        pass
    g.check("attach")
    for off_ in headers:
        if SEMS <= off_ <= SIZE - 128 and off_ % 8 == 0:
            g.view[off_ : off_ + 128] = rng.randbytes(128) if rng.random() < 0.3 else bytes(128)
    bases: dict[Any, Any] = {}
    sampler = iter([rng.choice([[1, 2, 3], range(0, 300, 7), [1.5], list(range(200)), (1,), "abc", [2**63]])
                    for _ in range(rng.randrange(0, 20))])

    def slot() -> Any:
        return rng.choice([*range(n), *range(n), -1, n, 2**70, "s"])

    def worker() -> Any:
        return rng.choice([*range(w), *range(w), -1, w])

    def publish() -> None:
        s = rng.randrange(n)
        h = SEMS + 64 * 8 * s
        struct.pack_into("q", g.view, h, 1)  # DONE, whatever the fields say
        native.sem_post(g.view, 0)

    calls = [
        lambda: table.dispatch(worker(), rng.randrange(-2, 30), [1]),
        lambda: table.redispatch(slot(), worker(), rng.randrange(30), [2]),
        lambda: table.done(slot()),
        lambda: table.overflowed(slot(), rng.randrange(-1, 10**6)),
        lambda: table.drop(slot()),
        lambda: table.granted(slot()),
        lambda: table.take(rng.randrange(-1, 30)),
        lambda: table.give_back(slot()),
        lambda: table.orphans(worker()),
        lambda: table.new_epoch(),
        lambda: table.resize(rng.choice([1, n, n + 3, 0, -1])),
        lambda: table.next_task(sampler),
        lambda: table.step(bases, sampler, rng.random() < 0.8, rng.random() < 0.8),
        lambda: table.reclaim(rng.choice([bases, {slot(): object()}, {"x": object()}, []])),
        lambda: table.end_shard(rng.choice([0, w - 1, w, -1])),
        lambda: table.push(worker(), rng.choice([slot(), -1, -2])),
        lambda: table.post_index(slot(), rng.choice([[1, 2], b"xy", (1,), range(3)]), rng.random() < 0.3),
        lambda: table.renew_queue(worker()),
        lambda: table.set_idle(slot()),
        lambda: table.start_round_robin_at(worker()),
        lambda: table.bank_token(),
        lambda: table.awaited(),
        lambda: table.wanted(slot()),
        publish,
    ]
    for _ in range(rng.randrange(1, 40)):
        try:
            got = rng.choice(calls)()
            if type(got) is int and got >= 0 and rng.random() < 0.5:
                bases[got] = object()  # lent: held by nobody else, so the next step takes it back
        except (TypeError, ValueError, IndexError, KeyError, AssertionError, OverflowError, RuntimeError):
            pass
        g.check("Scheduler")
        table.check()
        table.take_unposted()
    for k in range(0, SEMS, native.SEM_STRIDE):
        while native.sem_wait(g.view, k, 0.0):
            pass


def plain_model(v: Any, depth: int = 0, seen: list[Any] | None = None) -> bool:
    """What ``plain_value`` promises, in Python (same depth and container limits, 64 each)."""
    seen = [] if seen is None else seen
    if v is None or type(v) in (bool, int, float, str, bytes):
        return True
    if type(v) not in (list, tuple, dict) or depth >= 64 or any(s is v for s in seen) or len(seen) == 64:
        return False
    seen.append(v)
    parts = [p for kv in v.items() for p in kv] if type(v) is dict else list(v)
    return all(plain_model(p, depth + 1, seen) for p in parts)


def random_value(rng: random.Random, depth: int = 0, pool: list[Any] | None = None) -> Any:
    pool = [] if pool is None else pool
    r = rng.random()
    if depth > 3 or r < 0.4:
        return rng.choice([None, True, 0, -(2**70), 1.5, float("nan"), "", "\udc80 x", b"\x00", bytearray(b"a"),
                           collections.OrderedDict(), frozenset(), 1j])
    if pool and r < 0.5:
        return rng.choice(pool)  # a container met twice
    if r < 0.55:
        deep: list[Any] = []
        for _ in range(rng.choice([62, 63, 64, 65])):
            deep = [deep]
        return deep
    items = [random_value(rng, depth + 1, pool) for _ in range(rng.randrange(4))]
    out: Any = rng.choice([list, tuple, lambda xs: {i: x for i, x in enumerate(xs)}])(items)
    pool.append(out)
    return out


def fuzz_items(native: Any, rng: random.Random, g: Guarded) -> None:
    value = random_value(rng)
    assert native.plain_value(value) == plain_model(value), value

    class Reader(native.Items):  # type: ignore[misc, name-defined]
        def _item(self, key: Any) -> Any:
            return ("slow", key)

    values = [rng.choice([0, -1, "x", [1, (2, 3)], {"a": b"b"}, 2.5]) for _ in range(rng.randrange(1, 9))]
    blobs = [marshal.dumps(v, 2) for v in values]
    bounds = [0]
    for b in blobs:
        bounds.append(bounds[-1] + len(b))
    n = len(values)
    offsets_at, codes_at = SEMS, SEMS + 8 * (n + 1)
    blob_at = codes_at + 8 * n
    offsets = [rng.choice([x, x, x, 2**64 - 1, bounds[-1] + 1]) for x in bounds]
    codes = [rng.choice([0, 0, 1, 2**63]) for _ in range(n)]
    g.view[offsets_at:blob_at] = struct.pack(f"<{2 * n + 1}Q", *offsets, *codes)
    g.view[blob_at : blob_at + bounds[-1]] = b"".join(blobs)
    tables = [g.view, n, offsets_at, codes_at, blob_at, bounds[-1]]
    moved = rng.random() < 0.3
    if moved:  # a table out of place (one that still lies inside the buffer reads wrong bytes: no check of what)
        k = rng.randrange(1, 6)
        tables[k] = rng.choice([-8, 1, SIZE, SIZE - 8, 2**62, tables[k] + 4])
    try:
        reader = Reader(*tables)
    except (ValueError, OverflowError):
        g.check("Items()")
        return
    for _ in range(8):
        key = rng.choice([rng.randrange(-n - 2, n + 2), 2**70, -(2**70), True, "k", slice(0, 2)])
        try:
            got = reader[key]
        except (ValueError, EOFError) as e:
            assert moved or "lies outside" in str(e), e
            continue
        if moved:
            continue
        i = key + n if type(key) is int and key < 0 else key
        if type(key) is int and 0 <= i < n and codes[i] == 0:
            assert offsets[i] == bounds[i] and offsets[i + 1] == bounds[i + 1] and got == values[i], (key, got)
        else:
            assert got == ("slow", key), (key, got)
    g.check("Items[]")


def main() -> None:
    path, seed, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    native = load(path)
    rng = random.Random(seed)
    g = Guarded()
    for k in range(0, SEMS, native.SEM_STRIDE):
        native.sem_init(g.view, k)
    kinds = [fuzz_decode, fuzz_encode, fuzz_sync, fuzz_pack, fuzz_items, fuzz_read_slot, fuzz_lend_lone, fuzz_same_attr,
             fuzz_unviewed, fuzz_scheduler]
    for i in range(count):
        rng.choice(kinds)(native, rng, g)
    with open("/proc/self/maps") as maps:
        sanitized = "libasan" in maps.read()
    print(f"native fuzz: {count} inputs, seed {seed}: no finding (AddressSanitizer {'loaded' if sanitized else 'absent'})")


if __name__ == "__main__":
    main()
