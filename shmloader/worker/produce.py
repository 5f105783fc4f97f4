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

from shmloader._torch_private import IteratorParts, numpy_seed, set_worker_info
from shmloader.wire.layout import Status
from shmloader.worker.collate import SlotWriter


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
    # A worker snapshot (``snapshot``'s format) to start from: a checkpoint's, or a dead
    # predecessor's, taken in epoch ``dataset_state_epoch`` (None: whichever comes first). Loaded
    # at the first task: as it is in that epoch; in a later one (the worker had no task in it)
    # as ``dataset_state_done`` says: taken after its epoch ended, so the dataset is loaded and
    # then begins an epoch anew (persistent workers between epochs).
    dataset_state: bytes = b""
    dataset_state_epoch: int | None = None
    dataset_state_done: bool = False


def worker_configs(parts: IteratorParts, worker_init_fn: Callable[[int], None] | None, base_seed: int,
                   parent_check_s: float, snapshots: Callable[[int], tuple[bytes, bool]]) -> list[WorkerConfig]:
    """One config per worker of an iterator (``parts``: its dataset, collate and counts), each
    starting from its snapshot, ``snapshots(w)``: a checkpoint's (b"": none), and whether it was
    taken after that worker's epoch ended."""
    configs = []
    for i in range(parts.num_workers):
        snapshot, done = snapshots(i)
        configs.append(WorkerConfig(
            worker_id=i,
            num_workers=parts.num_workers,
            dataset=parts.dataset,
            iterable=parts.iterable,
            auto_collation=parts.auto_collation,
            collate_fn=parts.collate_fn,
            drop_last=parts.drop_last,
            base_seed=base_seed,
            worker_init_fn=worker_init_fn,
            parent_pid=os.getpid(),
            parent_check_s=parent_check_s,
            dataset_state=snapshot,
            dataset_state_epoch=0,  # (the iterator's first epoch: a worker given no task in it starts anew after)
            dataset_state_done=done,
        ))
    return configs


class Outcome(NamedTuple):  # one per batch: a tuple is the cheapest to make
    status: Status
    needed: int = 0
    error: ExceptionWrapper | None = None


_OK, _NEED_MEMORY = Status.OK, Status.NEED_MEMORY  # (an enum member lookup costs more than a global's)
_tuple_new = tuple.__new__


def _ok(needed: int) -> Outcome:
    """``Outcome(Status.OK, needed)``, made at tuple speed (one per batch)."""
    return _tuple_new(Outcome, (_OK, needed, None))

def has_state(obj: Any) -> bool:
    """torchdata's ``Stateful``: it has ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


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
        # stacked in one step (SlotWriter.restack)
        # (not for a dataset with a state of its own: its snapshot goes with each batch)
        self.lean = self.fused and not cfg.iterable and not has_state(cfg.dataset)
        self._restackable: dict[type, bool] = {}  # samples' type -> whether restack may stack it
        self._epoch: int | None = None
        self._iter: Any = None
        self._ended = False
        self._ds_state = has_state(cfg.dataset)
        self._iter_state = False
        self.dataset_state = b""  # snapshot() after the latest batch or end of shard

    def _samples(self, epoch: int, index: Any) -> Any:
        ds = self.cfg.dataset
        if not self.cfg.iterable:
            if self._epoch is None:
                self._epoch = epoch
                saved = self._saved(epoch)[0]
                if saved is not None and saved["dataset_state"] is not None:
                    ds.load_state_dict(saved["dataset_state"])
            if not self.cfg.auto_collation:
                return ds[index]
            getitems = getattr(ds, "__getitems__", None)
            return getitems(index) if getitems else [ds[i] for i in index]
        if epoch != self._epoch:
            self._begin(epoch)
        if self._ended:
            raise StopIteration
        if not self.cfg.auto_collation:
            try:
                return next(self._iter)
            except StopIteration:
                self._ended = True
                raise
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

    def _saved(self, epoch: int) -> tuple[dict[str, Any] | None, bool]:
        """The snapshot this worker starts from, at its first task, and whether it was taken after
        its epoch ended: so if it is of an earlier epoch than this task's (the worker had no task
        in it: its shard had ended)."""
        cfg = self.cfg
        if not cfg.dataset_state or (cfg.dataset_state_epoch is not None and epoch < cfg.dataset_state_epoch):
            return None, False
        done = cfg.dataset_state_done or (cfg.dataset_state_epoch is not None and epoch > cfg.dataset_state_epoch)
        saved: dict[str, Any] = pickle.loads(cfg.dataset_state)
        return saved, done

    def _begin(self, epoch: int) -> None:
        """An IterableDataset's epoch: ``iter(dataset)``; at the first, from the saved snapshot in
        torchdata's order: the dataset's state, then ``iter()``, then the iterator's state."""
        ds = self.cfg.dataset
        it, ended = None, False
        saved, done = self._saved(epoch) if self._epoch is None else (None, False)
        if saved is not None:
            if saved["dataset_state"] is not None:
                ds.load_state_dict(saved["dataset_state"])
            fetcher = saved["fetcher_state"]
            if fetcher is not None:
                it = iter(ds)
                if fetcher["dataset_iter_state"] is not None and has_state(it):
                    it.load_state_dict(fetcher["dataset_iter_state"])
                ended = bool(fetcher["fetcher_ended"])
            if done:  # that epoch had ended: this one begins anew
                it, ended = None, False
        self._epoch, self._iter, self._ended = epoch, iter(ds) if it is None else it, ended
        self._iter_state = has_state(self._iter)

    def snapshot(self) -> bytes:
        """This worker's dataset after its latest batch (or end of shard), as torchdata's worker
        snapshot: ``{"dataset_state", "fetcher_state": {"dataset_iter_state", "fetcher_ended"}}``
        pickled; b"" for a dataset with no state of its own (nor its iterator). The state is
        stored once: a dataset that is its own iterator has it as the iterator's."""
        ds = self.cfg.dataset
        if not self.cfg.iterable:
            return pickle.dumps({"dataset_state": ds.state_dict(), "fetcher_state": None}) if self._ds_state else b""
        if not (self._ds_state or self._iter_state):
            return b""
        it = self._iter
        fetcher = {"dataset_iter_state": it.state_dict() if self._iter_state else None, "fetcher_ended": self._ended}
        own = self._ds_state and it is not ds
        return pickle.dumps({"dataset_state": ds.state_dict() if own else None, "fetcher_state": fetcher})

    def _restack_type(self, kind: type, fn_map: dict[Any, Any]) -> type | None:
        """``kind`` when the default collate of samples of that type may be stacked again in
        one step (``SlotWriter.restack``): tuples, lists and dicts, which no entry of the
        collate map (a user's) takes over; else None."""
        ok = self._restackable.get(kind)
        if ok is None:
            ok = self._restackable[kind] = kind in (tuple, list, dict) and not any(
                isinstance(t, (type, tuple)) and issubclass(kind, t) for t in fn_map)
        return kind if ok else None

    def produce(self, epoch: int, index: Any, writer: SlotWriter, fn_map: dict[Any, Any]) -> tuple[Outcome, Any]:
        """Fetch and collate into ``writer``; returns the outcome and the batch object."""
        try:
            samples = self._samples(epoch, index)
            writer.samples_type = None
            if self.lean and type(samples) is list and samples:
                batch = writer.restack(samples)
                if batch is not None:
                    return _ok(writer.dataset_state_off), batch
                writer.samples_type = self._restack_type(type(samples[0]), fn_map)
            if self.fused:
                # Samples that are plain tensors: the map's tensor entry, as collate() would call it
                plain = type(samples) is list and samples and type(samples[0]) is torch.Tensor
                stack = fn_map.get(torch.Tensor) if plain else None
                if stack is not None:
                    batch = stack(samples, collate_fn_map=fn_map)
                else:
                    batch = torch_collate.collate(samples, collate_fn_map=fn_map)
            else:
                batch = self.cfg.collate_fn(samples)
            del samples
            self.dataset_state = self.snapshot()
            needed = writer.finish(batch, self.dataset_state)
        except StopIteration:
            if not self.cfg.iterable:
                return Outcome(Status.ERROR, error=wrap(where=self.where)), None
            try:
                self.dataset_state = self.snapshot()  # the shard's end (what a later epoch starts from)
            except Exception:
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
    np.random.seed(numpy_seed(cfg.base_seed, cfg.worker_id))
    set_worker_info(torch_worker.WorkerInfo(id=cfg.worker_id, num_workers=cfg.num_workers, seed=seed,
                                            dataset=cfg.dataset))
    where = f"in DataLoader worker process {cfg.worker_id}"
    try:
        if cfg.worker_init_fn is not None:
            cfg.worker_init_fn(cfg.worker_id)
    except (StopIteration, SystemExit, KeyboardInterrupt) as exc:
        # Said as what it was, in a RuntimeError: raised as itself from next() it would end the
        # caller's loop in silence (StopIteration), end the main process (SystemExit) or pose as
        # Ctrl-C, where a failed set-up fails its worker's batches (worker.loop.FailedInit).
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
