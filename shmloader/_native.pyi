from typing import Any, Sequence

N_CODES: int
LEAF_ALIGN: int
MAX_NDIM: int

def encode_table(
    buffer: Any, offset: int, limit: int, leaves: Sequence[tuple[int, int, int, Sequence[int]]]
) -> int: ...
def decode_table(
    buffer: Any, offset: int, length: int, data_limit: int
) -> list[tuple[int, int, int, int, tuple[int, ...]]]: ...
