"""Pin a loader's processes the two ways three busy processes can share two vCPUs (the
bench scripts' ``--place`` / ``--pin``)."""

from __future__ import annotations

import os


def place(how: str, pids: list[int]) -> None:
    """Pin this process (the main process) and ``pids`` (the workers): "apart" puts it alone
    on CPU 0 and the workers on CPU 1; "shared" puts it and worker 0 on CPU 0, worker 1 on
    CPU 1; "free" lets them run anywhere again."""
    every = set(range(os.cpu_count() or 1))
    cpus = {"free": (every, [every] * len(pids)), "apart": ({0}, [{1}] * len(pids)),
            "shared": ({0}, [{i % 2} for i in range(len(pids))])}[how]
    os.sched_setaffinity(0, cpus[0])
    for pid, mine in zip(pids, cpus[1]):
        os.sched_setaffinity(pid, mine)
