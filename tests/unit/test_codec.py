"""The native leaf-table codec: round trips, and rejection of every malformed table."""

from __future__ import annotations

import gc
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmloader import _native
from shmloader.wire.layout import DTYPES, LEAF_ALIGN, Kind, table_bytes
from tests.conftest import examples

ENTRY = struct.Struct("=BBBBIQQ")


def encode(leaves: list[tuple[int, int, int, tuple[int, ...]]], size: int = 4096) -> bytearray:
    buf = bytearray(size)
    n = _native.encode_table(buf, 0, size, leaves)
    return buf[:n]


def test_constants_match_python_tables() -> None:
    assert _native.N_CODES == len(DTYPES)
    assert _native.LEAF_ALIGN == LEAF_ALIGN
    assert _native.N_KINDS == len(Kind)
    # Every dtype's item size, one by one (uint16/32/64 included): the C table is the wire's.
    for code, dtype in enumerate(DTYPES):
        assert dtype is None or _native.ITEMSIZES[code] == dtype.itemsize, dtype
    assert ENTRY.size == _native.ENTRY_FIXED


@given(st.lists(st.lists(st.integers(0, 5), max_size=6).map(tuple), max_size=12))
def test_table_bytes_is_what_encode_writes(shapes: list[tuple[int, ...]]) -> None:
    leaves = [(1, 0, 64 * i, shape) for i, shape in enumerate(shapes)]
    assert _native.encode_table(bytearray(8192), 0, 8192, leaves) == table_bytes(shapes)


def test_the_functions_have_signatures_and_refuse_lists_with_type_errors() -> None:
    import inspect

    assert str(inspect.signature(_native.encode_table)) == "(buffer, offset, limit, leaves, /)"
    assert str(inspect.signature(_native.sem_wait)) == "(buffer, offset, timeout, /)"
    assert str(inspect.signature(_native.plain_value)) == "(obj, /)"
    functions = [getattr(_native, name) for name in dir(_native) if callable(getattr(_native, name))
                 and not isinstance(getattr(_native, name), type)]
    assert functions
    for function in functions:
        inspect.signature(function)  # every native function has a text signature
    with pytest.raises(TypeError, match="leaf 0 must be a tuple"):
        _native.encode_table(bytearray(256), 0, 256, [[1, 0, 0, (1,)]])
    with pytest.raises(TypeError, match=r"sem_wait\(\) takes exactly 3 arguments"):
        _native.sem_wait(bytearray(256), 0)  # type: ignore[call-arg]


def test_round_trip() -> None:
    leaves = [(9, 0, 0, (32, 16)), (1, 1, 4096, ()), (7, 0, 64, (0, 3)), (11, 0, 128, (2,))]
    table = encode(leaves)
    out = _native.decode_table(bytes(table), 0, len(table), 1 << 20)
    sizes = [32 * 16 * 8, 1, 0, 2 * 16]
    assert out == [(c, k, o, n, s) for (c, k, o, s), n in zip(leaves, sizes)]


def test_encode_refuses_too_small_area() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        _native.encode_table(bytearray(40), 0, 40, [(5, 0, 0, (1, 2, 3))])


@pytest.mark.parametrize(
    "leaf, message",
    [
        ((99, 0, 0, (1,)), "bad code"),
        ((5, 7, 0, (1,)), "bad code"),
        ((5, 0, -64, (1,)), "bad code"),
        ((5, 0, 8, (1,)), "offsets are multiples of 64"),  # decode would refuse it: encode does
        ((5, 0, 0, (-1,)), "negative or overflowing"),
        ((5, 0, 0, (1 << 40, 1 << 40)), "negative or overflowing"),
    ],
)
def test_encode_rejects_bad_leaves(leaf: tuple[int, int, int, tuple[int, ...]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        encode([leaf])


def corrupt(table: bytearray, field: int, value: int) -> bytes:
    code, kind, ndim, p0, p1, off, nbytes = ENTRY.unpack_from(table, 8)
    fields = [code, kind, ndim, p0, p1, off, nbytes]
    fields[field] = value
    ENTRY.pack_into(table, 8, *fields)
    return bytes(table)


@pytest.mark.parametrize(
    "field, value, message",
    [
        (0, 200, "unknown dtype code"),
        (1, 5, "unknown dtype code"),
        (2, 65, "unknown dtype code"),  # ndim above MAX_NDIM (64)
        (2, 2, "truncated|does not match"),
        (5, 64 * 1024, "outside the 65536-byte data region"),
        (5, 3, "outside"),
        (5, (1 << 64) - 64, "outside"),
        (6, 12345, "does not match"),
    ],
)
def test_decode_rejects_corrupt_entries(field: int, value: int, message: str) -> None:
    table = encode([(5, 0, 0, (8,))])
    with pytest.raises(ValueError, match=message):
        _native.decode_table(corrupt(table, field, value), 0, len(table), 65536)


def test_decode_rejects_bad_magic_and_counts() -> None:
    table = encode([(5, 0, 0, (8,))])
    bad = bytearray(table)
    bad[0] ^= 0xFF
    with pytest.raises(ValueError, match="magic"):
        _native.decode_table(bytes(bad), 0, len(bad), 1 << 20)
    many = bytearray(table)
    struct.pack_into("=I", many, 4, 1 << 30)
    with pytest.raises(ValueError, match="claims"):
        _native.decode_table(bytes(many), 0, len(many), 1 << 20)
    with pytest.raises(ValueError, match="outside buffer"):
        _native.decode_table(bytes(table), 8, len(table), 1 << 20)


@settings(max_examples=examples(2000), deadline=None)
@given(st.binary(min_size=0, max_size=512), st.integers(0, 1 << 20))
def test_decode_never_crashes_on_random_bytes(data: bytes, limit: int) -> None:
    payload = struct.pack("=II", 0x544C4853, len(data) // 24) + data
    try:
        leaves = _native.decode_table(payload, 0, len(payload), limit)
    except ValueError:
        return
    for code, kind, off, nbytes, shape in leaves:
        assert off % LEAF_ALIGN == 0 and off + nbytes <= limit
        assert kind in (0, 1) and 0 <= code < len(DTYPES)


def test_encode_reads_its_own_copy_whatever_python_code_runs_meanwhile() -> None:
    # A dimension whose __index__ empties (and frees) the caller's list mid-encode: the codec
    # holds a tuple copy, so this is a normal table, never a use-after-free.
    leaves: list[tuple[int, int, int, tuple[Any, ...]]] = []

    class Mutating:
        def __index__(self) -> int:
            leaves.clear()
            gc.collect()
            return 3

    leaves += [(1, 0, 0, (Mutating(), 2)), (1, 0, 64, (4,))]
    buf = bytearray(4096)
    n = _native.encode_table(buf, 0, 4096, leaves)
    assert n == table_bytes([(3, 2), (4,)])
    assert [t[4] for t in _native.decode_table(bytes(buf[:n]), 0, n, 1 << 20)] == [(3, 2), (4,)]
    with pytest.raises(TypeError, match="shape must be a tuple"):
        _native.encode_table(bytearray(256), 0, 256, [(1, 0, 0, [1])])
