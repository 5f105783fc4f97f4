"""CPU-bound neighbours for ``shmloader bench --neighbours``: processes at the loader's own
priority that never sleep (``while True: pass``), as other containers on a shared node, other
ranks' spinning processes (CUDA's default synchronisation spins) or a busy notebook are."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from typing import Iterator

# The pids of the neighbours running now: not the loader's, so the measures of its process tree
# (CPU, memory) leave them out.
RUNNING: set[int] = set()


@contextlib.contextmanager
def neighbours(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` neighbour processes running for the duration of the block; stopped and reaped after."""
    procs = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL))
            RUNNING.add(procs[-1].pid)
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
            RUNNING.discard(proc.pid)


def counts(text: str | None) -> list[int]:
    """``--neighbours 1,2`` -> [0, 1, 2]: each count asked, and always none (the loader alone,
    which the others are a share of)."""
    if text is None:
        return [0]
    asked = set()
    for part in text.split(","):
        n = int(part)
        if n < 0:
            raise SystemExit(f"--neighbours: a count of neighbour processes is at least 0, not {n}")
        asked.add(n)
    return sorted(asked | {0})
