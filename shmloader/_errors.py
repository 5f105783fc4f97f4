"""Exceptions shmloader raises itself (errors from user code keep their own types)."""

from __future__ import annotations


class ShmLoaderError(RuntimeError):
    """Base class of shmloader's own errors."""


class BatchTooLargeError(ShmLoaderError, ValueError):
    """No longer raised: a batch larger than a slot takes the overflow path. Kept so that
    code catching it keeps importing."""


class SharedMemoryFullError(ShmLoaderError, MemoryError):
    """The shared-memory filesystem cannot hold the ring."""


class CorruptSlotError(ShmLoaderError):
    """A slot header failed validation; no tensor was built over it."""


class WorkerDiedError(ShmLoaderError):
    """A worker process exited while the loader still needed it."""


class MemoryBudgetError(ShmLoaderError, MemoryError):
    """``memory_budget`` cannot hold one slot per worker, or one batch beside the ring."""
