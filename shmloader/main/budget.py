"""Sizing the ring: slot count and slot size from the first batch, ``slot_bytes=`` and
``memory_budget=``. Pure arithmetic; nothing here allocates."""

from __future__ import annotations

import re

from shmloader._errors import MemoryBudgetError
from shmloader.wire.layout import PAGE, RingGeometry, round_up, slot_data_bytes

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, name: str = "memory_budget") -> int:
    """Bytes from an int or a string such as "512MiB", "2GiB", "1.5GB", "4096"."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{name} should be an int of bytes or a string like '512MiB', but got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.match(value)
        unit = m.group(2).lower() if m else ""
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"{name}={value!r} is not a size; use bytes or a number with a unit "
                "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '512MiB'"
            )
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"{name} should be positive, but got {value!r}")
    return n


def slot_size(batch_bytes: int | None, slot_bytes: int | None) -> int:
    """The data bytes of each slot of a ring planned for ``slot_bytes`` (rounded up to a page)
    or, without it, for batches of exactly ``batch_bytes``."""
    assert slot_bytes is not None or batch_bytes is not None
    return round_up(slot_bytes, PAGE) if slot_bytes is not None else slot_data_bytes(batch_bytes or 0)


def plan_ring(
    num_workers: int,
    prefetch_factor: int,
    batch_bytes: int | None,
    slot_bytes: int | None,
    memory_budget: int | None,
    in_use: int = 0,
) -> RingGeometry:
    """The ring for these settings. (Six parameters: each a figure of its own, a pure function
    the tests call with each.)

    Without a budget: ``num_workers * prefetch_factor`` slots for the batches prefetched
    (torch's meaning) and one for the batch in the caller's hands, so that holding it never
    stalls the prefetch; each of ``slot_bytes`` (rounded up
    to a page) or of exactly ``batch_bytes`` (the largest batch measured so far). With a
    budget the whole segment stays within it, and where possible leaves room beside it for
    one batch of that size to take the overflow path: fewer slots first (down to one per
    worker), then no room for overflow; if even that does not fit, MemoryBudgetError.
    ``in_use``: the loader's shared memory already mapped (other rings, overflow memory), which
    the budget holds too. Memory held from before (most often the batch a loop still holds as
    the next epoch begins: ``for epoch ...: for batch in loader``) may take a ring below one
    slot per worker, down to one slot (the workers take turns; batches are copied out of it),
    so that a budget that held the first epoch holds every epoch.
    """
    size = slot_size(batch_bytes, slot_bytes)
    wanted = num_workers * prefetch_factor + 1
    if memory_budget is None:
        return RingGeometry(num_workers, wanted, size)
    fewest = 1 if in_use else num_workers
    for room, least in ((size, num_workers), (0, num_workers), (0, fewest)):
        for slots in range(wanted, least - 1, -1):
            g = RingGeometry(num_workers, slots, size)
            if in_use + g.total_bytes + room <= memory_budget:
                return g
    smallest = RingGeometry(num_workers, num_workers, size).total_bytes
    what = f"a slot of {size:,} bytes" + (
        f" (batches measure {batch_bytes:,} bytes)" if slot_bytes is None else " (slot_bytes)"
    )
    held = ""
    if in_use:
        held = (f" beside the {in_use:,} bytes this loader already holds (batches kept from an earlier epoch, "
                "another live iterator of it, or overflow memory): drop those first, or")
    raise MemoryBudgetError(
        f"memory_budget={memory_budget:,} bytes cannot hold one slot per worker{held}: {num_workers} "
        f"worker(s) with {what} need a ring of at least {smallest:,} bytes. Raise memory_budget, "
        "lower num_workers, or use smaller batches."
    )
