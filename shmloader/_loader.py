"""The DataLoader facade: torch's arguments and lifecycle, wired to the ring.

``DataLoader`` subclasses ``torch.utils.data.DataLoader``: the constructor, its
defaults and validation, samplers, ``len()`` and persistent-worker bookkeeping are
torch's own. Only the multi-process iterator is replaced (``_get_iterator``), and
``async for`` is added.
"""

from __future__ import annotations

import weakref
from typing import Any, AsyncIterator, Callable, TypeVar

import torch
import torch.utils.data

from shmloader import _accel, _checkpoint, _state_layout
from shmloader._stats import Counters, LoaderStats
from shmloader.main import device as _device
from shmloader.main.budget import parse_size
from shmloader.main.depth import DEFAULT, Depth
from shmloader.main.inprocess import InProcessIterator
from shmloader.main.iterator import RingIterator
from shmloader.main.overflow import LoaderMemory


def check_options(*, slot_bytes: int | None, device_prefetch: int, max_worker_restarts: int) -> None:
    """Validate the options shmloader adds to torch's (the same errors from every entry point)."""
    if not isinstance(max_worker_restarts, int) or max_worker_restarts < 0:
        raise ValueError(f"max_worker_restarts should be a non-negative int, but got {max_worker_restarts!r}")
    if not isinstance(device_prefetch, int) or device_prefetch < 1:
        raise ValueError(f"device_prefetch should be a positive int, but got device_prefetch={device_prefetch!r}")
    if slot_bytes is not None and (not isinstance(slot_bytes, int) or slot_bytes <= 0):
        raise ValueError(f"slot_bytes should be a positive int, but got slot_bytes={slot_bytes!r}")


def attach_options(loader: Any, *, slot_bytes: int | None = None, device: str | torch.device | None = None,
                   device_prefetch: int = 2, memory_budget: int | str | None = None,
                   max_worker_restarts: int = 3, prefetch_given: bool = True) -> None:
    """Give ``loader`` (a shmloader.DataLoader, or torch's own under ``shmloader.install()``)
    shmloader's options as attributes (public ones, so frameworks that re-create a loader from
    its attributes keep them) and what its ring iterators read and write. (Its parameters are
    shmloader's options, keyword-only, as DataLoader takes them, and whether ``prefetch_factor``
    was given: without it the depth adapts, ``main.depth``. torch's own loader under install()
    cannot say, and keeps torch's meaning.)"""
    check_options(slot_bytes=slot_bytes, device_prefetch=device_prefetch, max_worker_restarts=max_worker_restarts)
    if loader.num_workers > 0:
        _accel.warn_if_off()  # (its workers would stack with torch.stack: said once, at the user's line)
    loader.slot_bytes = slot_bytes
    loader.memory_budget = memory_budget
    loader.max_worker_restarts = max_worker_restarts
    loader._shm_memory_budget = None if memory_budget is None else parse_size(memory_budget)
    loader._shm_counters = Counters()
    loader._shm_memory = LoaderMemory()  # every byte of shared memory the loader's iterators map
    # batches in flight per worker
    loader._shm_depth = Depth(loader.prefetch_factor or DEFAULT, prefetch_given, loader._shm_memory_budget)
    loader.device = device
    loader.device_prefetch = device_prefetch
    loader._shm_device = _device.parse_device(device, loader.num_workers)
    loader._shm_resume_seed = None  # read by RingIterator
    loader._shm_resume_plan = None  # read by the epoch's new iterator (RingIterator, InProcessIterator)
    loader._shm_epoch_start = None  # _checkpoint's: where the current epoch began
    loader._shm_resume = None  # _checkpoint's: the state the next iter() resumes from


def stats_of(loader: Any, it: Any) -> LoaderStats:
    """The ``LoaderStats`` of a loader that uses the ring, with ``it`` its live iterator (or None)."""
    c = loader._shm_counters
    return LoaderStats(
        batches=c.batches,
        bytes=c.bytes,
        wait_s=c.wait_s,
        blocked_s=c.blocked_s,
        compute_s=c.compute_s,
        copies=c.copies,
        worker_restarts=c.worker_restarts,
        overflow_batches=c.overflow_batches,
        ring_growths=c.ring_growths,
        worker_busy=() if it is None else it.worker_busy(),
        ring=None if it is None else it.occupancy(),
        depth=loader._shm_depth.now if loader.num_workers else 0,
        depth_why=loader._shm_depth.why if loader.num_workers else "num_workers=0: batches are made in the loop",
    )


T_co = TypeVar("T_co", covariant=True)
# Called with every shmloader.DataLoader made: _install's remember (a framework's torch rebuild
# of the loader keeps its options under install()). Filled in by _install, which imports this
# module and not the other way round.
created: list[Callable[[Any], None]] = []


class DataLoader(torch.utils.data.DataLoader[T_co]):
    """A drop-in ``torch.utils.data.DataLoader`` whose workers write batches into
    preallocated shared-memory slots.

    Every argument of torch's DataLoader is accepted with the same default and
    validation. With ``num_workers=0`` it is torch's loader. With workers, batches are
    views of a ring of ``num_workers * prefetch_factor + 1`` slots (the prefetched batches
    and the one in the caller's hands); a slot returns to the
    ring when the batch's last tensor is dropped, or at once with :meth:`release`. Without
    ``prefetch_factor`` the depth adapts: torch's 2 to start with, deeper for small batches
    while the loop waits on idle workers, each wait a scheduler's (beside CPU-bound neighbours;
    ``stats().depth`` and ``depth_why``).

    Args beyond torch's:
        snapshot_every_n_steps: torchdata's ``StatefulDataLoader`` option, with its meaning: a
            ``state_dict()`` is the snapshot at the latest multiple of n batches plus the count of
            batches since, which a resume produces again and drops. Default 1 (exact, nothing
            produced again). 0 or None: only the epoch's start is a snapshot. With
            ``in_order=False`` the state is always taken at once.
        slot_bytes: a hint for the bytes of one slot's data region. By default slots fit the
            first batch exactly (rounded up to a page). A batch that does not fit a slot is
            still delivered, zero-copy, through overflow shared memory, and the ring then grows
            its slots once it drains, so no batch fails for its size; set it only to skip the
            first growths when you know later batches are larger.
        device: ``"cuda"``, ``"cuda:1"`` or a ``torch.device`` to receive batches already on
            that GPU: the ring is page-locked in place and each ready slot is copied on a side
            stream ahead of the consumer; the batch is ordered after its copy on your current
            stream. ``None`` or ``"cpu"``: CPU batches. Needs ``num_workers > 0``.
        device_prefetch: how many batches may sit on the device ahead of the consumer
            (bounds the GPU memory used beyond the batches you hold). Default 2.
        memory_budget: bytes (or a string such as ``"512MiB"``, ``"2GiB"``) of shared memory
            the loader may use: the ring plus the overflow memory of batches that do not fit a
            slot. The ring is sized to fit with room beside it for one overflow batch (fewer
            slots first, down to one per worker; below that only beside memory the loader
            already holds: a batch a loop holds into the next epoch, another live iterator's
            ring, overflow memory); a worker whose
            oversized batch finds no room waits until held batches are dropped; when only the
            batches the caller holds could make room for the batch it waits for, that batch
            comes as a pickled copy. A batch that fits a slot never fails: held ones are copied
            when the budget has no room for memory of their own. ``MemoryBudgetError`` at the
            first batch when one slot per worker cannot hold it (with the size that would), or
            when one batch is larger than the budget leaves beside the ring. It bounds the shared
            memory of the loader and its workers, not the workers' own Python and dataset memory,
            nor the copies of held batches (the training process's own).
        max_worker_restarts: how many dead workers (SIGKILL, OOM killer, a crash in C) the
            loader replaces over its lifetime, dispatching their tasks again so every batch
            still arrives exactly once and in order; one more death raises
            ``WorkerDiedError``. Default 3. Works under every start method; an
            IterableDataset needs ``state_dict()``/``load_state_dict()`` (the replacement
            resumes its shard from the state after its predecessor's last kept batch).
    """

    # Set by attach_options (shared with torch's loaders under install()); read by RingIterator.
    slot_bytes: int | None
    memory_budget: int | str | None
    max_worker_restarts: int
    device: str | torch.device | None
    device_prefetch: int
    _shm_depth: Depth
    _shm_resume_seed: tuple[int, torch.Tensor] | None
    _shm_resume_plan: _state_layout.Plan | None
    _shm_epoch_start: _state_layout.EpochStart | None
    _shm_resume: dict[str, Any] | None

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Any = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Any = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        snapshot_every_n_steps: int | None = 1,
        slot_bytes: int | None = None,
        device: str | torch.device | None = None,
        device_prefetch: int = 2,
        memory_budget: int | str | None = None,
        max_worker_restarts: int = 3,
    ) -> None:
        """torch's DataLoader arguments, names and defaults as torch has them, then shmloader's
        options, keyword-only (README, "Features"). (As many parameters as torch's: drop-in.)"""
        super().__init__(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        _checkpoint.check_snapshot_every(snapshot_every_n_steps)
        self.snapshot_every_n_steps = snapshot_every_n_steps
        attach_options(self, slot_bytes=slot_bytes, device=device, device_prefetch=device_prefetch,
                       memory_budget=memory_budget, max_worker_restarts=max_worker_restarts,
                       prefetch_given=prefetch_factor is not None)
        self._shm_iterators: weakref.WeakSet[RingIterator] = weakref.WeakSet()
        for watch in created:
            watch(self)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle and deepcopy as torch's loader does: every setting; a live iterator refuses
        (as torch's does), and the weak references to this loader's iterators are not data."""
        state = self.__dict__.copy()
        state["_shm_iterators"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._shm_iterators = weakref.WeakSet()

    def _get_iterator(self) -> Any:
        if self.num_workers == 0:
            return InProcessIterator(self)
        self.check_worker_number_rationality()
        it = RingIterator(self)
        self._shm_iterators.add(it)
        return it

    def __iter__(self) -> Any:
        return _checkpoint.begin_epoch(self, super().__iter__)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is, as torchdata's ``StatefulDataLoader`` says it (same layout and
        meaning): load it into a fresh loader (same dataset and arguments) to continue with
        exactly the remaining batches of the epoch, then the following epochs. Cheap: the
        workers are not paused and nothing is loaded. What shmloader adds is what JSON holds;
        the dataset's, its iterator's and a stateful sampler's own states are stored as made."""
        return _checkpoint.loader_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``iter(loader)`` continue from ``state`` (see ``state_dict``)."""
        _checkpoint.load_loader_state(self, state)

    def __aiter__(self) -> AsyncIterator[Any]:
        """``async for batch in loader``: waits on the running event loop, never blocks it
        while workers produce (with ``num_workers=0`` batches are made inline)."""
        it = iter(self)
        if isinstance(it, RingIterator):
            return it
        return _InlineAsync(it)

    def stats(self) -> LoaderStats:
        """A snapshot of what the loader has done since it was created (see LoaderStats). The
        counters are the loader's; ``ring`` and ``worker_busy`` describe the iterator of the
        latest ``iter(loader)`` while its workers run (None and () otherwise)."""
        it = _checkpoint.current_iterator(self)
        return stats_of(self, it if isinstance(it, RingIterator) and not it.shut_down else None)

    def release(self, batch: Any) -> int:
        """Return the ring slots that ``batch`` views, now, without waiting for its
        tensors to be dropped. The batch's tensors must not be read afterwards: a later
        batch will be written over them. Returns the number of slots released."""
        return sum(it.release(batch) for it in list(self._shm_iterators))


class _InlineAsync:
    def __init__(self, it: Any) -> None:
        self._it = it

    def __aiter__(self) -> _InlineAsync:
        return self

    async def __anext__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            raise StopAsyncIteration from None


# Its public home: a pickled loader is found as shmloader.DataLoader, which imports _install with
# it (the created hooks), in whichever process unpickles it.
DataLoader.__module__ = "shmloader"
