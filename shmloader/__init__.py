"""shmloader: a drop-in torch DataLoader over a ring of shared-memory slots.

The public surface is this module; everything else is private, one stage of a
batch's journey per file: shmloader/README.md lists them and what each owns.
"""

import sys as _sys
from typing import TYPE_CHECKING, Any

from torch.utils.data import get_worker_info as get_worker_info

from shmloader._errors import BatchTooLargeError as BatchTooLargeError
from shmloader._errors import CorruptSlotError as CorruptSlotError
from shmloader._errors import MemoryBudgetError as MemoryBudgetError
from shmloader._errors import SharedMemoryFullError as SharedMemoryFullError
from shmloader._errors import SharedMemoryWarning as SharedMemoryWarning
from shmloader._errors import ShmLoaderError as ShmLoaderError
from shmloader._errors import ShmLoaderWarning as ShmLoaderWarning
from shmloader._errors import StateMismatchError as StateMismatchError
from shmloader._errors import WorkerDiedError as WorkerDiedError
from shmloader._errors import WorkerReplacedWarning as WorkerReplacedWarning

if not getattr(_sys, "_is_gil_enabled", lambda: True)():  # (asked once the extensions are imported)
    # A slot goes back to the ring when the lease table holds its base's last reference
    # (Py_REFCNT(base) == 1, read with the GIL held): without a GIL another thread may take or
    # drop a reference meanwhile, and a slot could be rewritten under a batch still in use.
    raise ImportError("shmloader does not support a free-threaded Python without its GIL (PYTHON_GIL=0 "
                      "or -X gil=0): it tells a batch is gone from a reference count the GIL keeps exact. "
                      "Run with the GIL (the default even on a free-threaded build), or use "
                      "torch.utils.data.DataLoader.")

if TYPE_CHECKING:
    from shmloader._install import install as install
    from shmloader._install import installed as installed
    from shmloader._install import stats as stats
    from shmloader._install import uninstall as uninstall
    from shmloader._loader import DataLoader as DataLoader
    from shmloader._share import SharedDict as SharedDict
    from shmloader._share import SharedList as SharedList
    from shmloader._share import share as share
    from shmloader._stats import LoaderStats as LoaderStats
    from shmloader._stats import RingOccupancy as RingOccupancy

# The training process's names are imported on first use: a worker process (spawn, forkserver)
# imports shmloader.worker and this module, and none of shmloader.main
# (tests/unit/test_package_layout.py) unless the user's own module, imported again there to
# find the dataset, asks for them. The loader's module comes with _install, which watches
# the loaders it makes (a framework's torch rebuild of one keeps its options).
_LAZY = {"install": "_install", "installed": "_install", "stats": "_install", "uninstall": "_install",
         "DataLoader": "_install", "SharedDict": "_share", "SharedList": "_share", "share": "_share",
         "LoaderStats": "_stats", "RingOccupancy": "_stats"}


if not TYPE_CHECKING:  # (mypy sees the imports above, and no catch-all: a misspelt name is an error)

    def __getattr__(name: str) -> Any:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'shmloader' has no attribute {name!r}")
        import importlib

        value = getattr(importlib.import_module(f"shmloader.{module}"), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "BatchTooLargeError",
    "CorruptSlotError",
    "DataLoader",
    "LoaderStats",
    "MemoryBudgetError",
    "RingOccupancy",
    "SharedDict",
    "SharedList",
    "SharedMemoryFullError",
    "ShmLoaderError",
    "StateMismatchError",
    "WorkerDiedError",
    "get_worker_info",
    "install",
    "installed",
    "share",
    "stats",
    "uninstall",
]
__version__ = "0.1.0"
