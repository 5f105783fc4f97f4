"""``shmloader.install()``: torch's own DataLoader uses the ring, wherever it was built.

Frameworks build their DataLoaders themselves (Accelerate's ``prepare`` and
``skip_first_batches``, transformers' ``Trainer``, Ray Train) from torch's class, so a
subclass cannot reach them. ``install`` replaces ``torch.utils.data.DataLoader._get_iterator``:
from then on every loader with ``num_workers > 0`` whose class uses torch's iterator factory
gets a ring iterator, with the options given to ``install``. Its batches, order, errors and
resume state are those of torch's loader (the parity tests run the same jobs). Left alone:
``num_workers=0`` and classes with an iterator factory of their own (torchdata's
``StatefulDataLoader``); ``shmloader.DataLoader`` keeps its own options.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.utils.data

from ._consume import RingIterator
from ._loader import DataLoader, attach_options, check_options, stats_of
from ._stats import LoaderStats

_TORCH_GET_ITERATOR: Callable[[Any], Any] = torch.utils.data.DataLoader._get_iterator
_options: dict[str, Any] | None = None
# loader -> its latest ring iterator (torch keeps only a persistent one); weak both ways, so a
# loader still pickles and nothing outlives it.
_current: weakref.WeakKeyDictionary[Any, weakref.ref[RingIterator]] = weakref.WeakKeyDictionary()


def install(*, slot_bytes: int | None = None, device: str | torch.device | None = None, device_prefetch: int = 2,
            memory_budget: int | str | None = None, max_worker_restarts: int = 3) -> None:
    """Make every ``torch.utils.data.DataLoader`` with workers carry its batches through a
    shmloader ring, with these options (shmloader.DataLoader's, same meaning and defaults).
    Calling it again replaces the options for loaders iterated from then on."""
    global _options
    check_options(slot_bytes=slot_bytes, device_prefetch=device_prefetch, max_worker_restarts=max_worker_restarts)
    _options = dict(slot_bytes=slot_bytes, device=device, device_prefetch=device_prefetch,
                    memory_budget=memory_budget, max_worker_restarts=max_worker_restarts)
    torch.utils.data.DataLoader._get_iterator = _get_iterator  # type: ignore[method-assign, assignment]


def uninstall() -> None:
    """Give torch's DataLoader its own iterators back (for loaders iterated from then on)."""
    global _options
    _options = None
    torch.utils.data.DataLoader._get_iterator = _TORCH_GET_ITERATOR  # type: ignore[method-assign, assignment]


@contextlib.contextmanager
def installed(**options: Any) -> Iterator[None]:
    """``with shmloader.installed(memory_budget="1GiB"): trainer.train()``: install for a block."""
    install(**options)
    try:
        yield
    finally:
        uninstall()


def is_installed() -> bool:
    return _options is not None


def _get_iterator(loader: Any) -> Any:
    if _options is None or loader.num_workers == 0 or isinstance(loader, DataLoader):
        return _TORCH_GET_ITERATOR(loader)
    if getattr(loader, "_shm_counters", None) is None:
        attach_options(loader, **_options)
    loader.check_worker_number_rationality()
    it = RingIterator(loader)
    _current[loader] = weakref.ref(it)
    return it


def stats(loader: Any) -> LoaderStats:
    """``loader.stats()`` for any loader that uses the ring: a shmloader.DataLoader, or torch's
    (or a framework's subclass of it) iterated under ``install()``."""
    if isinstance(loader, DataLoader):
        return loader.stats()
    if getattr(loader, "_shm_counters", None) is None:
        raise ValueError(
            f"{type(loader).__module__}.{type(loader).__qualname__} has not used a shmloader ring: "
            "build it as shmloader.DataLoader, or call shmloader.install() before it is iterated "
            "(with num_workers > 0)"
        )
    ref = _current.get(loader)
    it = None if ref is None else ref()
    return stats_of(loader, None if it is None or it.shut_down else it)
