"""The loaders compared side by side. A peer that is not installed is reported, never dropped.

``nodes-thread`` and ``nodes-process`` are torchdata.nodes' pipeline, the one PyTorch
recommends past the DataLoader, with its map step in threads or in processes.

Two rows are yardsticks, not peers: ``dataset`` (the dataset and its collate alone, in the
main process: what a batch costs before any loader moves it) and ``ceiling`` (the bare ring
of ``ceiling.py``: the transport with none of the product's features)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Any, Callable

import torch
from torch.utils.data import Dataset

import shmloader
from shmloader.main.depth import DEFAULT


@dataclasses.dataclass(frozen=True)
class Loader:
    name: str
    module: str  # import name checked for availability
    pip: str  # what to install when it is missing
    make: Callable[..., Any]

    def available(self) -> bool:
        try:
            __import__(self.module)
        except ImportError:
            return False
        return True

    def version(self) -> str:
        dist = {"shmloader": "shmloader", "torch": "torch", "spdl.dataloader": "spdl",
                "torchdata.stateful_dataloader": "torchdata", "torchdata.nodes": "torchdata",
                "posix_ipc": "posix_ipc"}[self.module]
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "?"


def given(pf: int | None) -> dict[str, Any]:
    """``prefetch_factor=pf`` for a loader, or nothing (its own default: torch's 2, shmloader's
    depth that adapts) when ``--prefetch-factor`` was not given."""
    return {} if pf is None else {"prefetch_factor": pf}


def _shmloader(ds: Dataset, bs: int, nw: int, pf: int | None, budget: str | None, **kw: Any) -> Any:  # type: ignore[type-arg]
    return shmloader.DataLoader(ds, batch_size=bs, num_workers=nw, memory_budget=budget, **given(pf), **kw)


def _torch(ds: Dataset, bs: int, nw: int, pf: int | None, budget: str | None, **kw: Any) -> Any:  # type: ignore[type-arg]
    return torch.utils.data.DataLoader(ds, batch_size=bs, num_workers=nw, **given(pf), **kw)


def _spdl(ds: Dataset, bs: int, nw: int, pf: int | None, budget: str | None, **kw: Any) -> Any:  # type: ignore[type-arg]
    from spdl.dataloader import get_pytorch_dataloader

    kw.pop("persistent_workers", None)  # SPDL keeps its own pipeline alive; it refuses the flag

    return get_pytorch_dataloader(ds, batch_size=bs, num_workers=nw, prefetch_factor=pf or DEFAULT, in_order=True, **kw)


def _torchdata(ds: Dataset, bs: int, nw: int, pf: int | None, budget: str | None, **kw: Any) -> Any:  # type: ignore[type-arg]
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(ds, batch_size=bs, num_workers=nw, **given(pf), **kw)


class _FetchAndCollate:
    """torchdata.nodes' map function: a batch's indices to its collated batch (picklable, for
    the process mode)."""

    def __init__(self, dataset: Any, collate_fn: Callable[[Any], Any] | None) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn or torch.utils.data.default_collate

    def __call__(self, indices: list[int]) -> Any:
        return self.collate_fn([self.dataset[i] for i in indices])


class _Nodes:
    """torchdata.nodes' recommended pipeline past the DataLoader: SamplerWrapper → Batcher →
    ParallelMapper (threads or processes) → Prefetcher → Loader, one epoch per ``iter()``."""

    def __init__(self, ds: Any, bs: int, nw: int, pf: int | None, method: str, collate_fn: Callable[[Any], Any] | None,
                 shuffle: bool, generator: torch.Generator | None) -> None:
        from torchdata import nodes

        sampler: Any = (torch.utils.data.RandomSampler(ds, generator=generator) if shuffle
                        else torch.utils.data.SequentialSampler(ds))
        node: Any = nodes.Batcher(nodes.SamplerWrapper(sampler), batch_size=bs, drop_last=False)
        node = nodes.ParallelMapper(node, _FetchAndCollate(ds, collate_fn), num_workers=nw, in_order=True,
                                    method=method)  # type: ignore[arg-type]
        self.root = nodes.Prefetcher(node, prefetch_factor=pf or DEFAULT)
        self.loader = nodes.Loader(self.root)

    def __iter__(self) -> Any:
        return iter(self.loader)

    def close(self) -> None:
        """Stop the prefetch thread and the mapper's threads or processes (each node's iterator
        owns them)."""
        for node in (self.root, self.root.source):
            it = getattr(node, "_it", None)
            while it is not None:  # (ParallelMapper's iterator is a node with an iterator of its own)
                shutdown = getattr(it, "_shutdown", None)
                if shutdown is not None:
                    shutdown()
                it = getattr(it, "_it", None)


def _nodes(method: str) -> Callable[..., Any]:
    def make(ds: Dataset, bs: int, nw: int, pf: int | None, budget: str | None, **kw: Any) -> Any:  # type: ignore[type-arg]
        return _Nodes(ds, bs, nw, pf, method, kw.get("collate_fn"), kw.get("shuffle", False), kw.get("generator"))

    return make


def _dataset(ds: Dataset, bs: int, nw: int, pf: int | None, budget: str | None, **kw: Any) -> Any:  # type: ignore[type-arg]
    kw.pop("persistent_workers", None)
    return torch.utils.data.DataLoader(ds, batch_size=bs, num_workers=0, **kw)


def _ceiling(ds: Dataset, bs: int, nw: int, pf: int | None, budget: str | None, **kw: Any) -> Any:  # type: ignore[type-arg]
    from .ceiling import BareRing

    if kw.get("collate_fn") is not None or kw.get("shuffle"):
        raise TypeError("the bare ring stacks fixed-size tensors in order; it has no collate_fn or shuffle")
    return BareRing(ds, bs, nw, pf or DEFAULT)


LOADERS: dict[str, Loader] = {
    x.name: x
    for x in [
        Loader("torch", "torch", "torch", _torch),
        Loader("shmloader", "shmloader", "shmloader", _shmloader),
        Loader("spdl", "spdl.dataloader", "spdl", _spdl),
        Loader("torchdata", "torchdata.stateful_dataloader", "torchdata", _torchdata),
        Loader("nodes-thread", "torchdata.nodes", "torchdata", _nodes("thread")),
        Loader("nodes-process", "torchdata.nodes", "torchdata", _nodes("process")),
        Loader("dataset", "torch", "torch", _dataset),
    ]
}

# ``--ceiling`` (or ``--loaders ceiling``): not run unless asked, as it serves only ready tensors.
CEILING = Loader("ceiling", "posix_ipc", "posix_ipc", _ceiling)
