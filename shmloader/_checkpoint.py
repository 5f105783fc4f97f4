"""Checkpoint and resume, with the semantics of torchdata's ``StatefulDataLoader``.

A state taken after k batches of an epoch, loaded into a fresh loader built on the same
dataset and arguments, yields exactly the remaining batches of that epoch and then the
following epochs as the uninterrupted run would.

What is recorded per epoch, when its iterator starts: the state of the RNG that drives
sampling (``generator``, or torch's global RNG when there is none), whether the epoch
started a new iterator (and so drew a new base seed for the workers) or reused the
persistent one, and that base seed. Taking a state copies those and counts the batches
yielded: no pause, no message to the workers.

Resuming restores the RNG, rebuilds the sampler's iterator and advances it by k batches
of indices: no sample is loaded again. An IterableDataset with ``state_dict()`` and
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
from typing import Any

import torch

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
    return generator.get_state() if generator is not None else torch.get_rng_state()


def set_rng_state(generator: torch.Generator | None, state: torch.Tensor) -> None:
    if generator is not None:
        generator.set_state(state)
    else:
        torch.set_rng_state(state)


def make_state(start: EpochStart | None, it: Any, generator: torch.Generator | None,
               persistent: bool, dataset: Any) -> dict[str, Any]:
    """The state dict for a loader whose current epoch began at ``start``."""
    if start is None or it is None:  # nothing iterated yet
        return {"version": VERSION, "epoch": 0, "yielded": 0, "rng": rng_state(generator),
                "fresh": True, "base_seed": None, "iterable": None}
    iterable = None
    if has_state(dataset):
        if hasattr(it, "dataset_states"):  # workers: each one's state after its last delivered batch
            iterable = {"dataset_states": dict(it.dataset_states), "last_worker": it.last_worker,
                        "active": list(it._dispatcher.active)}
        else:  # in process: the dataset is exactly where the yielded batches left it
            ended = bool(getattr(getattr(it, "_dataset_fetcher", None), "ended", False))
            iterable = {"dataset_states": {0: pickle.dumps({"ended": ended, "state": dataset.state_dict()})},
                        "last_worker": None, "active": [True]}
    yielded = int(it._num_yielded) + int(getattr(it, "_failed_batches", 0))  # a batch that raised is consumed too
    try:
        finished = yielded >= len(it)
    except TypeError:  # an IterableDataset without __len__
        finished = False
    if finished:  # the next iter() starts the next epoch from the RNG as it is now
        return {"version": VERSION, "epoch": start.epoch + 1, "yielded": 0, "rng": rng_state(generator),
                "fresh": not persistent, "base_seed": start.base_seed, "iterable": None}
    return {"version": VERSION, "epoch": start.epoch, "yielded": yielded, "rng": start.rng.clone(),
            "fresh": start.fresh, "base_seed": start.base_seed, "iterable": iterable}


def check_state(state: dict[str, Any]) -> None:
    keys = {"version", "epoch", "yielded", "rng", "fresh", "base_seed", "iterable"}
    if not isinstance(state, dict) or not keys <= set(state):
        raise ValueError(f"not a shmloader DataLoader state dict: expected the keys {sorted(keys)}")
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
    for _ in range(k):
        next(it._sampler_iter)
    it._num_yielded = k
