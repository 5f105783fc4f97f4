"""The device stage: page-locked slots and side-stream transfers to a CUDA device.

Registration: with ``pin_memory=True`` or ``device="cuda..."`` the main process registers
the whole segment with ``cudaHostRegister`` once, right after creating it, so every slot
is pinned where it lies: no pinned bounce copy, no caching host allocator that grows.
The registration is undone while the memory is still mapped, just before it is unmapped
(``wire.shm.Mapping``'s hook: when the last batch viewing it dies, or at ``close()``). If registration fails
(locked-memory limits, an unsupported platform) this warns, saying what was lost, and
copies come from pageable memory.

Delivery (``DeviceStager``): as soon as a slot is ready its tensors are copied with
``non_blocking=True`` on a dedicated side stream, up to ``depth`` batches ahead of the
consumer, with one event per batch. The batch handed out is ordered after its copy on
the consumer's current stream (``wait_event``), and ``record_stream`` keeps the caching
allocator from reusing its memory while that stream may still read it.

Invariant: a slot is returned to the ring only after the event of its copy has
completed, so a worker never rewrites memory a DMA is still reading.
"""

from __future__ import annotations

import collections
import functools
import warnings
from typing import Any

import numpy as np
import torch

from shmloader.main.lease import Where, read_batch
from shmloader.wire.layout import Kind
from shmloader.wire.ring import Ring
from shmloader.wire.shm import Mapping

_REGISTERED: set[int] = set()  # addresses registered by this process and not yet unregistered


def registered() -> frozenset[int]:
    """Host addresses this process has page-locked and not yet released (for tests)."""
    return frozenset(_REGISTERED)


def _unregister(cudart: Any, ptr: int, nbytes: int) -> None:
    """Undo a registration (the memory is still mapped: a ``Mapping``'s hook); an error is
    said, not dropped."""
    _REGISTERED.discard(ptr)
    err = _code(cudart.cudaHostUnregister(ptr))
    if err != 0:
        warnings.warn(
            f"cudaHostUnregister of a {nbytes:,}-byte shmloader mapping failed with CUDA error {err}; "
            "the memory is unmapped next regardless",
            RuntimeWarning,
            stacklevel=2,
        )


def _code(err: Any) -> int:
    return int(getattr(err, "value", err))


def register_host(mm: Mapping, nbytes: int, cudart: Any = None) -> bool:
    """Page-lock ``mm`` in place until it is unmapped. Returns True on success; warns and
    returns False if not."""
    if not isinstance(mm, Mapping):
        raise TypeError("register_host needs a shmloader.wire.shm.Mapping (unregistered before unmapping), "
                        f"not {type(mm).__name__}")
    if cudart is None:
        import torch.cuda

        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    ptr = np.frombuffer(mm, dtype=np.uint8).__array_interface__["data"][0]
    err = _code(cudart.cudaHostRegister(ptr, nbytes, 0))
    if err != 0:
        warnings.warn(
            f"pin_memory=True: cudaHostRegister of the {nbytes:,}-byte shared-memory ring failed "
            f"with CUDA error {err}; batches stay in pageable memory, so host-to-device copies "
            "are synchronous and slower. Check the locked-memory limit (ulimit -l) or pass "
            "pin_memory=False to silence this.",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    _REGISTERED.add(ptr)
    mm.before_unmap(functools.partial(_unregister, cudart, ptr, nbytes))
    return True


def warn_unsupported(device_type: str | None) -> None:
    warnings.warn(
        f"pin_memory=True: shmloader pins its ring only on CUDA, not on {device_type!r}; "
        "batches stay in pageable memory.",
        RuntimeWarning,
        stacklevel=4,
    )


def parse_device(device: Any, num_workers: int) -> torch.device | None:
    """Validate ``DataLoader(device=...)``; None means CPU batches (no device stage)."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError("device should be None, 'cpu', 'cuda', 'cuda:N' or a torch.device, "
                         f"but got device={device!r}") from exc
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        raise ValueError(f"device={device!r}: shmloader delivers to CUDA devices only; "
                         "use device=None and move batches yourself")
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"device={device!r} needs CUDA, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}); pass device=None to receive CPU batches"
        )
    if num_workers == 0:
        raise ValueError(f"device={device!r} needs num_workers > 0 (device delivery overlaps the copy with loading)")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev


class DeviceStager:
    """Copies ready slots to the device on a side stream, ahead of the consumer."""

    def __init__(self, device: torch.device, depth: int) -> None:
        self.device = device
        self.depth = depth
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        # Staged batches in delivery order: (batch, copy event, its device tensors).
        self.staged: collections.deque[tuple[Any, Any, list[torch.Tensor], Any]] = collections.deque()
        # Slots whose copy may still be running, oldest first (one stream: they finish in order).
        self.copying: collections.deque[tuple[Any, int]] = collections.deque()

    def has_room(self) -> bool:
        return len(self.staged) < self.depth

    def stage(self, ring: Ring, slot: int, note: Any = None, where: Where | None = None) -> int:
        """Start the copy of ``slot``'s batch (from ``where`` when it lies in overflow memory,
        which the caller keeps until the slot is reaped; numpy leaves are copied on the host);
        returns its bytes."""
        moved: list[torch.Tensor] = []

        def to_device(leaf: Any, kind: int) -> Any:
            if kind != Kind.TENSOR:
                return leaf.copy()
            # (a copy even to the same device: the slot is reused)
            out = leaf.to(self.device, non_blocking=True, copy=True)
            moved.append(out)
            return out

        with torch.cuda.stream(self.stream):
            batch, _, nbytes = read_batch(ring, slot, to_device, where)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        self.staged.append((batch, event, moved, note))
        self.copying.append((event, slot))
        return nbytes

    def pop(self) -> tuple[Any, Any]:
        """The next staged batch, ordered after its copy on the caller's current stream, and
        the note staged with it."""
        batch, event, moved, note = self.staged.popleft()
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for t in moved:
            t.record_stream(current)
        return batch, note

    def notes(self) -> list[Any]:
        """The notes of the staged batches, in delivery order."""
        return [note for _, _, _, note in self.staged]

    def reap(self, block: bool = False) -> list[int]:
        """Slots whose copies have completed; with ``block``, wait for the oldest first."""
        done: list[int] = []
        while self.copying:
            event, slot = self.copying[0]
            if not event.query():
                if not block or done:
                    break
                event.synchronize()
            self.copying.popleft()
            done.append(slot)
        return done

    def drain(self) -> None:
        """Drop staged batches (a new epoch began) and let every copy finish."""
        self.staged.clear()
        self.stream.synchronize()
