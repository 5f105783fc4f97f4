"""Checkpoint and resume, with the semantics of torchdata's ``StatefulDataLoader``.

A state taken after k batches of an epoch, loaded into a fresh loader built on the same
dataset and arguments, yields exactly the remaining batches of that epoch and then the
following epochs as the uninterrupted run would.

What is recorded per epoch, when its iterator starts: the state of the RNG that drives
sampling (``generator``, or torch's global RNG when there is none), whether the epoch
started a new iterator (and so drew a new base seed for the workers) or reused the
persistent one, and that base seed. Taking a state copies those and counts the batches
yielded: no pause, no message to the workers.

Resuming restores the epoch's RNG, rebuilds the sampler's iterator and advances it by k
batches of indices: no sample is loaded again. A loader's ``generator`` is its own and is
left where these draws leave it. torch's global RNG is the program's: a framework (or the
user) restores it with its checkpoint, so the draws are made from a recorded copy and the
global RNG is left as the resume found it; the following epochs draw from it as torch's
loader does. An IterableDataset with ``state_dict()`` and
``load_state_dict()`` is resumed from its own state: every worker stores its dataset's
state with each batch it writes, the loader's state keeps each worker's state after its
last delivered batch (and where the round-robin was), and the resumed workers load it
before their first ``iter()``. Without them, its first k batches are produced again and
dropped (the documented fallback; exact when the dataset yields the same items each
epoch). Exactness needs ``in_order=True``: with ``in_order=False`` the first k
batches yielded are not necessarily the first k of the sampler.
"""

from __future__ import annotations

import dataclasses
import pickle
import weakref
from typing import Any, Callable

import torch
from torch.utils.data.dataloader import _DatasetKind

VERSION = 1


@dataclasses.dataclass
class EpochStart:
    """Recorded when an epoch's iterator starts."""

    epoch: int
    rng: torch.Tensor
    fresh: bool  # a new iterator (new base seed) rather than the persistent one reset
    base_seed: int | None = None


@dataclasses.dataclass(frozen=True)
class IterableResume:
    """What the workers of a resumed IterableDataset epoch start from."""

    dataset_states: dict[int, bytes]  # worker -> pickled state_dict() after its last delivered batch
    last_worker: int | None  # the worker of the last delivered batch (round-robin continues after it)
    active: tuple[bool, ...]  # workers whose shard was not yet exhausted

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> IterableResume:
        """A worker whose shard ended within its last delivered batch gets no more tasks, as
        in the uninterrupted run (its next task would have come back exhausted)."""
        states = state["dataset_states"]
        active = tuple(
            bool(on) and not (w in states and pickle.loads(states[w])["ended"]) for w, on in enumerate(state["active"])
        )
        return cls(states, state["last_worker"], active)


def has_state(dataset: Any) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


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


@dataclasses.dataclass(frozen=True)
class Progress:
    """How far an epoch's iterator got: read from it while it lives, kept when it dies (a
    loop left with ``break`` drops a non-persistent iterator; its state is still wanted)."""

    yielded: int  # batches yielded, and those that raised (consumed too)
    finished: bool
    iterable: dict[str, Any] | None  # an IterableDataset's own state, where it has one

    @classmethod
    def of(cls, it: Any, dataset: Any) -> Progress:
        iterable = None
        ring_progress = getattr(it, "progress", None)
        if ring_progress is not None:  # a ring iterator says: consumed, and its workers' dataset states
            yielded, shards = ring_progress()
            iterable = shards if has_state(dataset) else None
        else:  # torch's in-process iterator
            yielded = int(it._num_yielded)
            if has_state(dataset):  # the dataset is exactly where the yielded batches left it
                ended = bool(getattr(getattr(it, "_dataset_fetcher", None), "ended", False))
                iterable = {"dataset_states": {0: pickle.dumps({"ended": ended, "state": dataset.state_dict()})},
                            "last_worker": None, "active": [True]}
        try:
            finished = yielded >= len(it)
        except TypeError:  # an IterableDataset without __len__
            finished = False
        return cls(yielded, finished, iterable)


def make_state(start: EpochStart | None, progress: Progress | None, generator: torch.Generator | None,
               persistent: bool) -> dict[str, Any]:
    """The state dict for a loader whose current epoch began at ``start``."""
    # "started": the epoch's iterator exists, so its draws (base seed, sampler) are made.
    if start is None or progress is None:  # nothing iterated yet
        return {"version": VERSION, "epoch": 0, "yielded": 0, "rng": rng_state(generator),
                "fresh": True, "base_seed": None, "iterable": None, "started": False}
    if progress.finished:  # the next iter() starts the next epoch from the RNG as it is then
        return {"version": VERSION, "epoch": start.epoch + 1, "yielded": 0, "rng": rng_state(generator),
                "fresh": not persistent, "base_seed": start.base_seed, "iterable": None, "started": False}
    return {"version": VERSION, "epoch": start.epoch, "yielded": progress.yielded, "rng": start.rng.clone(),
            "fresh": start.fresh, "base_seed": start.base_seed, "iterable": progress.iterable, "started": True}


def check_state(state: dict[str, Any]) -> None:
    keys = {"version", "epoch", "yielded", "rng", "fresh", "base_seed", "iterable"}
    if not isinstance(state, dict) or not keys <= set(state):
        hint = ""
        if isinstance(state, dict) and "_snapshot" in state:
            hint = (" (this one is torchdata's StatefulDataLoader state, taken by torchdata's own iterator: "
                    "resume it without shmloader.install(stateful_dataloader=True), or take the state under it)")
        raise ValueError(f"not a shmloader DataLoader state dict: expected the keys {sorted(keys)}{hint}")
    if state["version"] != VERSION:
        raise ValueError(f"state dict version {state['version']} is not supported (this shmloader writes {VERSION})")


def fast_forward(it: Any, k: int, iterable: bool) -> None:
    """Advance a new epoch's iterator past its first ``k`` batches."""
    if k <= 0:
        return
    if iterable:
        for _ in range(k):
            next(it)
        return
    skip = getattr(it, "skip", None)
    if skip is not None:  # a ring iterator
        skip(k)
        return
    for _ in range(k):  # torch's in-process iterator
        next(it._sampler_iter)
    it._num_yielded = k


class _Epoch:
    """A loader's current epoch: its iterator, weakly (a non-persistent one shuts its workers
    down when dropped, as torch's does), and its progress once it died. An in-process
    iterator (no workers) is held: it owns nothing to release."""

    __slots__ = ("ref", "held", "last")

    def __init__(self, it: Any) -> None:
        self.ref = weakref.ref(it)
        self.held: Any = None
        self.last: Progress | None = None

    def progress(self, dataset: Any) -> Progress | None:
        it = self.ref()
        return self.last if it is None else Progress.of(it, dataset)


# loader -> its current epoch (weak: a loader still pickles and is not kept alive).
_epochs: weakref.WeakKeyDictionary[Any, _Epoch] = weakref.WeakKeyDictionary()


def current_iterator(loader: Any) -> Any | None:
    """The iterator of ``loader``'s current epoch (its latest ``iter()``), if it still exists."""
    epoch = _epochs.get(loader)
    return None if epoch is None else epoch.ref()


def begin_epoch(loader: Any, torch_iter: Callable[[], Any]) -> Any:
    """``iter(loader)`` for a loader that uses the ring (a shmloader.DataLoader, or torchdata's
    StatefulDataLoader under ``install(stateful_dataloader=True)``): record where the epoch
    begins, or begin it where a loaded state says; ``torch_iter`` is torch's ``__iter__``."""
    if getattr(loader._iterator, "shut_down", False):
        loader._iterator = None  # an error stopped the persistent workers: start afresh
    persistent = loader.persistent_workers and loader.num_workers > 0
    resume, loader._shm_resume = loader._shm_resume, None
    if resume is None:
        previous = loader._shm_epoch_start
        start = EpochStart(
            epoch=0 if previous is None else previous.epoch + 1,
            rng=rng_state(loader.generator),
            fresh=not (persistent and loader._iterator is not None),
        )
    else:
        start = EpochStart(resume["epoch"], resume["rng"], resume["fresh"], resume["base_seed"])
        # torch's global RNG belongs to the program (a framework restores it with its own
        # checkpoint). A started epoch's draws were taken from it before the state was: they are
        # made again from the epoch's recorded start, and the program's RNG is then put back as
        # found. An epoch not started yet draws from it as it is, as torch's loader would.
        started = bool(resume.get("started", resume["yielded"] > 0))
        program_rng = torch.get_rng_state()
        if loader.generator is None and not started:
            start.rng = program_rng
        set_rng_state(loader.generator, start.rng)
        if not start.fresh and start.base_seed is not None:
            # The original epoch reused a persistent iterator: no new base seed was drawn.
            loader._shm_resume_seed = (start.base_seed, start.rng)
    iterable_state = None if resume is None else resume["iterable"]
    if iterable_state is not None:
        if loader.num_workers == 0:
            loader.dataset.load_state_dict(pickle.loads(iterable_state["dataset_states"][0])["state"])
        else:
            loader._shm_resume_iterable = IterableResume.from_state(iterable_state)
    try:
        it = torch_iter()
    finally:
        loader._shm_resume_seed = None
        loader._shm_resume_iterable = None
    if start.fresh or start.base_seed is None:
        start.base_seed = getattr(it, "_base_seed", None)
    loader._shm_epoch_start = start
    epoch = _epochs[loader] = _Epoch(it)
    if hasattr(it, "last_words"):  # a ring iterator: say how far it got when it dies
        dataset = loader.dataset
        it.last_words = lambda dying: setattr(epoch, "last", Progress.of(dying, dataset))
    else:
        epoch.held = it
    if resume is not None:
        if iterable_state is not None:  # the dataset's own state already holds the position
            skip = getattr(it, "skip", None)
            if skip is not None:  # a ring iterator
                skip(resume["yielded"], draw=False)
            else:
                it._num_yielded = resume["yielded"]
            fetcher = getattr(it, "_dataset_fetcher", None)  # in process: was the epoch over?
            if fetcher is not None and pickle.loads(iterable_state["dataset_states"][0])["ended"]:
                fetcher.ended = True
        else:
            fast_forward(it, resume["yielded"], loader._dataset_kind == _DatasetKind.Iterable)
        if loader.generator is None and started:
            torch.set_rng_state(program_rng)
    return it


def loader_state(loader: Any) -> dict[str, Any]:
    """``loader.state_dict()`` (see ``begin_epoch``): cheap, the workers are not paused."""
    epoch = _epochs.get(loader)
    progress = None if epoch is None else epoch.progress(loader.dataset)
    persistent = loader.persistent_workers and loader.num_workers > 0
    return make_state(loader._shm_epoch_start, progress, loader.generator, persistent)


def load_loader_state(loader: Any, state: dict[str, Any]) -> None:
    """``loader.load_state_dict(state)``: the next ``iter(loader)`` continues from ``state``."""
    check_state(state)
    if loader._iterator is not None and hasattr(loader._iterator, "_shutdown_workers"):
        loader._iterator._shutdown_workers()  # a persistent iterator cannot be rewound
    loader._iterator = None
    loader._shm_resume = state
