"""Overflow memory (main process): where a batch goes when it does not fit a ring slot.

The path of an oversized batch:

1. the worker measures the batch as a slot would hold it, publishes its slot with
   ``Status.NEED_MEMORY`` and the bytes it needs, and waits on its setup connection;
2. the consumer grants the memory when ``memory_budget`` has room (until then the worker
   waits: backpressure): an anonymous ``memfd`` of that size, reserved with
   ``posix_fallocate`` and mapped here, whose fd goes to the worker over its connection.
   (When only batches the consumer holds could make room for the batch it waits for, the
   worker is asked to send that batch pickled over the connection instead: a copy, not a
   hang, as a slot's batch is copied when the consumer holds the whole ring.);
3. the worker maps it, writes the batch exactly as into a slot (leaves, skeleton, leaf
   table, dataset state), unmaps it and publishes the slot again, now with
   ``Field.REGION = Region.OVERFLOW``;
4. the consumer builds the batch from views of its own mapping, as from a slot; the slot
   is free at once, and the memory is freed when the batch's last view is dropped.

The memory never has a name: nothing can be left in ``/dev/shm``, whichever process dies
at whichever step; the kernel frees it with the last mapping and fd.

``OverflowArena`` owns the accounting: bytes granted and not yet freed, plus retired
rings that the user's batches still view, so ``memory_budget`` covers everything the
loader allocates. Release callbacks may run in any thread.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import weakref
from typing import Any

import numpy as np

from ._errors import SharedMemoryFullError
from ._shm import Mapping


class OverflowArena:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.live = 0  # bytes of overflow memory granted and not yet freed
        self.retired = 0  # bytes of replaced rings that batches still view
        self.on_free: Any = None  # called (any thread) after memory was freed

    @property
    def in_use(self) -> int:
        return self.live + self.retired

    def allocate(self, nbytes: int) -> tuple[int, Mapping]:
        """A new anonymous shared region of ``nbytes``: (fd, mapping). The caller sends the fd
        and closes it; the mapping is the consumer's."""
        fd = os.memfd_create("shmloader-overflow", os.MFD_CLOEXEC)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
                    raise
                raise SharedMemoryFullError(
                    f"a batch that does not fit a ring slot needs {nbytes:,} bytes of shared memory "
                    f"and the system could not provide them ({exc.strerror}). Lower batch_size, "
                    "num_workers or prefetch_factor, or set memory_budget= so oversized batches "
                    "wait for room instead."
                ) from None
            mm = Mapping(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            self.live += nbytes
        return fd, mm

    def free(self, nbytes: int) -> None:
        with self._lock:
            self.live -= nbytes
        if self.on_free is not None:
            self.on_free()

    def lend(self, base: np.ndarray[Any, Any], nbytes: int) -> None:
        """Free ``nbytes`` once ``base`` (which every leaf of a delivered batch keeps alive) dies."""
        weakref.finalize(base, self.free, nbytes)

    def retire(self, mm: mmap.mmap, nbytes: int) -> None:
        """Count a replaced ring until its mapping (kept alive by the user's views) is freed."""
        with self._lock:
            self.retired += nbytes
        weakref.finalize(mm, self._unretire, nbytes)

    def _unretire(self, nbytes: int) -> None:
        with self._lock:
            self.retired -= nbytes
        if self.on_free is not None:
            self.on_free()
