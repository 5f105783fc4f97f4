"""Page-locking the ring in place for fast host-to-device copies.

With ``pin_memory=True`` on a CUDA machine, the main process registers the whole
segment with ``cudaHostRegister`` once, right after creating it, so every slot is
pinned where it lies: no pinned bounce copy, no caching host allocator that grows.
Batches are views of that memory, so ``batch.to("cuda", non_blocking=True)`` is a true
asynchronous DMA. The registration is undone when the mapping is freed (after the last
batch viewing it is dropped).

If registration fails (locked-memory limits, an unsupported platform) this warns once,
saying what was lost, and batches stay in pageable memory. Device-side delivery on a
side stream is not here yet.
"""

from __future__ import annotations

import mmap
import warnings
import weakref
from typing import Any

import numpy as np


def _code(err: Any) -> int:
    return int(getattr(err, "value", err))


def register_host(mm: mmap.mmap, nbytes: int, cudart: Any = None) -> bool:
    """Page-lock ``mm`` in place. Returns True on success; warns and returns False if not."""
    if cudart is None:
        import torch.cuda

        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    ptr = np.frombuffer(mm, dtype=np.uint8).__array_interface__["data"][0]
    err = _code(cudart.cudaHostRegister(ptr, nbytes, 0))
    if err != 0:
        warnings.warn(
            f"pin_memory=True: cudaHostRegister of the {nbytes:,}-byte shared-memory ring failed "
            f"with CUDA error {err}; batches stay in pageable memory, so host-to-device copies "
            "are synchronous and slower. Check the locked-memory limit (ulimit -l) or pass "
            "pin_memory=False to silence this.",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    weakref.finalize(mm, cudart.cudaHostUnregister, ptr)
    return True


def warn_unsupported(device_type: str | None) -> None:
    warnings.warn(
        f"pin_memory=True: shmloader pins its ring only on CUDA, not on {device_type!r}; "
        "batches stay in pageable memory.",
        RuntimeWarning,
        stacklevel=4,
    )
