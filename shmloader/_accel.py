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
import warnings
from types import ModuleType

import torch


def load() -> ModuleType | None:
    """The module, or None (said once, in a warning, unless SHMLOADER_NO_TENSORS asked for it)."""
    if os.environ.get("SHMLOADER_NO_TENSORS"):
        return None
    try:
        from shmloader import _tensors
    except ImportError as error:
        why = f"it did not load ({error}); it is built when torch is installed first and shmloader " \
              "after it without build isolation: pip install --no-build-isolation shmloader"
    else:
        if _tensors.TORCH_VERSION == torch.__version__:
            return _tensors
        why = f"it was built for torch {_tensors.TORCH_VERSION}, and torch {torch.__version__} runs: " \
              "reinstall shmloader (pip install --no-build-isolation --force-reinstall shmloader)"
    warnings.warn(f"shmloader runs without its C++ extension shmloader._tensors, so its workers stack samples "
                  f"with torch.stack (up to 20 times the CPU for small samples): {why}. "
                  "SHMLOADER_NO_TENSORS=1 silences this.", RuntimeWarning, stacklevel=2)
    return None


TENSORS = load()
