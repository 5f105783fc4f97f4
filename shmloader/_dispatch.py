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

from torch.utils.data import BatchSampler, SequentialSampler

from ._layout import IDLE, Field
from ._ring import Ring


def batches_of(index_sampler: Any) -> Any:
    """``iter(index_sampler)``, except for torch's own BatchSampler over its SequentialSampler
    (those exact types): the same batches as ``range`` objects, which ``Ring.post_task`` writes
    as the list of their ints without making one. A task's index may so be a range; anything
    that hands it on as an index (a pipe, a pickle, a message) takes ``as_list(index)``."""
    if type(index_sampler) is BatchSampler and type(index_sampler.sampler) is SequentialSampler:
        return _sequential_batches(index_sampler.sampler.data_source, index_sampler.batch_size,
                                   index_sampler.drop_last)
    return iter(index_sampler)


def _sequential_batches(source: Any, size: int, drop_last: bool) -> Any:
    n = len(source)  # when the first batch is asked for, as BatchSampler's loop asks
    stop = n - n % size if drop_last else n
    for start in range(0, stop, size):
        yield range(start, min(start + size, n))


def as_list(index: Any) -> Any:
    """The index the batch sampler stands for (a range from ``batches_of``: its list)."""
    return list(index) if type(index) is range else index


class Dispatcher:
    def __init__(self, num_workers: int, iterable: bool, in_order: bool = True) -> None:
        self.num_workers = num_workers
        self.iterable = iterable
        self.in_order = in_order
        self.reset()

    def reset(self) -> None:
        self.active = [True] * self.num_workers
        self.next_rr = 0  # the worker round robin looks at first (_native.dispatch_next moves it too)

    def skip_to(self, worker: int) -> None:
        """Make round-robin continue from ``worker`` (resuming a checkpointed epoch)."""
        self.next_rr = worker % self.num_workers

    def pick(self, load: list[int], capacity: int) -> int | None:
        """The worker for the next task (``load``: tasks in flight per worker; ``capacity``: tasks
        in flight at most), or None if no worker can take one."""
        for _ in range(self.num_workers):
            wid = self.next_rr
            self.next_rr = (wid + 1) % self.num_workers
            if self.active[wid] and (self.in_order or load[wid] < capacity // sum(self.active)):
                return wid
        return None

    def send_index(self, ring: Ring, slot: int, wid: int, epoch: int, seq: int, index: Any,
                   send: Callable[[int, tuple[Any, ...]], object]) -> int:
        """Queue a task whose index does not fit ``slot`` for worker ``wid``: the pickled index
        goes over the worker's connection (``send``). Returns its size."""
        payload = pickle.dumps(as_list(index), protocol=pickle.HIGHEST_PROTOCOL)
        hdr = ring.headers[slot]
        hdr[Field.STATE] = IDLE
        hdr[Field.EPOCH] = epoch
        hdr[Field.SEQ] = seq
        hdr[Field.TASK_LEN] = -1
        send(wid, ("index", slot, payload))
        ring.push_task(wid, slot)
        return len(payload)
