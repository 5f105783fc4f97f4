"""What the native leaf-table codec buys: shmloader._native vs the same codec in pure Python.

    python bench/codec.py

Both sides encode the table in the worker and decode + bounds-check it in the main
process for every batch; the rows time one encode and one decode.
"""

from __future__ import annotations

import struct
import timeit

from shmloader import _native
from shmloader._layout import DTYPES, LEAF_ALIGN

_HEAD = struct.Struct("=II")
_ENTRY = struct.Struct("=BBBBIQQ")
_ITEMSIZE = [dt.itemsize for dt in DTYPES]


def py_encode(buf: bytearray, offset: int, leaves: list[tuple[int, int, int, tuple[int, ...]]]) -> int:
    pos = offset + 8
    for code, kind, off, shape in leaves:
        n = _ITEMSIZE[code]
        for d in shape:
            n *= d
        _ENTRY.pack_into(buf, pos, code, kind, len(shape), 0, 0, off, n)
        struct.pack_into(f"={len(shape)}q", buf, pos + 24, *shape)
        pos += 24 + 8 * len(shape)
    _HEAD.pack_into(buf, offset, 0x544C4853, len(leaves))
    return pos - offset


def py_decode(buf: bytes, offset: int, length: int, limit: int) -> list[tuple[int, int, int, int, tuple[int, ...]]]:
    magic, count = _HEAD.unpack_from(buf, offset)
    if magic != 0x544C4853 or count > (length - 8) // 24:
        raise ValueError("bad table")
    out = []
    pos = offset + 8
    end = offset + length
    for _ in range(count):
        if pos + 24 > end:
            raise ValueError("truncated")
        code, kind, ndim, _, _, off, nbytes = _ENTRY.unpack_from(buf, pos)
        if code >= len(_ITEMSIZE) or kind > 1 or ndim > 32 or pos + 24 + 8 * ndim > end:
            raise ValueError("bad entry")
        shape = struct.unpack_from(f"={ndim}q", buf, pos + 24)
        n = _ITEMSIZE[code]
        for d in shape:
            if d < 0:
                raise ValueError("bad shape")
            n *= d
        if n != nbytes or off % LEAF_ALIGN or off + nbytes > limit:
            raise ValueError("out of bounds")
        out.append((code, kind, off, nbytes, shape))
        pos += 24 + 8 * ndim
    return out


def main() -> None:
    cases = {
        "1 leaf (tiny/tokens/image)": [(8, 0, 0, (32, 16))],
        "14 leaves (nested dict)": [(i % 12, 0, 64 * i, (8, 3, 2)) for i in range(14)],
    }
    print("| table | native encode+decode µs | Python encode+decode µs | speed-up |")
    print("|---|---|---|---|")
    for name, leaves in cases.items():
        buf = bytearray(4096)
        n = _native.encode_table(buf, 0, 4096, leaves)
        assert py_encode(bytearray(4096), 0, leaves) == n
        assert py_decode(bytes(buf), 0, n, 1 << 30) == _native.decode_table(buf, 0, n, 1 << 30)
        reps = 20000
        t_native = timeit.timeit(
            lambda: (_native.encode_table(buf, 0, 4096, leaves), _native.decode_table(buf, 0, n, 1 << 30)),
            number=reps) / reps * 1e6
        t_py = timeit.timeit(
            lambda: (py_encode(buf, 0, leaves), py_decode(buf, 0, n, 1 << 30)), number=reps) / reps * 1e6
        print(f"| {name} | {t_native:.2f} | {t_py:.2f} | {t_py / t_native:.1f}x |")


if __name__ == "__main__":
    main()
