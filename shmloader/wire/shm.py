"""POSIX shared-memory segments: create (then unlink at once: processes share the fd), map;
and, where /dev/shm cannot hold one (too small, full, read-only, absent), the same memory as an
anonymous memory file (memfd), which /dev/shm does not bound.

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


def shm_problem(needed: int, path: str = SHM_DIR) -> str | None:
    """Why ``path`` cannot hold a segment of ``needed`` bytes (absent, read-only, not writable
    by this user, too small) and what would let it, or None when it looks as if it can."""
    try:
        st = os.statvfs(path)
    except FileNotFoundError:
        return f"{path} does not exist (to use it: mount a tmpfs there)"
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror})"
    if st.f_flag & os.ST_RDONLY:
        return f"{path} is read-only (to use it: mount it writable)"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable by this user (to use it: let this user write there)"
    free = st.f_bavail * st.f_frsize
    if needed > free:
        return (f"{path} has {free:,} bytes free and the ring needs {needed:,} (to use it: give it room, "
                "Docker: --shm-size=...)")
    return None


def create_ring_memory(size: int) -> tuple[str | None, int, Mapping, str | None]:
    """The ring's memory, ``size`` bytes reserved: a segment in /dev/shm where it fits, else a
    memory file (memfd) that /dev/shm does not bound. Returns (the segment's name, or None for a
    memfd; the fd; the mapping; why not /dev/shm, or None). Raises SharedMemoryFullError only
    when the memory itself is not there."""
    why = shm_problem(size)
    if why is None:
        try:
            name, fd, mm = create_segment_fd(size)
            return name, fd, mm, None
        except SharedMemoryFullError:  # (filled meanwhile, or a quota statvfs does not show)
            why = shm_problem(size) or f"{SHM_DIR} is full"
        except (OSError, posix_ipc.Error) as exc:
            why = shm_problem(size) or f"{SHM_DIR} refused a segment ({exc})"
    fd, mm = create_memfd(size, "shmloader-ring", f"the ring needs {size:,} bytes of shared memory ({why}, so "
                          "it went to a memory file), and the system could not provide them")
    return None, fd, mm, why


def create_memfd(size: int, name: str, what: str) -> tuple[int, Mapping]:
    """A memory file of ``size`` bytes, reserved and mapped: (fd, mapping). The fd is not
    inheritable; the caller sends it to the processes that need it and closes it. ``what`` says,
    in a SharedMemoryFullError, what needed the memory."""
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
    except OSError as exc:  # (a sandbox's seccomp filter, a kernel before 3.17)
        raise SharedMemoryFullError(
            f"{what}: memory files are not available here (memfd_create: {exc.strerror}). Give /dev/shm room "
            "(Docker: --shm-size=...), or lower batch_size, num_workers or prefetch_factor."
        ) from None
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
                raise
            raise SharedMemoryFullError(
                f"{what} ({exc.strerror}): the machine's memory, or this process's cgroup limit, is used up. "
                "Lower batch_size, num_workers or prefetch_factor, set memory_budget= so that batches wait "
                "for room, or give the job more memory."
            ) from None
        return fd, Mapping(fd, size)
    except BaseException:
        os.close(fd)
        raise


def create_segment(size: int) -> tuple[str, mmap.mmap]:
    """Create, reserve and map a new segment of ``size`` bytes. Returns (name, mapping)."""
    name, fd, mm = create_segment_fd(size)
    os.close(fd)
    return name, mm


def create_segment_fd(size: int) -> tuple[str, int, Mapping]:
    """Create, reserve and map a new segment of ``size`` bytes. Returns (name, fd, mapping);
    the fd stays open for processes started later (it survives the name's unlink).

    The pages are reserved with posix_fallocate, so a full tmpfs fails here (and the ring
    goes to a memfd: ``create_ring_memory``) instead of with a SIGBUS on first touch.
    """

    name = new_name(SEGMENT_PREFIX)
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
    try:
        try:
            os.posix_fallocate(shm.fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise SharedMemoryFullError(f"{SHM_DIR} cannot hold {size:,} more bytes ({exc.strerror})") from None
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
