"""The loaders compared side by side. A peer that is not installed is reported, never dropped.

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


def _shmloader(ds: Dataset, bs: int, nw: int, pf: int, budget: str | None, **kw: Any) -> Any:  # type: ignore[type-arg]
    return shmloader.DataLoader(ds, batch_size=bs, num_workers=nw, prefetch_factor=pf, memory_budget=budget, **kw)


def _torch(ds: Dataset, bs: int, nw: int, pf: int, budget: str | None, **kw: Any) -> Any:  # type: ignore[type-arg]
    return torch.utils.data.DataLoader(ds, batch_size=bs, num_workers=nw, prefetch_factor=pf, **kw)


def _spdl(ds: Dataset, bs: int, nw: int, pf: int, budget: str | None, **kw: Any) -> Any:  # type: ignore[type-arg]
    from spdl.dataloader import get_pytorch_dataloader

    kw.pop("persistent_workers", None)  # SPDL keeps its own pipeline alive; it refuses the flag

    return get_pytorch_dataloader(ds, batch_size=bs, num_workers=nw, prefetch_factor=pf, in_order=True, **kw)


def _torchdata(ds: Dataset, bs: int, nw: int, pf: int, budget: str | None, **kw: Any) -> Any:  # type: ignore[type-arg]
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(ds, batch_size=bs, num_workers=nw, prefetch_factor=pf, **kw)


def _dataset(ds: Dataset, bs: int, nw: int, pf: int, budget: str | None, **kw: Any) -> Any:  # type: ignore[type-arg]
    kw.pop("persistent_workers", None)
    return torch.utils.data.DataLoader(ds, batch_size=bs, num_workers=0, **kw)


def _ceiling(ds: Dataset, bs: int, nw: int, pf: int, budget: str | None, **kw: Any) -> Any:  # type: ignore[type-arg]
    from .ceiling import BareRing

    if kw.get("collate_fn") is not None or kw.get("shuffle"):
        raise TypeError("the bare ring stacks fixed-size tensors in order; it has no collate_fn or shuffle")
    return BareRing(ds, bs, nw, pf)


LOADERS: dict[str, Loader] = {
    x.name: x
    for x in [
        Loader("torch", "torch", "torch", _torch),
        Loader("shmloader", "shmloader", "shmloader", _shmloader),
        Loader("spdl", "spdl.dataloader", "spdl", _spdl),
        Loader("torchdata", "torchdata.stateful_dataloader", "torchdata", _torchdata),
        Loader("dataset", "torch", "torch", _dataset),
    ]
}

# ``--ceiling`` (or ``--loaders ceiling``): not run unless asked, as it serves only ready tensors.
CEILING = Loader("ceiling", "posix_ipc", "posix_ipc", _ceiling)
