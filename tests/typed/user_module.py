"""A small, fully typed user module: `make test` checks it with mypy --strict against
shmloader, as a user's CI would (DataLoader[T] in annotations and as a base class)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

import shmloader


class Pairs(Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.tensor([i]), "y": torch.tensor([2 * i])}


class PairLoader(shmloader.DataLoader[dict[str, torch.Tensor]]):
    """A user's own loader class, built on shmloader's."""


def make_loader(workers: int) -> shmloader.DataLoader[dict[str, torch.Tensor]]:
    return PairLoader(Pairs(), batch_size=4, num_workers=workers)


def total(loader: shmloader.DataLoader[Any]) -> int:
    return sum(int(batch["x"].sum()) for batch in loader)


def stats_line(loader: shmloader.DataLoader[Any]) -> str:
    stats: shmloader.LoaderStats = loader.stats()
    return f"{stats.batches} batches, {stats.overflow_batches} overflowed"
