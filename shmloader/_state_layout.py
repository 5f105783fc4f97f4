"""torchdata's ``StatefulDataLoader`` state dict, written and read in one place.

The layout is torchdata's: with workers ``_snapshot`` (``_snapshot_step``,
``_last_yielded_worker_id``, ``_main_snapshot``, ``_worker_snapshots``), ``_steps_since_snapshot``
and ``_iterator_finished``; with ``num_workers=0`` its single-process keys. ``_shmloader`` holds
what shmloader adds (the epoch, where its RNG was, which tasks an ``in_order=False`` epoch
consumed), all of it what JSON holds. ``state_dict_of`` writes it from an iterator's
``Progress``; ``Plan.of`` reads it back into what a resume needs.
"""

from __future__ import annotations

import base64
import dataclasses
import pickle
from typing import Any

import torch

from shmloader import _torch_private as torch_private

VERSION = 2
OWN = "_shmloader"  # shmloader's part of a state dict
# In a worker's snapshot: taken after that worker's epoch ended (persistent workers, before they
# delivered in the next one): a resume loads it and begins the epoch anew.
EARLIER = "_shmloader_epoch_ended"
_SNAPSHOT, _MAIN, _WORKERS = "_snapshot", "_main_snapshot", "_worker_snapshots"


def encode_rng(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def decode_rng(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


@dataclasses.dataclass
class EpochStart:
    """Recorded when an epoch's iterator starts."""

    epoch: int
    rng: torch.Tensor
    fresh: bool  # a new iterator (new base seed) rather than the persistent one reset
    base_seed: int | None = None


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where an epoch's iterator is, or was at a snapshot. Read from it while it lives, kept
    when it dies (a loop left with ``break`` drops a non-persistent iterator)."""

    consumed: int  # batches yielded, and those that raised (consumed too)
    finished: bool  # its StopIteration was raised
    pulled: int  # batches of indices taken from the sampler so far
    workers: dict[int, bytes]  # worker -> its pickled snapshot (absent: none yet)
    last_worker: int | None  # the worker of the last batch consumed
    sampler_states: tuple[Any, Any] = (None, None)  # a stateful sampler's (iterator, index sampler) states
    below: int = -1  # in_order=False: every task below it consumed (-1: consumed)
    ahead: tuple[int, ...] = ()  # in_order=False: the tasks consumed above ``below``
    in_process: tuple[Any, Any] = (None, None)  # num_workers=0: (dataset_state, fetcher_state)
    ended: frozenset[int] = frozenset()  # workers whose shard ended (an IterableDataset's)
    earlier: frozenset[int] = frozenset()  # workers whose snapshot is of an earlier epoch (persistent workers)
    drained: bool = False  # the sampler ended: a pull after its last batch raised StopIteration


@dataclasses.dataclass(frozen=True)
class Plan:
    """A loaded state, read once: what the next ``iter(loader)`` resumes from."""

    epoch: int
    fresh: bool
    base_seed: int | None
    rng_start: torch.Tensor | None
    rng_now: torch.Tensor | None  # when the state was taken; in a resumed iter(): as iter() found it
    finished: bool
    started: bool  # False: taken before the first iter(), which then draws as a fresh one would
    num_workers: int
    step: int  # batches consumed at the snapshot
    since: int  # consumed after it: produced again and dropped
    pulled: int  # batches the sampler had given when the state was taken (the workers prefetch)
    drained: bool  # ...and whether it had ended then (torch's RandomSampler draws once more at its end)
    below: int  # map-style: the sampler's batches to skip
    ahead: tuple[int, ...]  # in_order=False: tasks above ``below`` already consumed
    sampler_states: tuple[Any, Any]
    workers: dict[int, bytes]  # worker -> pickled snapshot, for its config
    earlier: frozenset[int]  # workers whose snapshot was taken after their epoch ended (they begin this one anew)
    last_worker: int | None
    in_process: tuple[Any, Any]
    foreign: bool  # taken by torchdata's own iterator (no shmloader part)

    @classmethod
    def of(cls, state: dict[str, Any]) -> Plan:
        own = state.get(OWN) or {}
        if own.get("version", VERSION) != VERSION:
            raise ValueError(f"state dict version {own['version']} is not supported (this shmloader writes {VERSION})")
        rng = {k: None if own.get(k) is None else decode_rng(own[k]) for k in ("rng_start", "rng_now")}
        finished = bool(state.get("_iterator_finished", False))
        if _SNAPSHOT in state:
            snap = state[_SNAPSHOT]
            main = snap[_MAIN]
            workers = {int(key.rsplit("_", 1)[1]): pickle.dumps({"dataset_state": sd.get("dataset_state"),
                                                                  "fetcher_state": sd.get("fetcher_state")})
                       for key, sd in snap[_WORKERS].items() if sd and holds_position(sd)}
            earlier = frozenset(int(key.rsplit("_", 1)[1])
                                for key, sd in snap[_WORKERS].items() if sd and sd.get(EARLIER))
            step, num_workers = int(snap["_snapshot_step"]), int(main["_num_workers"])
            last = snap["_last_yielded_worker_id"]
            in_process: tuple[Any, Any] = (None, None)
            since = int(state.get("_steps_since_snapshot", 0))
        elif "_num_yielded" in state:
            main, workers, last, num_workers, earlier = state, {}, None, 0, frozenset()
            step, since = int(state["_num_yielded"]), 0
            in_process = (state.get("dataset_state"), state.get("fetcher_state"))
        else:
            hint = ""
            if {"epoch", "yielded", "rng"} <= set(state):
                hint = " (this one was written by shmloader before 0.2, whose states do not carry over)"
            raise ValueError("not a StatefulDataLoader state dict: expected torchdata's keys "
                             f"('_snapshot', or '_num_yielded' for num_workers=0){hint}")
        return cls(
            epoch=int(own.get("epoch", 0)), fresh=bool(own.get("fresh", True)),
            base_seed=main.get("_base_seed"), rng_start=rng["rng_start"], rng_now=rng["rng_now"],
            finished=finished, started=bool(own.get("started", True)), num_workers=num_workers, step=step, since=since,
            pulled=int(own.get("pulled", 0)), drained=bool(own.get("drained", False)),
            below=int(own.get("below", main.get("_sampler_iter_yielded", step))),
            ahead=tuple(own.get("ahead", ())),
            sampler_states=(main.get("_sampler_iter_state"), main.get("_index_sampler_state")),
            workers=workers, earlier=earlier, last_worker=None if last is None else int(last), in_process=in_process,
            foreign=OWN not in state,
        )

    def done(self, worker: int) -> bool:
        """Whether ``worker``'s snapshot was taken after its epoch ended: it loads it and begins
        the resumed epoch anew (every worker's, for a state taken after the epoch ended)."""
        return self.finished or worker in self.earlier

    def active(self, num_workers: int) -> list[bool]:
        """Workers whose shard goes on: not those whose snapshot says it ended in this epoch."""
        return [self.done(w) or not (w in self.workers and _ended(self.workers[w])) for w in range(num_workers)]


def holds_position(snapshot: dict[str, Any]) -> bool:
    """Whether a worker snapshot holds a position: the dataset's state, or its iterator's."""
    fetcher = snapshot.get("fetcher_state")
    return snapshot.get("dataset_state") is not None or bool(fetcher and fetcher.get("dataset_iter_state") is not None)


def _ended(snapshot: bytes) -> bool:
    fetcher = pickle.loads(snapshot)["fetcher_state"]
    return bool(fetcher and fetcher["fetcher_ended"])


def state_dict_of(loader: Any, start: EpochStart, mark: tuple[Progress, int], now: torch.Tensor,
                  started: bool) -> dict[str, Any]:
    """The state dict of ``loader`` whose epoch began at ``start`` and whose iterator is at ``mark``
    (a progress at a snapshot, and the batches since), with the sampling RNG at ``now``;
    ``started``: its first ``iter()`` was called."""
    progress, since = mark
    num_workers = loader.num_workers
    iterable = torch_private.is_iterable(loader)
    below = progress.consumed if progress.below < 0 else progress.below
    own = {"version": VERSION, "epoch": start.epoch, "fresh": start.fresh, "rng_start": encode_rng(start.rng),
           "rng_now": encode_rng(now), "pulled": 0 if iterable else progress.pulled, "below": below,
           "drained": not iterable and progress.drained,
           "ahead": list(progress.ahead),
           "started": started}
    iter_state, sampler_state = progress.sampler_states
    main = {
        "_sampler_iter_state": iter_state,
        "_index_sampler_state": sampler_state,
        "_sampler_iter_yielded": below,
        "_IterableDataset_len_called": torch_private.len_said(loader),
        "_shared_seed": None,
    }
    if num_workers == 0:
        dataset_state, fetcher_state = progress.in_process
        return {**main, "_num_yielded": progress.consumed, "fetcher_state": fetcher_state,
                "dataset_state": dataset_state, "_iterator_finished": progress.finished, OWN: own}
    last = progress.last_worker
    if last is None:  # (map-style: round-robin from worker 0 at the epoch's start)
        last = (progress.consumed - 1) % num_workers

    def snapshot(w: int) -> dict[str, Any]:
        if w in progress.workers:
            extra = {EARLIER: True} if w in progress.earlier else {}
            return {"worker_id": w, **pickle.loads(progress.workers[w]), **extra}
        # a worker that has carried no snapshot: nothing of its own to save (as torchdata says it)
        fetcher = {"dataset_iter_state": None, "fetcher_ended": w in progress.ended} if iterable else None
        return {"worker_id": w, "dataset_state": None, "fetcher_state": fetcher}

    snapshots = {f"worker_{w}": snapshot(w) for w in range(num_workers)}
    return {
        _SNAPSHOT: {"_snapshot_step": progress.consumed, "_last_yielded_worker_id": last,
                    _MAIN: {"_num_workers": num_workers, **main, "_base_seed": start.base_seed},
                    _WORKERS: snapshots},
        "_steps_since_snapshot": since,
        "_iterator_finished": progress.finished,
        OWN: own,
    }
