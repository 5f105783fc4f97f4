"""``shmloader.install()``: torch's own DataLoader uses the ring, wherever it was built.

Frameworks build their DataLoaders themselves (Accelerate's ``prepare`` and
``skip_first_batches``, transformers' ``Trainer``, Ray Train) from torch's class, so a
subclass cannot reach them. ``install`` replaces ``torch.utils.data.DataLoader._get_iterator``:
from then on every loader with ``num_workers > 0`` whose class uses torch's iterator factory
gets a ring iterator, with the options given to ``install``. Its batches, order, errors and
resume state are those of torch's loader (the parity tests run the same jobs). Left alone:
``num_workers=0`` and classes with an iterator factory of their own, unless opted in: with
``stateful_dataloader=True`` torchdata's ``StatefulDataLoader`` (what Accelerate builds with
``use_stateful_dataloader=True``) uses the ring too, and its ``state_dict()`` /
``load_state_dict()`` become shmloader.DataLoader's (same resume semantics). A
``shmloader.DataLoader`` keeps its own options, and so does a framework's rebuild of one
(found through its dataset). Without ``install``, a torch loader with workers over such a
dataset warns once that the ring is not used.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Iterator

import torch
import torch.utils.data

from shmloader import _checkpoint
from shmloader import _torch_private as torch_private
from shmloader._loader import DataLoader, attach_options, check_options, created, stats_of
from shmloader._stats import LoaderStats
from shmloader.main.iterator import RingIterator

_options: dict[str, Any] | None = None
_stateful = False  # install(stateful_dataloader=True): torchdata's StatefulDataLoader opted in
# StatefulDataLoader's own methods, while install(stateful_dataloader=True) replaces them.
_STATEFUL_METHODS = ("_get_iterator", "__iter__", "state_dict", "load_state_dict")
_stateful_own: dict[str, Any] = {}
# id(dataset) -> [weak reference to it, the options of the shmloader.DataLoader built over it,
# warned yet]: a framework's rebuild of that loader (same dataset, torch's class) keeps them
# under install(), or is warned about once. Keyed by identity: a dataset's own __eq__ (a
# tensor's is elementwise) is never called.
_origins: dict[int, list[Any]] = {}
# loader -> its latest ring iterator (torch keeps only a persistent one); weak both ways, so a
# loader still pickles and nothing outlives it.
_current: weakref.WeakKeyDictionary[Any, weakref.ref[RingIterator]] = weakref.WeakKeyDictionary()


def install(*, slot_bytes: int | None = None, device: str | torch.device | None = None, device_prefetch: int = 2,
            memory_budget: int | str | None = None, max_worker_restarts: int = 3,
            stateful_dataloader: bool = False) -> None:
    """Make every ``torch.utils.data.DataLoader`` with workers carry its batches through a
    shmloader ring, with these options (shmloader.DataLoader's, same meaning and defaults).
    ``stateful_dataloader=True`` opts torchdata's ``StatefulDataLoader`` in as well: its
    ``state_dict()`` is then shmloader's (a state taken under torchdata's own iterator is
    refused with a ValueError). Calling it again replaces the options for loaders iterated
    from then on. (Its parameters are shmloader's options, keyword-only, as DataLoader takes
    them.)"""
    global _options
    check_options(slot_bytes=slot_bytes, device_prefetch=device_prefetch, max_worker_restarts=max_worker_restarts)
    _options = dict(slot_bytes=slot_bytes, device=device, device_prefetch=device_prefetch,
                    memory_budget=memory_budget, max_worker_restarts=max_worker_restarts)
    _watch()
    _opt_in_stateful(stateful_dataloader)


def uninstall() -> None:
    """Give torch's DataLoader (and torchdata's StatefulDataLoader) their own iterators back
    (for loaders iterated from then on)."""
    global _options
    _options = None
    _opt_in_stateful(False)
    if not len(_origins):
        torch_private.route_get_iterator(torch_private.TORCH_GET_ITERATOR)


def _opt_in_stateful(on: bool) -> None:
    """Replace (or give back) StatefulDataLoader's iterator factory and state methods."""
    global _stateful
    if on == _stateful:
        return
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        if on:
            raise ImportError("install(stateful_dataloader=True) needs torchdata (pip install torchdata)") from None
        return
    if on:
        _stateful_own.update((name, StatefulDataLoader.__dict__[name]) for name in _STATEFUL_METHODS)
        ours = (_stateful_get_iterator, _stateful_iter, _stateful_state_dict, _stateful_load_state_dict)
        for name, method in zip(_STATEFUL_METHODS, ours):
            setattr(StatefulDataLoader, name, method)
    else:
        for name, method in _stateful_own.items():
            setattr(StatefulDataLoader, name, method)
    _stateful = on


def _carried(loader: Any) -> bool:
    """A StatefulDataLoader that uses the ring: workers, and install(stateful_dataloader=True)
    in force. Its options come from install(), or from the shmloader.DataLoader it rebuilds."""
    if not _stateful or loader.num_workers == 0:
        return False
    if getattr(loader, "_shm_counters", None) is None:
        origin = _origin(loader)
        attach_options(loader, **(origin[1] if origin is not None else _options or {}))
    return True


def _stateful_get_iterator(loader: Any) -> Any:
    return _get_iterator(loader) if _carried(loader) else _stateful_own["_get_iterator"](loader)


def _stateful_iter(loader: Any) -> Any:
    if not _carried(loader):
        return _stateful_own["__iter__"](loader)
    return _checkpoint.begin_epoch(loader, lambda: torch.utils.data.DataLoader.__iter__(loader))


def _stateful_state_dict(loader: Any) -> dict[str, Any]:
    if not _carried(loader):
        return _stateful_own["state_dict"](loader)  # type: ignore[no-any-return]
    return _checkpoint.loader_state(loader)


def _stateful_load_state_dict(loader: Any, state: dict[str, Any]) -> None:
    if not _carried(loader):
        return _stateful_own["load_state_dict"](loader, state)  # type: ignore[no-any-return]
    _checkpoint.load_loader_state(loader, state)


def remember(loader: Any) -> None:
    """Called by shmloader.DataLoader: a framework's torch rebuild of this loader keeps its
    options under install(), and without it says that the ring is lost."""
    dataset = loader.dataset
    key = id(dataset)
    def forget(_: Any, key: int = key) -> None:
        _origins.pop(key, None)

    try:
        ref = weakref.ref(dataset, forget)
    except TypeError:  # a dataset that cannot be weakly referenced (a list): nothing to carry
        return
    options = dict(slot_bytes=loader.slot_bytes, device=loader.device, device_prefetch=loader.device_prefetch,
                   memory_budget=loader.memory_budget, max_worker_restarts=loader.max_worker_restarts)
    _origins[key] = [ref, options, False]
    _watch()


created.append(remember)


def _watch() -> None:
    torch_private.route_get_iterator(_get_iterator)


def _origin(loader: Any) -> list[Any] | None:
    """The registry entry of the shmloader.DataLoader whose dataset ``loader`` reads (directly,
    or wrapped once, as Accelerate wraps an IterableDataset), if any."""
    for dataset in (loader.dataset, getattr(loader.dataset, "dataset", None)):
        entry = _origins.get(id(dataset))
        if entry is not None and entry[0]() is dataset:
            return entry
    return None


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
    if loader.num_workers == 0 or isinstance(loader, DataLoader):
        return torch_private.TORCH_GET_ITERATOR(loader)
    origin = _origin(loader)
    if _options is None:
        if origin is not None and not origin[2]:
            origin[2] = True
            _warn_lost()
        return torch_private.TORCH_GET_ITERATOR(loader)
    if getattr(loader, "_shm_counters", None) is None:
        attach_options(loader, **(origin[1] if origin is not None else _options))
    loader.check_worker_number_rationality()
    it = RingIterator(loader)
    _current[loader] = weakref.ref(it)
    return it


# Where wrappers keep the loader they wrap: Ray Train's prepare_data_loader (``_dataloader``, or
# ``dataloader`` in older Rays), Lightning's and others' (``loader``, ``base_dataloader``...).
_WRAPPED = ("_dataloader", "dataloader", "base_dataloader", "_loader", "loader", "__wrapped__")


def _ring_loader(loader: Any) -> tuple[Any | None, list[Any]]:
    """The loader that used the ring: ``loader``, or the one it wraps (a few levels down), and
    the chain of objects looked at."""
    chain = [loader]
    while len(chain) <= 4:
        current = chain[-1]
        if isinstance(current, DataLoader) or getattr(current, "_shm_counters", None) is not None:
            return current, chain
        inner = next((getattr(current, name) for name in _WRAPPED
                      if getattr(current, name, None) is not None and getattr(current, name) is not current), None)
        if inner is None or any(inner is seen for seen in chain):
            break
        chain.append(inner)
    return None, chain


def stats(loader: Any) -> LoaderStats:
    """``loader.stats()`` for any loader that uses the ring: a shmloader.DataLoader, or torch's
    (or a framework's subclass of it) iterated under ``install()``, or a wrapper of one (Ray
    Train's ``prepare_data_loader``)."""
    found, chain = _ring_loader(loader)
    if isinstance(found, DataLoader):
        return found.stats()
    if found is None:
        names = " wrapping ".join(f"{type(x).__module__}.{type(x).__qualname__}" for x in chain)
        last = chain[-1]
        if isinstance(last, torch.utils.data.DataLoader) and last.num_workers == 0:
            why = "it has num_workers=0, so it loads batches in this process without a ring"
        elif isinstance(last, torch.utils.data.DataLoader):
            why = ("it has not been iterated under shmloader.install() yet: call shmloader.install() before the "
                   "loop starts, or build it as shmloader.DataLoader")
        else:
            why = (f"it is not a DataLoader and keeps none under {', '.join('.' + n for n in _WRAPPED)}: pass the "
                   "DataLoader it wraps")
        raise ValueError(f"{names} has not used a shmloader ring: {why}")
    loader = found
    ref = _current.get(loader)
    it = None if ref is None else ref()
    return stats_of(loader, None if it is None or it.shut_down else it)


def _warn_lost() -> None:
    warnings.warn(
        "a torch DataLoader over the dataset of a shmloader.DataLoader will not use shmloader's ring: "
        "frameworks rebuild loaders this way (Accelerate's prepare and skip_first_batches, transformers' "
        "Trainer). Call shmloader.install() before it is iterated to keep the transport and the "
        "shmloader.DataLoader's options (or ignore this if you built this torch loader yourself).",
        UserWarning,
        stacklevel=3,
    )
