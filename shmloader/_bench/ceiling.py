"""The design's ceiling on this machine: a bare ring, with none of the product's features.

``W`` forked workers and one anonymous shared mapping of ``S = W × P`` slots, inherited by the
workers; slot ``s`` belongs to worker ``s % W``. A task is a slot header's state and first
index; a worker waits on its own semaphore, stacks the batch's samples straight into its slot
(``torch.stack(out=)``), marks the slot done and posts the one ready semaphore; the consumer
takes slots in order and yields a view of each, made once. No leases (a batch is valid until
the next ``next()``), no errors, no recovery, no telemetry, no resume, one task post and one
wake-up per batch both ways: what is left is the transport itself.

It imports nothing from shmloader, so it measures the design, not the product:
``shmloader bench --ceiling`` runs it beside the loaders and prints each one's rate as a share
of it. It serves datasets whose samples are tensors of one shape and dtype (the bench's
ready-tensor workloads).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import signal
from typing import Any, Iterator

import numpy as np
import posix_ipc
import torch

_PAGE = mmap.PAGESIZE
_IDLE, _TASK, _DONE = 0, 1, 2
_PR_SET_PDEATHSIG = 1


class BareRing:
    """One epoch per ``iter()``: ``len(dataset) // batch_size`` batches, in order. ``close()``
    stops the workers."""

    def __init__(self, dataset: Any, batch_size: int, num_workers: int, prefetch_factor: int) -> None:
        self.dataset, self.batch_size, self.num_workers = dataset, batch_size, num_workers
        self.num_slots = num_workers * prefetch_factor
        sample = dataset[0]
        if not isinstance(sample, torch.Tensor):
            raise TypeError(f"the bare ring stacks tensors; this dataset's samples are {type(sample).__name__}")
        self.shape = (batch_size, *sample.shape)
        nbytes = sample.numel() * sample.element_size() * batch_size
        self.stride = _PAGE + -(-nbytes // _PAGE) * _PAGE  # a header page, then the batch
        self.mm = mmap.mmap(-1, self.stride * self.num_slots)  # MAP_SHARED | MAP_ANONYMOUS: the workers inherit it
        self.headers = [np.frombuffer(self.mm, np.int64, 2, s * self.stride) for s in range(self.num_slots)]
        self.views = [torch.frombuffer(self.mm, dtype=sample.dtype, count=sample.numel() * batch_size,
                                       offset=s * self.stride + _PAGE).view(self.shape)
                      for s in range(self.num_slots)]
        tag = secrets.token_hex(6)
        self.ready = posix_ipc.Semaphore(f"/bare-r{tag}", posix_ipc.O_CREX, mode=0o600)
        self.tasks = [posix_ipc.Semaphore(f"/bare-t{tag}-{w}", posix_ipc.O_CREX, mode=0o600)
                      for w in range(num_workers)]
        self.pids: list[int] = []
        try:
            for w in range(num_workers):
                pid = os.fork()
                if pid == 0:  # pragma: no cover (the worker)
                    code = 1
                    try:
                        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
                        torch.set_num_threads(1)
                        self._work(w)
                        code = 0
                    finally:
                        os._exit(code)
                self.pids.append(pid)
        finally:
            for sem in (self.ready, *self.tasks):
                sem.unlink()  # the names go at once: nothing is left in /dev/shm

    def _work(self, worker: int) -> None:
        mine = range(worker, self.num_slots, self.num_workers)
        dataset, bs, task = self.dataset, self.batch_size, self.tasks[worker]
        while True:
            task.acquire()
            for s in mine:
                header = self.headers[s]
                if header[0] != _TASK:
                    continue
                start = int(header[1])
                torch.stack([dataset[i] for i in range(start, start + bs)], out=self.views[s])
                header[0] = _DONE
                self.ready.release()

    def _post(self, seq: int, start: int) -> None:
        s = seq % self.num_slots
        header = self.headers[s]
        header[1] = start
        header[0] = _TASK
        self.tasks[s % self.num_workers].release()

    def __iter__(self) -> Iterator[torch.Tensor]:
        n = len(self.dataset) // self.batch_size
        posted = 0
        while posted < min(self.num_slots, n):
            self._post(posted, posted * self.batch_size)
            posted += 1
        for seq in range(n):
            header = self.headers[seq % self.num_slots]
            while header[0] != _DONE:
                self.ready.acquire()
            header[0] = _IDLE
            yield self.views[seq % self.num_slots]
            if posted < n:
                self._post(posted, posted * self.batch_size)
                posted += 1

    def close(self) -> None:
        """Stop the workers (killed: they may be mid-batch, and keep nothing worth a goodbye)."""
        for pid in self.pids:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        self.pids = []
