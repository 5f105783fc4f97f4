"""The loader under test for torchdata's rewritten suite: each case runs through all three.

- ``torchdata``: torchdata's own ``StatefulDataLoader`` (the reference: the rewritten case must
  pass on it, or it was rewritten wrong);
- ``shmloader``: ``shmloader.DataLoader``;
- ``installed``: torchdata's ``StatefulDataLoader`` under ``shmloader.install(stateful_dataloader=True)``
  (with ``num_workers=0`` that is torchdata's own in-process iterator).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

import shmloader

LOADERS = ["torchdata", "shmloader", "installed"]


@pytest.fixture(params=LOADERS)
def kind(request: pytest.FixtureRequest) -> str:
    """Which loader: one of LOADERS."""
    return str(request.param)


@pytest.fixture
def SDL(kind: str) -> Iterator[Any]:
    """The loader class under test, called as upstream calls ``StatefulDataLoader``."""
    if kind == "torchdata":
        yield StatefulDataLoader
    elif kind == "shmloader":
        yield shmloader.DataLoader
    else:
        shmloader.install(stateful_dataloader=True)
        try:
            yield StatefulDataLoader
        finally:
            shmloader.uninstall()
