"""Exceptions shmloader raises itself (errors from user code keep their own types)."""

from __future__ import annotations

import os
import pickle
import sys
import warnings
from types import FrameType
from typing import Callable, NoReturn

from torch._utils import ExceptionWrapper

from shmloader import _native


class ShmLoaderError(RuntimeError):
    """Base class of shmloader's own errors."""


class BatchTooLargeError(ShmLoaderError, ValueError):
    """No longer raised: a batch larger than a slot takes the overflow path. Kept so that
    code catching it keeps importing."""


class SharedMemoryFullError(ShmLoaderError, MemoryError):
    """The memory a ring or a batch needs is not there: neither /dev/shm nor a memory file
    (memfd) could hold it (the machine's memory, the cgroup's limit)."""


class ShmLoaderWarning(RuntimeWarning):
    """Base class of shmloader's own warnings."""


class SharedMemoryWarning(ShmLoaderWarning):
    """/dev/shm could not hold a ring (too small, full, read-only, absent): it went to a memory
    file (memfd). Said once per cause in a process."""


class WorkerReplacedWarning(ShmLoaderWarning):
    """A dead worker was replaced and its batches are made again. Made an error (``-W error``),
    it is raised once the replacement is done, and the iterator goes on."""


class CorruptSlotError(ShmLoaderError, ValueError):
    """A slot header failed validation; no tensor was built over it."""


_native.set_corrupt_error(CorruptSlotError)  # what the native codec raises for a torn slot


class WorkerDiedError(ShmLoaderError):
    """A worker process exited while the loader still needed it."""


class MemoryBudgetError(ShmLoaderError, MemoryError):
    """``memory_budget`` cannot hold one slot per worker, or one batch beside the ring."""


class StateMismatchError(ShmLoaderError, ValueError, AssertionError):
    """A state dict this loader cannot resume from (taken with another ``num_workers``). Also an
    AssertionError, the type torchdata's ``StatefulDataLoader`` raises for it."""


class StopCarrier(RuntimeError):
    """A worker's StopIteration (the dataset or collate_fn raised it) on its way out of
    ``next()``: inside the loader it passes generators, which would turn a StopIteration into
    a RuntimeError (PEP 479). For one batch's error ``next()`` raises ``stop`` itself, as
    torch's loader does, so a ``for`` loop ends there; an error that ends the loader leaves as
    this RuntimeError, which names it."""

    def __init__(self, stop: StopIteration) -> None:
        super().__init__(f"a DataLoader worker raised StopIteration: {stop}")
        self.stop = stop


def raise_worker_error(error: ExceptionWrapper, goes_on: Callable[[BaseException], None] | None = None) -> NoReturn:
    """``error.reraise()`` (a worker's ``ExceptionWrapper``) without the reference cycle it
    makes: its finished frame keeps the exception it raised, whose traceback keeps that frame
    and the caller's, so the iterator that raised it (its workers, its ring) would live until
    the garbage collector's next pass, however soon the caller dropped the exception; and
    collected in a cycle, finalizers run in any order. ``goes_on`` is told the exception about
    to be raised when it leaves the loader running (one batch's error)."""
    try:
        error.reraise()  # type: ignore[no-untyped-call]
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        try:
            if tb is not None:
                tb.tb_frame.clear()  # reraise()'s own frame, finished: its locals
        except RuntimeError:
            pass  # raised here, not in reraise() (not an ExceptionWrapper): this frame still runs
        del tb  # (this frame would keep the traceback too)
        if isinstance(exc, StopIteration):
            carrier = StopCarrier(exc)
            if goes_on is not None:
                goes_on(carrier)
            raise carrier from None
        if goes_on is not None:
            goes_on(exc)
        raise
    raise AssertionError("ExceptionWrapper.reraise() returned")


CUT = "\n[... {} characters of the traceback cut so that the error fits its ring slot ...]\n"


def picklable(error: ExceptionWrapper) -> ExceptionWrapper:
    """``error``, made to pickle: an exception class that cannot be pickled (one defined inside
    a function) travels as a RuntimeError whose message names it."""
    try:
        pickle.dumps(error.exc_type)
    except Exception:
        name = f"{error.exc_type.__module__}.{error.exc_type.__qualname__}"
        error.where = f"(raised as {name}, which cannot be pickled) {error.where}"
        error.exc_type = RuntimeError  # the traceback text still ends with the original type and message
    return error


def fit_error(error: ExceptionWrapper, cap: int) -> bytes:
    """``error`` pickled (see ``picklable``) in at most ``cap`` bytes. A traceback too long
    for the slot is cut from the middle: its first line (which worker) and its end (the
    exception's type and message) stay, and the cut says so; sizes are counted in encoded
    bytes, not characters."""
    payload = pickle.dumps(picklable(error))
    if len(payload) <= cap:
        return payload
    text = error.exc_msg
    keep = len(text)
    while keep > 0:
        keep = min(keep - 1, keep * (cap - 256) // max(1, len(payload)))  # shrink at least one character
        head = text[: keep // 4]
        tail = text[len(text) - (keep - keep // 4) :] if keep else ""
        error.exc_msg = head + CUT.format(len(text) - keep) + tail
        payload = pickle.dumps(error)
        if len(payload) <= cap:
            return payload
    error.exc_msg = CUT.format(len(text))
    payload = pickle.dumps(error)
    assert len(payload) <= cap, (len(payload), cap)  # a slot holds at least a page
    return payload


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """warnings.warn's stacklevel, for its caller, that names the first frame outside shmloader
    and torch's loader: the user's line (a loop's ``next``, a loader made)."""
    import torch.utils.data

    torch_data = os.path.dirname(torch.utils.data.__file__) + os.sep
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith((_PACKAGE, torch_data)):
        frame, level = frame.f_back, level + 1
    return level


def warn_iterable_len(dataset: object, said: int, fetched: int) -> None:
    """torch's warning, at the user's line, when an IterableDataset yields more than its
    ``len()`` said (its loader's text with workers)."""
    warnings.warn(
        f"Length of IterableDataset {dataset} was reported to be {said}(when accessing len(dataloader)), but "
        f"{fetched} samples have been fetched. For multiprocessing data-loading, this could be caused by not "
        "properly configuring the IterableDataset replica at each worker. Please see "
        "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for examples.",
        stacklevel=user_stacklevel(),
    )
