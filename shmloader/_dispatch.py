"""Dispatch: turn sampler indices into tasks in free slots, and pick the worker.

Tasks go round-robin to the workers that can take one, as torch's loader sends them:
every worker with ``in_order=True``; with ``in_order=False`` those with fewer than their
share of the in-flight tasks; for an IterableDataset only those whose shard is not yet
exhausted. So batch k of an epoch comes from the same worker as in torch's loader, and
random augmentation drawn from a worker's seeded RNGs is the same as torch's, whatever
the timing.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable

from ._layout import IDLE, Field
from ._ring import Ring


class Dispatcher:
    def __init__(self, num_workers: int, iterable: bool, in_order: bool = True) -> None:
        self.num_workers = num_workers
        self.iterable = iterable
        self.in_order = in_order
        self.reset()

    def reset(self) -> None:
        self.active = [True] * self.num_workers
        self._next_rr = 0

    def skip_to(self, worker: int) -> None:
        """Make round-robin continue from ``worker`` (resuming a checkpointed epoch)."""
        self._next_rr = worker % self.num_workers

    def pick(self, load: list[int], capacity: int) -> int | None:
        """The worker for the next task (``load``: tasks in flight per worker; ``capacity``: tasks
        in flight at most), or None if no worker can take one."""
        for _ in range(self.num_workers):
            wid = self._next_rr
            self._next_rr = (wid + 1) % self.num_workers
            if self.active[wid] and (self.in_order or load[wid] < capacity // sum(self.active)):
                return wid
        return None

    def send_index(self, ring: Ring, slot: int, wid: int, epoch: int, seq: int, index: Any,
                   send: Callable[[int, tuple[Any, ...]], object]) -> int:
        """Queue a task whose index does not fit ``slot`` for worker ``wid``: the pickled index
        goes over the worker's connection (``send``). Returns its size."""
        payload = pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL)
        hdr = ring.headers[slot]
        hdr[Field.STATE] = IDLE
        hdr[Field.EPOCH] = epoch
        hdr[Field.SEQ] = seq
        hdr[Field.TASK_LEN] = -1
        send(wid, ("index", slot, payload))
        ring.push_task(wid, slot)
        return len(payload)
