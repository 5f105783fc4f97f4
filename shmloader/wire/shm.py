"""POSIX shared-memory segments: create (then unlink at once: processes share the fd), map.

Only the creator (the main process) unlinks. Names are unpredictable and carry the
creator's pid; everything is created exclusively with mode 0600. This module knows
nothing of slots or batches.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
from typing import Callable

import posix_ipc

from shmloader._errors import SharedMemoryFullError

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "shmloader-"


class Mapping(mmap.mmap):
    """The main process's mappings (the ring, overflow memory): an ``mmap`` that runs its
    ``before_unmap`` hooks while the memory is still mapped, from ``close()`` or when its
    last reference (a batch's view keeps it) dies, and only then unmaps.

    (A ``weakref.finalize`` on a plain mmap runs after CPython has already unmapped it: too
    late to unregister page-locked memory from CUDA.)"""

    _hooks: list[Callable[[], None]]

    def before_unmap(self, hook: Callable[[], None]) -> None:
        if not hasattr(self, "_hooks"):
            self._hooks = []
        self._hooks.append(hook)

    def _run_hooks(self) -> None:
        hooks = getattr(self, "_hooks", None)
        while hooks:
            hooks.pop()()

    def close(self) -> None:
        """Run the hooks, then unmap (nothing may view the mapping any more)."""
        self._run_hooks()
        super().close()

    def __del__(self) -> None:  # runs before mmap's own deallocation unmaps
        self._run_hooks()


def new_name(prefix: str) -> str:
    return f"/{prefix}{os.getpid()}-{secrets.token_hex(8)}"


def shm_free_bytes(path: str = SHM_DIR) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _fixes(needed: int, free: int) -> str:
    return (
        f"The ring needs {needed:,} bytes of shared memory but {SHM_DIR} has {free:,} bytes free. "
        "Fixes: give the container more shared memory (Docker: --shm-size=...), "
        "lower num_workers or prefetch_factor (the ring holds num_workers * prefetch_factor + 1 slots), "
        "use smaller batches, or set slot_bytes= to a smaller slot size."
    )


def check_free(needed: int, path: str = SHM_DIR) -> None:
    """Raise SharedMemoryFullError if ``path`` cannot hold ``needed`` more bytes."""

    free = shm_free_bytes(path)
    if free is not None and needed > free:
        raise SharedMemoryFullError(_fixes(needed, free))


def create_segment(size: int) -> tuple[str, mmap.mmap]:
    """Create, reserve and map a new segment of ``size`` bytes. Returns (name, mapping)."""
    name, fd, mm = create_segment_fd(size)
    os.close(fd)
    return name, mm


def create_segment_fd(size: int) -> tuple[str, int, Mapping]:
    """Create, reserve and map a new segment of ``size`` bytes. Returns (name, fd, mapping);
    the fd stays open for processes started later (it survives the name's unlink).

    The pages are reserved with posix_fallocate, so a full tmpfs fails here with a
    clear error instead of a SIGBUS on first touch.
    """

    name = new_name(SEGMENT_PREFIX)
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
    try:
        try:
            os.posix_fallocate(shm.fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise SharedMemoryFullError(_fixes(size, shm_free_bytes() or 0)) from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        mm = Mapping(shm.fd, size)
        os.set_inheritable(shm.fd, False)
    except BaseException:
        shm.close_fd()
        posix_ipc.unlink_shared_memory(name)
        raise
    return name, shm.fd, mm


def unlink_segment(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass
