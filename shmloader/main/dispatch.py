"""Dispatch: sampler indices as tasks, and the ways a task reaches its worker.

Which worker gets the next task is the scheduler's (``Scheduler.pick``, native): round-robin
over the workers that can take one, as torch's loader sends them (every worker with
``in_order=True``; with ``in_order=False`` those with fewer than their share of the tasks;
for an IterableDataset only those whose shard is not exhausted). So batch k of an epoch
comes from the same worker as in torch's loader, and random augmentation drawn from a
worker's seeded RNGs is the same as torch's, whatever the timing. The scheduler's step posts
a batch sampler's list of ints itself; ``post`` here is every other way.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any

from torch.utils.data import BatchSampler, SequentialSampler

from shmloader.wire.layout import Field
from shmloader.wire.messages import Index
from shmloader.wire.ring import NOT_INTS, POSTED

if TYPE_CHECKING:
    from shmloader.main.scope import RingScope


def batches_of(index_sampler: Any, made: Any = None) -> Any:
    """``iter(index_sampler)`` (``made``, when torch's ``_reset`` made it already: a sampler whose
    ``iter()`` draws, as torchdata's RandomSampler does, is not asked twice), except for torch's
    own BatchSampler over its SequentialSampler (those exact types): the same batches as ``range``
    objects, which the scheduler's post writes as the list of their ints without making one. A
    task's index may so be a range; anything that hands it on as an index (a pipe, a pickle, a
    message) takes ``as_list(index)``."""
    if type(index_sampler) is BatchSampler and type(index_sampler.sampler) is SequentialSampler:
        return _sequential_batches(index_sampler.sampler.data_source, index_sampler.batch_size,
                                   index_sampler.drop_last)
    return iter(index_sampler) if made is None else made


def _sequential_batches(source: Any, size: int, drop_last: bool) -> Any:
    n = len(source)  # when the first batch is asked for, as BatchSampler's loop asks
    stop = n - n % size if drop_last else n
    for start in range(0, stop, size):
        yield range(start, min(start + size, n))


def as_list(index: Any) -> Any:
    """The index the batch sampler stands for (a range from ``batches_of``: its list)."""
    return list(index) if type(index) is range else index


def index_text(index: Any, width: int = 200) -> str:
    """A batch's index for a message, at most ``width`` characters: whole when it fits, else
    the items that fit and how many are left out (a list cut mid-item says neither)."""
    text = repr(index)
    if len(text) <= width:
        return text
    if isinstance(index, (list, tuple)) and index:
        shown: list[str] = []
        for item in index:
            rest = len(index) - len(shown) - 1
            if len("[" + ", ".join([*shown, repr(item)]) + f", ... and {rest:,} more: {len(index):,} in all]") > width:
                break
            shown.append(repr(item))
        if shown:
            return "[" + ", ".join(shown) + f", ... and {len(index) - len(shown):,} more: {len(index):,} in all]"
        tail = f" ... ({len(index):,} items, {len(text):,} characters)"
    else:
        tail = f" ... ({len(text):,} characters)"
    return text[: width - len(tail)] + tail


def post(scope: RingScope, slot: int) -> int:
    """Post IN_FLIGHT ``slot``'s task (its worker, epoch, seq and index from the scheduler) the
    way its index fits: a list of ints as int64 values (one native call: what ``Scheduler.step``
    posts itself), else pickled into the slot, else pickled over the worker's connection.
    Every queue entry and STATE store goes through the scheduler, their one writer. Returns the
    bytes of an index the slot could not hold (the ring should grow to hold it), else 0."""
    sched, ring = scope.sched, scope.ring
    task = sched.task_of(slot)
    assert task is not None
    posted = sched.post_index(slot, task.index, False)
    if posted == NOT_INTS:
        payload = pickle.dumps(as_list(task.index), protocol=pickle.HIGHEST_PROTOCOL)
        posted = sched.post_index(slot, payload, True)
    if posted == POSTED:
        return 0
    payload = pickle.dumps(as_list(task.index), protocol=pickle.HIGHEST_PROTOCOL)
    hdr = ring.headers[slot]
    hdr[Field.EPOCH] = task.epoch
    hdr[Field.SEQ] = task.seq
    hdr[Field.TASK_LEN] = -1
    hdr[Field.OWN] = sched.own
    sched.set_idle(slot)
    scope.send(task.worker, Index(slot, payload))
    sched.push(task.worker, slot)
    return len(payload) if len(payload) > ring.data_bytes else 0
