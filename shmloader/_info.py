"""``python -m shmloader info``: what runs here (versions), whether each native part of the fast
path is on (and if not, why and the command that turns it on), and where shared memory lives."""

from __future__ import annotations

import os
import platform
import shutil
import sys
from importlib import metadata
from types import ModuleType

SHARED_MEMORY = "/dev/shm"  # where posix_ipc's segments (the ring, its overflow) live on Linux


def version_of(name: str, missing: str = "not installed") -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return missing


def native_line(native: ModuleType | None, error: str = "") -> str:
    """The ring's native part: shmloader._native (required: without it shmloader does not import)."""
    if native is None:
        from shmloader._reinstall import reinstall_command

        return (f"fast path: off (shmloader._native did not load: {error}; shmloader cannot run without it, "
                f"{reinstall_command()})")
    return f"fast path: on (shmloader._native: the ring's slots, semaphores and per-batch steps, {native.__file__})"


def stack_line() -> str:
    """The worker's stack: on once ``_native.stack_into`` knows this torch's tensors."""
    import torch

    try:
        from shmloader import _accel
    except ImportError as error:  # (a stale build: the layout check refuses it)
        return f"fast path: off ({error})"
    if _accel.WHY_OFF is not None:
        why, command = _accel.WHY_OFF
        return f"fast path: off ({why}, {command})"
    return (f"fast path: on (stack_into: a worker stacks plain samples with one memcpy each; "
            f"torch {torch.__version__}'s tensors read through its C shim)")


def memory_line(where: str = SHARED_MEMORY) -> str:
    """Where rings live: /dev/shm and its room, or why not there (then memory files)."""
    from shmloader.wire.shm import shm_problem

    problem = shm_problem(1, where)
    if problem is not None:
        return f"shared memory: {problem}; rings go to memory files (memfd), which it does not bound"
    usage = shutil.disk_usage(where)
    gib = 1 << 30
    return (f"shared memory: {where}, {usage.free / gib:.1f} GiB free of {usage.total / gib:.1f} GiB "
            "(a ring it cannot hold goes to a memory file, memfd)")


def lines() -> list[str]:
    import numpy
    import torch

    try:
        from shmloader import _native
    except ImportError as error:
        native, why = None, str(error)
    else:
        native, why = _native, ""
    out = [
        f"shmloader {version_of('shmloader', 'not installed (a source tree)')} "
        f"({os.path.dirname(os.path.abspath(__file__))})",
        f"Python {platform.python_version()} ({platform.python_implementation()}, {sys.executable})",
        f"torch {torch.__version__}",
        f"numpy {numpy.__version__}",
        f"posix_ipc {version_of('posix_ipc')}",
        f"uvloop {version_of('uvloop', 'not installed (asyncio runs its own event loop)')}",
        native_line(native, why),
    ]
    if native is not None:
        out.append(stack_line())
    out.append(memory_line())
    return out


def main() -> int:
    print("\n".join(lines()))
    return 0
