"""torch's private DataLoader attributes, read here and nowhere else.

shmloader's iterators inherit torch's (``_BaseDataLoaderIter``) and its ``DataLoader`` inherits
torch's, so inside those classes ``self._x`` is their own state. Everything else that needs one
of torch's private attributes (of a loader, or of an iterator it is handed) reads it through a
function here, so a torch release that renames one breaks this module alone, and the layout
test (``tests/unit/test_package_layout.py``) finds any read elsewhere.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch.utils.data
from torch.utils.data._utils import worker as torch_worker
from torch.utils.data.dataloader import _BaseDataLoaderIter, _DatasetKind

# torch's own DataLoader._get_iterator, where install() routes every loader's iterator through
TORCH_GET_ITERATOR: Callable[[Any], Any] = torch.utils.data.DataLoader._get_iterator


def route_get_iterator(get_iterator: Callable[[Any], Any]) -> None:
    """Make ``get_iterator`` torch's DataLoader's ``_get_iterator`` (``TORCH_GET_ITERATOR``: its own)."""
    torch.utils.data.DataLoader._get_iterator = get_iterator  # type: ignore[method-assign, assignment]


class IteratorParts(NamedTuple):
    """What a worker of an iterator is built from: torch's iterator's view of its loader."""

    num_workers: int
    dataset: Any
    iterable: bool  # an IterableDataset (torch's _DatasetKind.Iterable)
    auto_collation: bool  # batches of indices (a batch_sampler), not single indices
    collate_fn: Callable[[Any], Any]
    drop_last: bool


def iterator_parts(it: _BaseDataLoaderIter) -> IteratorParts:
    return IteratorParts(it._num_workers, it._dataset, it._dataset_kind == _DatasetKind.Iterable,
                         it._auto_collation, it._collate_fn, it._drop_last)


def is_iterable(loader: Any) -> bool:
    """Whether ``loader`` (torch's DataLoader or an iterator of one) reads an IterableDataset."""
    return bool(loader._dataset_kind == _DatasetKind.Iterable)


def create_fetcher(it: _BaseDataLoaderIter, dataset: Any) -> Any:
    """torch's in-process fetcher of ``dataset`` for iterator ``it`` (``_DatasetKind.create_fetcher``)."""
    return _DatasetKind.create_fetcher(  # type: ignore[no-untyped-call]
        it._dataset_kind, dataset, it._auto_collation, it._collate_fn, it._drop_last)


def index_sampler(loader: Any) -> Any:
    """The sampler ``loader``'s iterators draw batches (or single indices) from."""
    return loader._index_sampler


def len_said(loader: Any) -> int | None:
    """The ``len(loader)`` an IterableDataset's loader answered, if it was asked (torch warns when
    more batches come)."""
    said: int | None = loader._IterableDataset_len_called
    return said


def base_seed(it: Any) -> int | None:
    """The base seed an iterator drew for its workers (None: not one of torch's)."""
    seed: int | None = getattr(it, "_base_seed", None)
    return seed


def kept_iterator(loader: Any) -> Any:
    """The iterator ``loader`` keeps (persistent workers), or None (also for a loader that is not
    torch's: the benchmark's peers)."""
    return getattr(loader, "_iterator", None)


def keep_iterator(loader: Any, it: Any) -> None:
    loader._iterator = it


def numpy_seed(base_seed: int, worker_id: int) -> list[int]:
    """The seed torch's worker gives numpy's global RNG (``_generate_state``)."""
    state: list[int] = torch_worker._generate_state(base_seed, worker_id)  # type: ignore[no-untyped-call]
    return state


def set_worker_info(info: Any) -> None:
    """What ``torch.utils.data.get_worker_info()`` answers in this worker process."""
    torch_worker._worker_info = info


def shutdown_workers(it: Any) -> None:
    """Stop the workers of ``it``, one of torch's multiprocess iterators (or ours), if it has any."""
    stop = getattr(it, "_shutdown_workers", None)
    if stop is not None:
        stop()
