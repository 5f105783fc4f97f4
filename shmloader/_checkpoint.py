"""Checkpoint and resume with the semantics, and the state layout, of torchdata's ``StatefulDataLoader``.

A state taken after k batches of an epoch, loaded into a fresh loader built on the same
dataset and arguments, yields exactly the rest of that epoch and then the following epochs
as the uninterrupted run would. A state taken after the epoch ended (its StopIteration
raised) resumes into the next epoch; one taken inside the loop after the last batch resumes
into the empty rest of that epoch, as torchdata's does.

The layout is torchdata's (``_snapshot``: ``_snapshot_step``, ``_last_yielded_worker_id``,
``_main_snapshot``, ``_worker_snapshots``; with ``num_workers=0`` its single-process keys), plus
``_shmloader``: the epoch, and the RNG positions that let shmloader replay torch's own
samplers exactly. Everything shmloader writes is what JSON holds; what the dataset, its
iterator and the sampler return from their own ``state_dict()`` is stored as they made it.

NOTE [ What a resume restores, in order ]
0. ``load_state_dict()`` sets the sampling RNG (``generator``, or torch's global RNG) to where it
   was when the state was taken (``rng_now``): what is drawn after that point (the next epoch's
   shuffle, a sampler's first draw not made yet, the program's own draws) is the uninterrupted
   run's. A framework that restores torch's RNG with its checkpoint after loading the loader's
   state (Accelerate does) keeps its own: the loader takes the RNG as it finds it at ``iter()``.
1. At ``iter()`` the sampling RNG goes back to where the epoch began, so the iterator's base
   seed and torch's samplers draw what they drew then.
2. The sampler is put where the snapshot was: a stateful index sampler or its iterator
   (torchdata's, or one with ``state_dict()``/``load_state_dict()``) loads its own state;
   otherwise its first k batches of indices are drawn and dropped (nothing is loaded), and
   those it had given ahead of the consumer when the state was taken are drawn and kept (and
   its end, if it had ended: torch's RandomSampler draws a permutation there).
3. The RNG is put back as ``iter()`` found it, before any task is dispatched: what the sampler
   draws from here on, the run the state was taken from drew after the state.
4. Datasets: every worker starts from its snapshot (torchdata's worker snapshot: the dataset's
   ``state_dict()``, and for an IterableDataset its iterator's and whether its shard ended),
   loaded in torchdata's order: ``dataset.load_state_dict``, ``iter(dataset)``, then the
   iterator's ``load_state_dict``. With ``in_order=True`` round-robin goes on after the last worker
   that delivered; with ``in_order=False`` the tasks already consumed are not made again.
5. ``snapshot_every_n_steps=n``: the snapshot is the one at the latest multiple of n batches;
   the batches after it are produced again and dropped (with ``in_order=False`` the state is
   always taken now: batches made again would be whichever came first, not those consumed). An
   IterableDataset with no state of its own (nor its iterator) replays all of them: exact when
   its shards are deterministic.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from shmloader import _torch_private as torch_private
from shmloader._errors import ShmLoaderError, StateMismatchError
from shmloader._sampler_position import DONE, carry_sampler
from shmloader._state_layout import EpochStart, Plan, Progress, holds_position, state_dict_of
from shmloader.worker.produce import has_state


class Progressing(Protocol):
    """An iterator that says where its epoch is (both of shmloader's)."""

    def progress(self) -> Progress: ...


class Checkpointed(Progressing, Protocol):
    def checkpoint(self) -> tuple[Progress, int]:
        """``progress()`` at the latest snapshot, and the batches consumed since."""


@runtime_checkable
class Replaying(Protocol):
    """Puts the RNG back once a resume's batches were made again (None: nothing to put back)."""

    after_replay: Callable[[], None] | None


@runtime_checkable
class Dying(Checkpointed, Protocol):
    """A ring iterator: it calls ``last_words`` with itself when it is collected."""

    last_words: Callable[[Any], None] | None


def rng_state(generator: torch.Generator | None) -> torch.Tensor:
    if generator is not None and not isinstance(generator, torch.Generator):
        # torch's iterator fails on it too, with a TypeError from random_(generator=...)
        raise TypeError(f"DataLoader's generator must be a torch.Generator or None, not {type(generator).__name__}")
    return generator.get_state() if generator is not None else torch.get_rng_state()


def set_rng_state(generator: torch.Generator | None, state: torch.Tensor) -> None:
    if generator is not None:
        generator.set_state(state)
    else:
        torch.set_rng_state(state)


def check_snapshot_every(every: Any) -> None:
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 0):
        raise ValueError(f"snapshot_every_n_steps should be a non-negative int or None, but got {every!r}")


class Snapshots:
    """``snapshot_every_n_steps``: an iterator's progress at the latest multiple of n batches (and
    at the epoch's start); with n == 1, its progress now: nothing is kept. It does not hold the
    iterator (a dropped one must die at once: it shuts its workers down)."""

    __slots__ = ("every", "taken")

    def __init__(self, every: int | None, it: Progressing) -> None:
        self.every = every or 0
        self.taken: Progress | None = None if self.every == 1 else it.progress()

    def stepped(self, it: Progressing, consumed: int) -> None:
        if self.every > 1 and consumed % self.every == 0:
            self.taken = it.progress()

    def checkpoint(self, it: Progressing) -> tuple[Progress, int]:
        """The progress at the latest snapshot and the batches since; with the sampler's pulls as
        they are now, when the sampling RNG is read for the state (``rng_now``): a resume draws
        that many before it puts the RNG back, so that a draw the sampler makes at its end lands
        on the same side of ``rng_now`` as in the run the state was taken from."""
        live = it.progress()
        if self.taken is None or live.finished:
            return live, 0
        taken = dataclasses.replace(self.taken, pulled=live.pulled, drained=live.drained)
        return taken, live.consumed - taken.consumed


def carry_into_next_epoch(loader: Any, plan: Plan, persistent: bool) -> None:
    """A state taken after its epoch ended: what carries over into the next epoch, loaded before
    its iterator is made, as torchdata's loader does. A stateful sampler (persistent workers:
    the new iterator does it, before its epoch's ``iter()`` of the sampler); with
    ``num_workers=0`` the dataset (the loader's own) loads its state, and its iterator's is
    loaded into an ``iter(dataset)`` made for it."""
    if not persistent and not torch_private.is_iterable(loader):
        carry_sampler(torch_private.index_sampler(loader), plan)
    if plan.num_workers:
        return
    dataset = loader.dataset
    dataset_state, fetcher_state = plan.in_process
    if dataset_state is not None and has_state(dataset):
        dataset.load_state_dict(dataset_state)
    if fetcher_state is not None and fetcher_state["dataset_iter_state"] is not None:
        it = iter(dataset)
        if has_state(it):
            it.load_state_dict(fetcher_state["dataset_iter_state"])


def snapshots_of(plan: Plan | None) -> Callable[[int], tuple[bytes, bool]]:
    """Worker -> its snapshot in ``plan`` (b"": none, or no plan), and whether it was taken after
    that worker's epoch ended: where each worker of a resumed iterator starts."""
    if plan is None:
        return lambda worker: (b"", False)
    return lambda worker: (plan.workers.get(worker, b""), plan.done(worker))


def plan_keeps_position(plan: Plan, dataset: Any, iterable: bool) -> bool:
    """Whether the snapshot holds the position: False for an IterableDataset with no state of its
    own (nor its iterator), whose consumed batches are produced again and dropped."""
    dataset_state, fetcher_state = plan.in_process
    in_process = holds_position({"dataset_state": dataset_state, "fetcher_state": fetcher_state})
    return not iterable or bool(plan.workers) or has_state(dataset) or in_process


def replayed(plan: Plan, dataset: Any, iterable: bool) -> int:
    return plan.since + (0 if plan_keeps_position(plan, dataset, iterable) else plan.step)


class _Epoch:
    """A loader's current epoch: its iterator, weakly (a non-persistent one shuts its workers
    down when dropped, as torch's does), and its last checkpoint once it died. An in-process
    iterator (no workers) is held: it owns nothing to release."""

    __slots__ = ("ref", "held", "last")

    def __init__(self, it: Checkpointed) -> None:
        self.ref = weakref.ref(it)
        self.held: Checkpointed | None = None
        self.last: tuple[Progress, int] | BaseException | None = None  # (an exception: it failed to say)

    def checkpoint(self) -> tuple[Progress, int] | None:
        it = self.ref()
        if it is not None:
            return it.checkpoint()
        if isinstance(self.last, BaseException):
            raise ShmLoaderError("the epoch's iterator could not say where it was when it was dropped, so "
                                 "there is no state to take") from self.last
        return self.last


# loader -> its current epoch (weak: a loader still pickles and is not kept alive).
_epochs: weakref.WeakKeyDictionary[Any, _Epoch] = weakref.WeakKeyDictionary()


def current_iterator(loader: Any) -> Any | None:
    """The iterator of ``loader``'s current epoch (its latest ``iter()``), if it still exists."""
    epoch = _epochs.get(loader)
    return None if epoch is None else epoch.ref()


def begin_epoch(loader: Any, torch_iter: Callable[[], Any]) -> Any:
    """``iter(loader)`` for a loader that records its epochs (a shmloader.DataLoader, or torchdata's
    StatefulDataLoader under ``install(stateful_dataloader=True)``): record where the epoch
    begins, or begin it where a loaded state says; ``torch_iter`` is torch's ``__iter__``."""
    if getattr(torch_private.kept_iterator(loader), "shut_down", False):
        torch_private.keep_iterator(loader, None)  # an error stopped the persistent workers: start afresh
    persistent = loader.persistent_workers and loader.num_workers > 0
    generator = loader.generator
    plan = None if loader._shm_resume is None else Plan.of(loader._shm_resume)
    if plan is not None and plan.num_workers != loader.num_workers:
        raise StateMismatchError(
            f"this state was taken with num_workers={plan.num_workers} and this loader has "
            f"num_workers={loader.num_workers}: the workers' snapshots and which batch each worker makes "
            f"belong to that count; resume with num_workers={plan.num_workers}")
    loader._shm_resume = None
    if plan is None:
        previous = loader._shm_epoch_start
        start = EpochStart(0 if previous is None else previous.epoch + 1, rng_state(generator),
                           fresh=not (persistent and torch_private.kept_iterator(loader) is not None))
    elif not plan.started:  # taken before the loader's first iter(): that epoch, from the RNG (NOTE, 0)
        start = EpochStart(plan.epoch, rng_state(generator), fresh=True)
        plan = None
    elif plan.finished:  # the next epoch, from the RNG (NOTE, 0)
        carry_into_next_epoch(loader, plan, persistent)
        start = EpochStart(plan.epoch + 1, rng_state(generator), fresh=not persistent, base_seed=plan.base_seed)
        if persistent:  # the workers carried on into it: no new base seed; they start from their snapshots
            loader._shm_resume_seed = (plan.base_seed, start.rng) if plan.base_seed is not None else None
            loader._shm_resume_plan = plan
        plan = None
    else:
        found = rng_state(generator)
        plan = dataclasses.replace(plan, rng_now=found)  # (put back once the iterator is positioned)
        start = EpochStart(plan.epoch, found if plan.rng_start is None else plan.rng_start, plan.fresh, plan.base_seed)
        set_rng_state(generator, start.rng)
        if plan.base_seed is not None and (not start.fresh or plan.rng_start is None):
            loader._shm_resume_seed = (plan.base_seed, start.rng)  # the seed that epoch's workers had
        loader._shm_resume_plan = plan
    return _begun(loader, torch_iter, start, plan)


def _begun(loader: Any, torch_iter: Callable[[], Any], start: EpochStart, plan: Plan | None) -> Any:
    """``iter(loader)`` with the epoch's start recorded, and a resumed one where ``plan`` says."""
    try:
        it = torch_iter()
    finally:
        loader._shm_resume_seed = None
        loader._shm_resume_plan = None
    if start.fresh or start.base_seed is None:
        start.base_seed = torch_private.base_seed(it)
    loader._shm_epoch_start = start
    epoch = _epochs[loader] = _Epoch(it)
    if isinstance(it, Dying):  # a ring iterator: say how far it got when it dies
        def last_words(dying: Checkpointed) -> None:
            try:
                epoch.last = dying.checkpoint()
            except Exception as error:  # (a state_dict() of this epoch then says so, never a wrong state)
                epoch.last = error.with_traceback(None)  # (its frames would keep the dying iterator)
        it.last_words = last_words
    else:
        epoch.held = it
    if plan is not None:
        for _ in range(replayed(plan, loader.dataset, torch_private.is_iterable(loader))):
            if next(it, DONE) is DONE:
                break
        after = it.after_replay if isinstance(it, Replaying) else None
        if after is not None:  # (in process, the batches made again drew from the sampling RNG too)
            after()
    return it


def resume_rng(loader: Any, plan: Plan) -> Callable[[], None]:
    """Step 3 of the NOTE, for ``position``: the RNG as ``iter()`` found it."""
    def now() -> None:
        if plan.rng_now is not None:
            set_rng_state(loader.generator, plan.rng_now)
    return now


def loader_state(loader: Any) -> dict[str, Any]:
    """``loader.state_dict()`` (see the module's docstring): cheap, the workers are not paused."""
    if loader._shm_resume is not None:  # loaded and not iterated yet: that state
        return _copied(loader._shm_resume)  # type: ignore[no-any-return]
    epoch = _epochs.get(loader)
    mark = None if epoch is None else epoch.checkpoint()
    now = rng_state(loader.generator)
    start = loader._shm_epoch_start
    if mark is None or start is None:  # nothing iterated yet: the first epoch, from the RNG as it is now
        return state_dict_of(loader, EpochStart(0, now, True), (Progress(0, False, 0, {}, None), 0), now, False)
    return state_dict_of(loader, start, mark, now, True)


def _copied(value: Any) -> Any:
    """Its dicts and lists copied (a caller may edit them, as Accelerate does), the rest shared (a
    dataset's own tensors: the copy compares equal to the original, as torchdata's does)."""
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copied(item) for item in value]
    return value


def load_loader_state(loader: Any, state: dict[str, Any]) -> None:
    """``loader.load_state_dict(state)``: the next ``iter(loader)`` continues from ``state``."""
    if not isinstance(state, dict):
        raise TypeError(f"load_state_dict expects the dict that state_dict() returned, not {type(state).__name__}")
    plan = Plan.of(state) if state else None  # refused now if it is not a state at all
    if plan is not None and plan.foreign and plan.num_workers == loader.num_workers:  # (another count: at iter())
        raise ValueError("this state was taken by torchdata's own StatefulDataLoader iterator: resume it "
                         "without shmloader.install(stateful_dataloader=True), or take it under install()")
    torch_private.shutdown_workers(torch_private.kept_iterator(loader))  # a persistent one cannot be rewound
    torch_private.keep_iterator(loader, None)
    if plan is None:  # torchdata's: an empty state changes nothing
        loader._shm_resume = None
        return
    if plan.rng_now is not None:  # (NOTE, 0)
        set_rng_state(loader.generator, plan.rng_now)
    loader._shm_resume = state
