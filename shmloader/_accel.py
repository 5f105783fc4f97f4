"""The C++ extension ``shmloader._tensors`` (``native/_tensors.cpp``), when it is there for the
torch that runs.

It is built where torch is importable at build time (``make`` installs torch first and builds
without isolation) and records the torch version it was built against; built for another
torch, or not built, it is not used, and torch's own functions do its work: ``torch.stack``
for ``stack_into`` (about twenty times the cost for a batch of small samples) and
``torch.from_numpy`` for ``from_array``. ``SHMLOADER_NO_TENSORS=1`` in the environment leaves it
unused too (to compare, or to rule it out), in the workers as in the main process.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch


def load() -> ModuleType | None:
    if os.environ.get("SHMLOADER_NO_TENSORS"):
        return None
    try:
        from . import _tensors
    except ImportError:
        return None
    return _tensors if _tensors.TORCH_VERSION == torch.__version__ else None


TENSORS = load()
