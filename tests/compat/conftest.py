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

# torchdata's own column proves the rewrite (a case must pass on it): marked ``peer``, it runs in
# ``make peer``, not in the default run, which runs the two ring columns.
LOADERS = [pytest.param("torchdata", marks=pytest.mark.peer), "shmloader", "installed"]


@pytest.fixture(params=LOADERS)
def kind(request: pytest.FixtureRequest) -> str:
    """Which loader: torchdata, shmloader or installed."""
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
