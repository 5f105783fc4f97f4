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
of indices: no sample is loaded again. An IterableDataset has no sampler to advance; its
first k batches are produced again and dropped (the documented fallback; exact when
the dataset yields the same items each epoch, as torch's own loader requires for
determinism). Exactness needs ``in_order=True``: with ``in_order=False`` the first k
batches yielded are not necessarily the first k of the sampler.
"""

from __future__ import annotations

import dataclasses
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


def rng_state(generator: torch.Generator | None) -> torch.Tensor:
    return generator.get_state() if generator is not None else torch.get_rng_state()


def set_rng_state(generator: torch.Generator | None, state: torch.Tensor) -> None:
    if generator is not None:
        generator.set_state(state)
    else:
        torch.set_rng_state(state)


def make_state(start: EpochStart | None, it: Any, generator: torch.Generator | None,
               persistent: bool) -> dict[str, Any]:
    """The state dict for a loader whose current epoch began at ``start``."""
    if start is None or it is None:  # nothing iterated yet
        return {"version": VERSION, "epoch": 0, "yielded": 0, "rng": rng_state(generator),
                "fresh": True, "base_seed": None}
    yielded = int(it._num_yielded)
    try:
        finished = yielded >= len(it)
    except TypeError:  # an IterableDataset without __len__
        finished = False
    if finished:  # the next iter() starts the next epoch from the RNG as it is now
        return {"version": VERSION, "epoch": start.epoch + 1, "yielded": 0, "rng": rng_state(generator),
                "fresh": not persistent, "base_seed": start.base_seed}
    return {"version": VERSION, "epoch": start.epoch, "yielded": yielded, "rng": start.rng.clone(),
            "fresh": start.fresh, "base_seed": start.base_seed}


def check_state(state: dict[str, Any]) -> None:
    keys = {"version", "epoch", "yielded", "rng", "fresh", "base_seed"}
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
