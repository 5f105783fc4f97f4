"""CPU-bound neighbours for ``shmloader bench --neighbours``: processes at the loader's own
priority that never sleep (``while True: pass``, in effect), as other containers on a shared
node, other ranks' spinning processes (CUDA's default synchronisation spins) or a busy notebook
are. Each exits by itself once the bench is gone (killed, say), never left spinning."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Iterator

# A loop beside neighbours runs for minutes: the loader runs SETTLE_S untimed first (its depth
# adapts; the scheduler spreads its processes and the neighbours over the CPUs, which a loader's
# first tenth of a second does not show), then each repeat lasts LEAST_S at least (workloads that
# neither run in epochs nor keep every batch).
SETTLE_S = 1.0
LEAST_S = 1.0
FASTEST = 500_000  # batches/s no loader reaches here: a dataset for that many a second is long enough


def steady_batches(repeats: int, batches: int) -> int:
    """The batches a dataset must hold for SETTLE_S and ``repeats`` repeats of LEAST_S at least,
    each in whole runs of ``batches``."""
    return int(FASTEST * (SETTLE_S + repeats * LEAST_S)) + repeats * batches + 8

# The pids of the neighbours running now: not the loader's, so the measures of its process tree
# (CPU, memory) leave them out.
RUNNING: set[int] = set()
# Spins; every million iterations (milliseconds) it looks whether its parent, the bench (whose
# pid it is given: one killed before the child's first look would not be its parent then), is gone.
SPIN = ("# shmloader bench neighbour\nimport os, sys\nwhile os.getppid() == int(sys.argv[1]):\n"
        "    for _ in range(1_000_000):\n        pass\n")


@contextlib.contextmanager
def neighbours(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` neighbour processes running for the duration of the block; stopped and reaped after."""
    procs = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", SPIN, str(os.getpid())], stdin=subprocess.DEVNULL))
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
        try:
            n = int(part)
        except ValueError:
            raise SystemExit(f"--neighbours: counts of neighbour processes, comma-separated (1,2), "
                             f"not {text!r}") from None
        if n < 0:
            raise SystemExit(f"--neighbours: a count of neighbour processes is at least 0, not {n}")
        asked.add(n)
    return sorted(asked | {0})
