"""The iterator of a loader with ``num_workers=0``: torch's in-process iterator, resumable.

``InProcessIterator`` is torch's ``_SingleProcessDataLoaderIter`` (the same batches, made in
this process) that also says where it is for a checkpoint and starts where a loaded state
says, in torchdata's order (``_checkpoint``'s NOTE): the sampler, the RNG, then the dataset's
state, ``iter(dataset)`` once, and its iterator's state.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.utils.data.graph_settings
from torch.utils.data import IterDataPipe, MapDataPipe
from torch.utils.data.dataloader import _BaseDataLoaderIter, _SingleProcessDataLoaderIter

from shmloader import _checkpoint, _sampler_position, _state_layout
from shmloader import _torch_private as torch_private
from shmloader.worker.produce import has_state


class InProcessIterator(_SingleProcessDataLoaderIter):
    def __init__(self, loader: Any) -> None:
        _BaseDataLoaderIter.__init__(self, loader)  # (torch's own __init__ would call iter(dataset) now)
        if self._timeout != 0:
            raise AssertionError("_SingleProcessDataLoaderIter requires timeout == 0")
        if isinstance(self._dataset, (IterDataPipe, MapDataPipe)):  # torch's: distributed sharding
            torch.utils.data.graph_settings.apply_sharding(self._dataset, self._world_size, self._rank)
        self._iterable = torch_private.is_iterable(self)
        self._pulled = 0  # batches of indices taken from the sampler
        self.finished = False  # StopIteration was raised
        # (a state taken after its epoch ended was carried into the next one before: no plan then)
        plan: _state_layout.Plan | None = loader._shm_resume_plan
        # What a resume replays (the dataset makes batches again: they draw from this process's RNG)
        # puts the RNG back once it is done (_checkpoint calls after_replay), else at once.
        self.after_replay: Callable[[], None] | None = None
        if plan is not None:
            put_back = _checkpoint.resume_rng(loader, plan)
            if _checkpoint.replayed(plan, self._dataset, self._iterable):
                self.after_replay = put_back
            self._sampler_iter = _sampler_position.position(self._index_sampler, self._sampler_iter, plan,
                                                            self._iterable, None if self.after_replay else put_back)
            self._num_yielded = plan.step if _checkpoint.plan_keeps_position(plan, self._dataset, self._iterable) else 0
            self._pulled = plan.below
        dataset_state, fetcher_state = (None, None) if plan is None else plan.in_process
        dataset: Any = self._dataset
        if dataset_state is not None and has_state(dataset):
            dataset.load_state_dict(dataset_state)  # before iter(dataset), which the fetcher calls
        self._dataset_fetcher = torch_private.create_fetcher(self, dataset)
        if self._iterable and fetcher_state is not None:
            fetcher = self._dataset_fetcher
            it = fetcher.dataset_iter
            if fetcher_state["dataset_iter_state"] is not None and has_state(it):
                it.load_state_dict(fetcher_state["dataset_iter_state"])
            fetcher.ended = bool(fetcher_state["fetcher_ended"])

    def _next_index(self) -> Any:
        index = next(self._sampler_iter)  # may raise StopIteration
        self._pulled += 1
        return index

    def __next__(self) -> Any:
        try:
            data = super().__next__()
        except StopIteration:
            self.finished = True
            raise
        return data

    def progress(self) -> _state_layout.Progress:
        fetcher = self._dataset_fetcher
        dataset = self._dataset
        if self._iterable:
            it = fetcher.dataset_iter
            fetcher_state = {"dataset_iter_state": _sampler_position.state_of(it), "fetcher_ended": bool(fetcher.ended)}
            dataset_state = _sampler_position.state_of(dataset) if it is not dataset else None
        else:
            fetcher_state, dataset_state = None, _sampler_position.state_of(dataset)
        return _state_layout.Progress(
            self._num_yielded, self.finished, self._pulled, {}, None,
            (_sampler_position.state_of(self._sampler_iter), _sampler_position.state_of(self._index_sampler)),
            in_process=(dataset_state, fetcher_state))

    def checkpoint(self) -> tuple[_state_layout.Progress, int]:
        """As torchdata's in-process iterator: always its progress now (snapshot_every_n_steps is
        the workers')."""
        return self.progress(), 0
