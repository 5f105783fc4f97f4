"""shmloader: a drop-in torch DataLoader over a ring of shared-memory slots.

The public surface is this module; everything else is private, one stage of a
batch's journey per file: shmloader/README.md lists them and what each owns.
"""

from torch.utils.data import get_worker_info as get_worker_info

from ._errors import BatchTooLargeError as BatchTooLargeError
from ._errors import CorruptSlotError as CorruptSlotError
from ._errors import MemoryBudgetError as MemoryBudgetError
from ._errors import SharedMemoryFullError as SharedMemoryFullError
from ._errors import ShmLoaderError as ShmLoaderError
from ._errors import WorkerDiedError as WorkerDiedError
from ._install import install as install
from ._install import installed as installed
from ._install import stats as stats
from ._install import uninstall as uninstall
from ._loader import DataLoader as DataLoader
from ._share import SharedDict as SharedDict
from ._share import SharedList as SharedList
from ._share import share as share
from ._stats import LoaderStats as LoaderStats
from ._stats import RingOccupancy as RingOccupancy

import sys as _sys

if not getattr(_sys, "_is_gil_enabled", lambda: True)():  # (asked once the extensions are imported)
    # A slot goes back to the ring when the lease table holds its base's last reference
    # (Py_REFCNT(base) == 1, read with the GIL held): without a GIL another thread may take or
    # drop a reference meanwhile, and a slot could be rewritten under a batch still in use.
    raise ImportError("shmloader does not support a free-threaded Python without its GIL (PYTHON_GIL=0 "
                      "or -X gil=0): it tells a batch is gone from a reference count the GIL keeps exact. "
                      "Run with the GIL (the default even on a free-threaded build), or use "
                      "torch.utils.data.DataLoader.")

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
    "WorkerDiedError",
    "get_worker_info",
    "install",
    "installed",
    "share",
    "stats",
    "uninstall",
]
__version__ = "0.1.0"
