"""A bare slot ring: the floor of any loader that moves batches through shared memory.

What every such loader must do and nothing more: forked workers make each batch of a
``DataLoader``-style dataset (in order, batch ``k`` by worker ``k % W``, as torch's round robin)
straight into a slot of one shared-memory segment, say so in the slot's header and post one
semaphore; the loop waits on it for the batch it wants, builds views of the slot and hands
them over; the slot goes back to its worker when the loop asks for the next batch. No leases,
no checkpoints, no error handling, no depth, no overflow: a batch that does not fit in a slot
is a crash. ``bench/dataset_limit.py``'s ``bare ring`` row runs it beside the product, so that
what the product costs above this floor is measured, not guessed.

A batch of the default collate (samples of tensors, or tuples of them) is stacked into the slot
column by column (``torch.stack(out=)``), as shmloader's workers do (a column of numbers is
collated by torch and copied in); any other ``collate_fn``'s tensors (it returns a dict) are
copied into the slot (the one copy a multi-process loader makes of what a ``collate_fn``
allocates) and whatever else it returns is pickled after them. A worker's error (a batch larger
than a slot, say) is raised by the loop as a RuntimeError with its message.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import secrets
import signal
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import posix_ipc
import torch

HEADER = 4096  # a slot's header page: state, batch number, and where its pickled description lies
SLOT_BYTES = 4 << 20  # a slot's data
FREE, TASK, DONE, FAILED = 0, 1, 2, 3


def _tensor_into(t: torch.Tensor, mm: mmap.mmap, at: int, end: int) -> tuple[Any, ...]:
    """``t`` copied into ``mm`` at ``at`` (a ValueError when it would pass ``end``): its description."""
    if at + t.nbytes > end:
        needed = at + t.nbytes - end + SLOT_BYTES
        raise ValueError(f"a batch of {needed} bytes or more does not fit a slot of {SLOT_BYTES}")
    view = torch.frombuffer(mm, dtype=t.dtype, count=t.numel(), offset=at).view(t.shape)
    view.copy_(t)
    return ("t", t.dtype, tuple(t.shape), at)


class BareRing:
    """``iter()`` gives the batches of ``dataset`` in order (batch ``k`` of indices
    ``k*batch_size`` on), ``num_workers * prefetch_factor`` slots, until the dataset ends."""

    def __init__(self, dataset: Any, batch_size: int, num_workers: int = 2, prefetch_factor: int = 2,
                 collate_fn: Callable[[list[Any]], Any] | None = None) -> None:
        self.ds, self.bs, self.W, self.collate_fn = dataset, batch_size, num_workers, collate_fn
        self.S = num_workers * prefetch_factor
        self.n = len(dataset) // batch_size
        self.stride = HEADER + SLOT_BYTES
        tag = secrets.token_hex(6)
        shm = posix_ipc.SharedMemory(f"/bare{tag}", posix_ipc.O_CREX, mode=0o600, size=self.stride * self.S)
        self.mm = mmap.mmap(shm.fd, self.stride * self.S)
        shm.close_fd()
        shm.unlink()
        self.hdr = [np.frombuffer(self.mm, np.int64, 4, s * self.stride) for s in range(self.S)]
        self.ready = posix_ipc.Semaphore(f"/barer{tag}", posix_ipc.O_CREX, mode=0o600)
        self.task = [posix_ipc.Semaphore(f"/baret{tag}{w}", posix_ipc.O_CREX, mode=0o600) for w in range(self.W)]
        self.pids = []
        for w in range(self.W):
            pid = os.fork()
            if pid == 0:  # (a worker: it dies with its parent, and never returns)
                ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
                torch.set_num_threads(1)
                try:
                    self._work(w)
                finally:
                    os._exit(0)
            self.pids.append(pid)
        self.ready.unlink()
        for t in self.task:
            t.unlink()

    # ------------------------------------------------------------------ a worker
    def _work(self, w: int) -> None:
        mine = [s for s in range(self.S) if s % self.W == w]
        while True:
            self.task[w].acquire()
            for s in mine:
                h = self.hdr[s]
                if h[0] != TASK:
                    continue
                k = int(h[1])
                try:
                    samples = [self.ds[i] for i in range(k * self.bs, (k + 1) * self.bs)]
                    described, state = self._into_slot(samples, s * self.stride + HEADER), DONE
                except Exception as exc:
                    described, state = f"{type(exc).__name__}: {exc}", FAILED
                pickled = pickle.dumps(described, protocol=pickle.HIGHEST_PROTOCOL)
                end = s * self.stride + self.stride
                self.mm[end - len(pickled): end] = pickled
                h[2] = len(pickled)
                h[0] = state
                self.ready.release()

    def _into_slot(self, samples: list[Any], at: int) -> Any:
        end = at + SLOT_BYTES
        if self.collate_fn is None:
            first = samples[0]
            columns = [samples] if isinstance(first, torch.Tensor) else [list(c) for c in zip(*samples)]
            out = []
            for column in columns:
                t0 = column[0]
                if not isinstance(t0, torch.Tensor):  # (numbers: torch's collate makes their tensor)
                    made = torch.utils.data.default_collate(column)
                    out.append(_tensor_into(made, self.mm, at, end))
                    at += (made.nbytes + 63) // 64 * 64
                    continue
                nbytes = t0.nbytes * len(column)
                if at + nbytes > end:
                    raise ValueError(f"a batch of {nbytes} bytes or more does not fit a slot of {SLOT_BYTES}")
                view = torch.frombuffer(self.mm, dtype=t0.dtype, count=t0.numel() * len(column),
                                        offset=at).view(len(column), *t0.shape)
                torch.stack(column, out=view)
                out.append(("t", t0.dtype, tuple(view.shape), at))
                at += (view.nbytes + 63) // 64 * 64
            return out[0] if isinstance(first, torch.Tensor) else out  # (torch's: a list for tuples)
        batch = self.collate_fn(samples)
        if not isinstance(batch, dict):
            raise TypeError(f"the bare ring takes a collate_fn that returns a dict, not {type(batch).__name__}")
        described: dict[str, Any] = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                described[key] = _tensor_into(value, self.mm, at, end)
                at += (value.nbytes + 63) // 64 * 64
            else:
                described[key] = ("o", value)
        return described

    # ------------------------------------------------------------------ the loop
    def _leaf(self, d: tuple[Any, ...]) -> Any:
        if d[0] == "o":
            return d[1]
        _, dtype, shape, at = d
        count = int(np.prod(shape)) if shape else 1
        return torch.frombuffer(self.mm, dtype=dtype, count=count, offset=at).view(shape)

    def _post(self, k: int) -> None:
        s = k % self.S
        h = self.hdr[s]
        h[1] = k
        h[0] = TASK
        self.task[s % self.W].release()

    def __iter__(self) -> Iterator[Any]:
        sent = 0
        while sent < min(self.S, self.n):
            self._post(sent)
            sent += 1
        for k in range(self.n):
            s = k % self.S
            h = self.hdr[s]
            while h[0] != DONE and h[0] != FAILED:
                self.ready.acquire()
            end = s * self.stride + self.stride
            described = pickle.loads(self.mm[end - int(h[2]): end])
            if h[0] == FAILED:
                self.close()
                raise RuntimeError(f"bare ring worker {s % self.W}, batch {k}: {described}")
            if isinstance(described, dict):
                yield {key: self._leaf(d) for key, d in described.items()}
            elif isinstance(described, list):
                yield [self._leaf(d) for d in described]
            else:
                yield self._leaf(described)
            h[0] = FREE  # (the loop asked for the next batch: it is done with this one)
            if sent < self.n:
                self._post(sent)
                sent += 1
        self.close()

    def close(self) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        self.pids = []
