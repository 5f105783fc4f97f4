"""What a worker does with a task: its torch-like setup, and the producer.

``init`` sets a worker up as torch's loader does (one thread, seeds from the base seed and
the worker id, ``get_worker_info()``, ``worker_init_fn``). ``Producer`` turns a task's
index into samples (``dataset[i]``, ``__getitems__``, or the next items of an
IterableDataset's shard) and collates them into a ``SlotWriter`` (``worker.collate``): the default
collate stacks straight into the slot, a custom ``collate_fn``'s result is copied in once.
Its answer is an ``Outcome``: a batch (and the bytes it needs), an end of shard, or the
batch's error. ``WorkerConfig`` is everything a worker gets from the loader.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import signal
from typing import Any, Callable, NamedTuple

import numpy as np
import torch
from torch._utils import ExceptionWrapper
from torch.utils.data._utils import collate as torch_collate
from torch.utils.data._utils import worker as torch_worker
from torch.utils.data.dataloader import _DatasetKind

from shmloader.worker.collate import SlotWriter
from shmloader.wire.layout import Status


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs from the loader (pickled once per worker under spawn)."""

    worker_id: int
    num_workers: int
    dataset: Any
    iterable: bool
    auto_collation: bool
    collate_fn: Callable[[Any], Any]
    drop_last: bool
    base_seed: int
    worker_init_fn: Callable[[int], None] | None
    parent_pid: int
    parent_check_s: float = 0.5  # how often an idle worker checks that the loader lives
    dataset_state: bytes = b""  # a pickled IterableDataset state to load before its first epoch
    # The epoch that state belongs to, for a replaced worker: loaded (with its "shard ended"
    # flag) only if the first task is of that epoch. None: a checkpoint's, loaded as it is.
    dataset_state_epoch: int | None = None


def worker_configs(it: Any, worker_init_fn: Callable[[int], None] | None, base_seed: int, parent_check_s: float,
                   dataset_states: dict[int, bytes]) -> list[WorkerConfig]:
    """One config per worker of ``it`` (a torch ``_BaseDataLoaderIter``: its dataset, collate and
    counts), each resuming an IterableDataset's shard from ``dataset_states`` (a checkpoint's)."""
    return [
        WorkerConfig(
            worker_id=i,
            num_workers=it._num_workers,
            dataset=it._dataset,
            iterable=it._dataset_kind == _DatasetKind.Iterable,
            auto_collation=it._auto_collation,
            collate_fn=it._collate_fn,
            drop_last=it._drop_last,
            base_seed=base_seed,
            worker_init_fn=worker_init_fn,
            parent_pid=os.getpid(),
            parent_check_s=parent_check_s,
            dataset_state=dataset_states.get(i, b""),
        )
        for i in range(it._num_workers)
    ]


class Outcome(NamedTuple):  # one per batch: a tuple is the cheapest to make
    status: Status
    needed: int = 0
    error: ExceptionWrapper | None = None


_OK, _NEED_MEMORY = Status.OK, Status.NEED_MEMORY  # (an enum member lookup costs more than a global's)
_tuple_new = tuple.__new__


def _ok(needed: int) -> Outcome:
    """``Outcome(Status.OK, needed)``, made at tuple speed (one per batch)."""
    return _tuple_new(Outcome, (_OK, needed, None))

def wrap(where: str) -> ExceptionWrapper:
    """torch's wrapper of the exception being handled: the main process re-raises it."""
    return ExceptionWrapper(where=where)  # type: ignore[no-untyped-call]


class Producer:
    """Turns an index into a batch written by a SlotWriter."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.where = f"in DataLoader worker process {cfg.worker_id}"
        self.fused = cfg.auto_collation and cfg.collate_fn is torch_collate.default_collate
        # Map-style, default collate: a batch like the last one stacked into the same slot is
        # stacked in one step (SlotWriter.stack_lone)
        self.lean = self.fused and not cfg.iterable
        self._epoch: int | None = None
        self._iter: Any = None
        self._ended = False
        self.dataset_state = b""

    def _samples(self, epoch: int, index: Any) -> Any:
        ds = self.cfg.dataset
        if not self.cfg.iterable:
            if not self.cfg.auto_collation:
                return ds[index]
            getitems = getattr(ds, "__getitems__", None)
            return getitems(index) if getitems else [ds[i] for i in index]
        if epoch != self._epoch:
            ended = False
            resumed = self.cfg.dataset_state_epoch
            if self._epoch is None and self.cfg.dataset_state and resumed in (None, epoch):
                saved = pickle.loads(self.cfg.dataset_state)  # a checkpoint's, or a dead predecessor's
                ds.load_state_dict(saved["state"])
                ended = resumed == epoch and saved["ended"]
            self._epoch, self._iter, self._ended = epoch, iter(ds), ended
        if self._ended:
            raise StopIteration
        if not self.cfg.auto_collation:
            return next(self._iter)
        data = []
        for _ in index:
            try:
                data.append(next(self._iter))
            except StopIteration:
                self._ended = True
                break
        if not data or (self.cfg.drop_last and len(data) < len(index)):
            raise StopIteration
        return data

    def _dataset_state(self) -> bytes:
        """An IterableDataset's ``state_dict()`` after this batch, and whether its shard ended
        within the batch, pickled (b"" for a dataset without state)."""
        get = getattr(self.cfg.dataset, "state_dict", None) if self.cfg.iterable else None
        return pickle.dumps({"ended": self._ended, "state": get()}) if callable(get) else b""

    def produce(self, epoch: int, index: Any, writer: SlotWriter, fn_map: dict[Any, Any]) -> tuple[Outcome, Any]:
        """Fetch and collate into ``writer``; returns the outcome and the batch object."""
        try:
            samples = self._samples(epoch, index)
            if self.lean and type(samples) is list and samples:
                batch = writer.stack_lone(samples)
                if batch is not None:
                    return _ok(writer.dataset_state_off), batch
            if self.fused:
                # Samples that are plain tensors: the map's tensor entry, as collate() would call it
                stack = fn_map.get(torch.Tensor) if type(samples) is list and samples and type(samples[0]) is torch.Tensor else None
                if stack is not None:
                    batch = stack(samples, collate_fn_map=fn_map)
                else:
                    batch = torch_collate.collate(samples, collate_fn_map=fn_map)
            else:
                batch = self.cfg.collate_fn(samples)
            del samples
            self.dataset_state = self._dataset_state() if self.cfg.iterable else b""
            needed = writer.finish(batch, self.dataset_state)
        except StopIteration:
            if not self.cfg.iterable:
                return Outcome(Status.ERROR, error=wrap(where=self.where)), None
            return Outcome(Status.STOP), None
        except Exception:
            return Outcome(Status.ERROR, error=wrap(where=self.where)), None
        if not writer.fits:
            return Outcome(Status.NEED_MEMORY, needed=needed), batch
        return _ok(needed), batch


def init(cfg: WorkerConfig) -> ExceptionWrapper | None:
    """torch's worker setup: threads, seeds, worker info, worker_init_fn."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    seed = cfg.base_seed + cfg.worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(torch_worker._generate_state(cfg.base_seed, cfg.worker_id))  # type: ignore[no-untyped-call]
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=cfg.worker_id, num_workers=cfg.num_workers, seed=seed, dataset=cfg.dataset
    )
    where = f"in DataLoader worker process {cfg.worker_id}"
    try:
        if cfg.worker_init_fn is not None:
            cfg.worker_init_fn(cfg.worker_id)
    except (StopIteration, SystemExit, KeyboardInterrupt) as exc:
        # Said as what it was, in a RuntimeError: raised as itself from next() it would end the
        # caller's loop in silence (StopIteration), end the main process (SystemExit) or pose as
        # Ctrl-C, where a failed set-up ends the loader.
        if isinstance(exc, StopIteration):
            what = "StopIteration", "a DataLoader worker's set-up cannot end an epoch"
        else:
            code = f"({exc.code!r})" if isinstance(exc, SystemExit) else ""
            what = f"{type(exc).__name__}{code} (sys.exit?)", "a DataLoader worker cannot exit on its own"
        try:
            raise RuntimeError(f"worker_init_fn raised {what[0]} in worker {cfg.worker_id}: {what[1]}; raise "
                               "an exception to report a failed set-up") from exc
        except RuntimeError:
            return wrap(where=where)
    except Exception:
        return wrap(where=where)
    return None
