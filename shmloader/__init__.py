"""shmloader: a drop-in torch DataLoader over a ring of shared-memory slots.

The public surface is this module; everything else is private, one stage of a
batch's journey per file (see shmloader/README.md):

    _loader.py    DataLoader facade: torch's arguments, lifecycle, async iteration
    _install.py   install(): torch's own DataLoader (and frameworks' loaders) use the ring
    _consume.py   main-process iterator: start-up, sync/async waits, order, errors
    _dispatch.py  sampler indices -> tasks in free slots, worker choice
    _slots.py     slot states (free / in flight / waiting / ready / lent) and their invariant
    _overflow.py  memory for batches larger than a slot (anonymous memfds), its accounting
    _pool.py      worker processes: start, watch, stop
    _worker.py    worker loop: fetch, collate into the slot, signal
    _collate.py   collate straight into slot memory; leaf pickling
    _lease.py     slot -> batch views, and back to the ring when dropped
    _device.py    page-locking the ring; side-stream copies to a CUDA device
    _budget.py    ring sizing: slot count and size, memory_budget
    _stats.py     telemetry: counters and the stats() snapshot
    _checkpoint.py  state_dict / load_state_dict
    _bench/       the `shmloader bench` command
    _ring.py      the segment, the semaphores inside it, header and queue views
    _layout.py    the byte layout shared by writer and reader
    _shm.py       POSIX shared memory: create, attach, unlink
    _native       C: leaf-table codec (native/_native.c), in-segment semaphores and
                  release/acquire publication (native/_sync.c)
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
from ._stats import LoaderStats as LoaderStats
from ._stats import RingOccupancy as RingOccupancy

__all__ = [
    "BatchTooLargeError",
    "CorruptSlotError",
    "DataLoader",
    "LoaderStats",
    "MemoryBudgetError",
    "RingOccupancy",
    "SharedMemoryFullError",
    "ShmLoaderError",
    "WorkerDiedError",
    "get_worker_info",
    "install",
    "installed",
    "stats",
    "uninstall",
]
__version__ = "0.1.0"
