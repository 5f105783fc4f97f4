"""A ring iterator's checkpoint side: where its epoch is, for ``state_dict()``, and where a
resumed one starts (the ring's part of the NOTE at the top of ``_checkpoint.py``)."""

from __future__ import annotations

from typing import Any, Callable

from shmloader import _checkpoint, _sampler_position, _state_layout
from shmloader.main.delivery import Delivery
from shmloader.main.scheduler import Scheduler


class RingCheckpoint:
    """``RingIterator``'s checkpoint methods (a mixin: the state is the iterator's)."""

    _delivery: Delivery
    _sched: Scheduler
    _dataset: Any
    _iterable: bool
    _num_workers: int
    _num_yielded: int
    _index_sampler: Any
    _sampler_iter: Any
    _failed_batches: int
    _pulled_before: int  # batches of indices a resume drew before this iterator's first dispatch
    _drawn: tuple[int, bool]  # what a resume's positioning drew from the sampler: (batches, its end)
    _snapshots: _checkpoint.Snapshots
    finished: bool  # this epoch's StopIteration was raised
    after_replay: Callable[[], None] | None  # (a resume's: _checkpoint calls it)

    def _resume(self, loader: Any, plan: _state_layout.Plan) -> None:
        """Start where ``plan``'s snapshot was (``_checkpoint``'s NOTE). The sampler draws what it
        had drawn when the state was taken, then the RNG is put back, before any task is
        dispatched: a pull past that point (its end's draw included) is one the run the state was
        taken from made after it. Made again from its start, the RNG is put back after that
        (``after_replay``)."""
        put_back = _checkpoint.resume_rng(loader, plan)
        if not self._delivery.resume_from(plan, _checkpoint.plan_keeps_position(plan, self._dataset, self._iterable)):
            self.after_replay = put_back
            return  # (its epoch ended, or it is made again from its start)
        self._sched.resume_after(plan.active(self._num_workers), plan.last_worker if loader.in_order else None)
        self._pulled_before = plan.below
        self._drawn = (plan.pulled, plan.drained)
        self._sampler_iter = _sampler_position.position(self._index_sampler, self._sampler_iter, plan,
                                                        self._iterable, put_back)
        self._num_yielded = plan.step

    def progress(self) -> _state_layout.Progress:
        """Where this epoch is, for a checkpoint: batches consumed (yielded, or raised), each
        worker's snapshot after its last delivered batch or end of shard, and what the sampler
        has drawn: dispatched, or drawn by a resume's positioning and not dispatched yet (the
        RNG is already past it)."""
        consumed = self._num_yielded + self._failed_batches
        seqs = self._delivery.consumed
        dispatched = self._sched.send_seq
        pulled = self._pulled_before + dispatched if seqs is None else seqs.original(dispatched)
        drawn, drained = self._drawn
        return self._delivery.progress(consumed, self.finished, max(pulled, drawn),
                                       drained or bool(self._sched.exhausted),
                                       _sampler_position.sampler_states(self._sampler_iter,
                                                                        consumed if seqs is None else seqs.below))

    def consumed_below(self) -> int:
        """Every batch of the epoch below this one was consumed."""
        seqs = self._delivery.consumed
        return self._num_yielded + self._failed_batches if seqs is None else seqs.below

    def checkpoint(self) -> tuple[_state_layout.Progress, int]:
        """``progress()`` at the latest snapshot (``snapshot_every_n_steps``), and the batches since."""
        return self._snapshots.checkpoint(self)
