"""The datasets and samplers of torchdata's ``test/stateful_dataloader/test_state_dict.py``,
rewritten with the behaviour upstream's tests rely on (their names kept, to match the cases)."""

from __future__ import annotations

import math
import multiprocessing
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.data


def identity(x: Any) -> Any:
    return x


class _Items:
    """A stateful iterator over ``samples``: in order, or (shuffle) drawn with torch's global RNG;
    its state is nested and, with ``include_generator``, carries that RNG."""

    def __init__(self, samples: list[int], shuffle: bool, include_generator: bool) -> None:
        self.samples, self.shuffle, self.include_generator = samples, shuffle, include_generator
        self.size = len(samples)
        self.i = 0

    def __next__(self) -> int:
        if self.i >= self.size:
            raise StopIteration
        at = int(torch.randint(self.size, (1,)).item()) if self.shuffle else self.i
        self.i += 1
        return self.samples[at]

    def state_dict(self) -> dict[str, Any]:
        nest: dict[str, Any] = {"i": self.i}
        if self.include_generator:
            nest["g"] = torch.get_rng_state()
        return {"nest": nest}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i = state["nest"]["i"]
        if self.include_generator:
            torch.set_rng_state(state["nest"]["g"])


class DummyIterator(_Items):
    def __iter__(self) -> DummyIterator:
        return self


class DummySamplerIterator:
    """Yields 0..size-1, stateful."""

    def __init__(self, size: int) -> None:
        self.size, self.i = size, 0

    def __iter__(self) -> DummySamplerIterator:
        return self

    def __next__(self) -> int:
        if self.i >= self.size:
            raise StopIteration
        self.i += 1
        return self.i - 1

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


class DummySampler(torch.utils.data.Sampler[int]):
    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Iterator[int]:
        return DummySamplerIterator(self.size)

    def __len__(self) -> int:
        return self.size


class DummyIteratorIterableDataset(torch.utils.data.IterableDataset[int], _Items):
    """An IterableDataset that is its own (stateful) iterator."""

    def __init__(self, samples: list[int], shuffle: bool, include_generator: bool) -> None:
        _Items.__init__(self, samples, shuffle, include_generator)

    def __iter__(self) -> DummyIteratorIterableDataset:
        return self


class DummyIterableDataset(torch.utils.data.IterableDataset[int]):
    """Worker w iterates its own contiguous range (sizes per worker); its iterator is stateful."""

    def __init__(self, sizes_for_all_workers: list[int], shuffle: bool = False, include_generator: bool = True) -> None:
        self.sizes_for_all_workers = sizes_for_all_workers
        self.shuffle, self.include_generator = shuffle, include_generator

    def __iter__(self) -> DummyIterator:
        info = torch.utils.data.get_worker_info()
        worker_id = 0 if info is None else info.id
        if info is None:
            self.sizes_for_all_workers = [sum(self.sizes_for_all_workers)]
        start = sum(self.sizes_for_all_workers[:worker_id])
        return DummyIterator(list(range(start, start + self.sizes_for_all_workers[worker_id])),
                             self.shuffle, self.include_generator)


class DummyMapDataset(torch.utils.data.Dataset[dict[str, Any]]):
    """Items are dicts; with ``shuffle`` each ``__getitem__`` draws its index from torch's global
    RNG (the worker's), which the dataset's state carries (``include_generator``)."""

    def __init__(self, size: int, shuffle: bool, include_generator: bool = True) -> None:
        self.size, self.shuffle, self.include_generator = size, shuffle, include_generator
        self.data = [{"id": i, "strcol": f"strcol_{i}", "listcol": [i, i + 1, i + 2]} for i in range(size)]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.shuffle:
            i = int(torch.randint(self.size, (1,)).item())
        return self.data[i]

    def state_dict(self) -> dict[str, Any]:
        return {"g": torch.get_rng_state()} if self.include_generator else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.include_generator:
            torch.set_rng_state(state["g"])


class DynamicStateIterableDataset(torch.utils.data.IterableDataset[int]):
    """Its own iterator; its state grows by two entries per item yielded."""

    def __init__(self, samples: list[int]) -> None:
        self.samples, self.size, self.i = samples, len(samples), 0
        self.state: dict[str, Any] = {}

    def __iter__(self) -> DynamicStateIterableDataset:
        return self

    def __next__(self) -> int:
        if self.i >= self.size:
            raise StopIteration
        self.i += 1
        return self.samples[self.i - 1]

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"i": self.i}
        for a in range(self.i):
            state[str(a)] = {a: list(range(a))}
            state[f"t{a}"] = torch.tensor(a, dtype=torch.int8)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i = state["i"]
        self.state = state


class GeneratorIterable(torch.utils.data.IterableDataset[tuple[int, int]]):
    """A generator ``__iter__`` over worker w's range, yielding (item, epoch); the dataset's state
    is its position and epoch, and at the end of a pass it resets (and may count an epoch)."""

    def __init__(self, sizes_for_all_workers: list[int], increment_epoch: bool = False) -> None:
        self.sizes_for_all_workers = sizes_for_all_workers
        self.i, self.resume, self.epoch, self.increment_epoch = 0, None, 0, increment_epoch

    def __iter__(self) -> Iterator[tuple[int, int]]:
        info = torch.utils.data.get_worker_info()
        worker_id = 0 if info is None else info.id
        if info is None:
            self.sizes_for_all_workers = [sum(self.sizes_for_all_workers)]
        self.i = 0
        if self.resume is not None:
            self.i, self.resume = self.resume, None
        start = sum(self.sizes_for_all_workers[:worker_id])
        for i in range(start + self.i, start + self.sizes_for_all_workers[worker_id]):
            self.i += 1
            yield (i, self.epoch)
        self.i = 0  # so that a state taken at the end resumes into the next pass
        if self.increment_epoch:
            self.epoch += 1

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume, self.epoch = state["i"], state["epoch"]


class GeneratorIterableNoState(torch.utils.data.IterableDataset[int]):
    def __init__(self, sizes_for_all_workers: list[int]) -> None:
        self.sizes_for_all_workers = sizes_for_all_workers

    def __iter__(self) -> Iterator[int]:
        info = torch.utils.data.get_worker_info()
        worker_id = 0 if info is None else info.id
        if info is None:
            self.sizes_for_all_workers = [sum(self.sizes_for_all_workers)]
        start = sum(self.sizes_for_all_workers[:worker_id])
        yield from range(start, start + self.sizes_for_all_workers[worker_id])


class PeriodicStateIterableDataset(torch.utils.data.IterableDataset[int]):
    """Flips one of four bits per step: what it yields depends on its whole history."""

    def __init__(self) -> None:
        self.state = {0: 0, 1: 0, 2: 0, 3: 0}
        self.step, self.limit = 0, 100

    def __iter__(self) -> Iterator[int]:
        for _ in range(self.step, self.limit):
            self.step += 1
            key = self.step % len(self.state)
            self.state[key] = 1 - self.state[key]
            yield self.state[key]

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.state, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state, self.step = state["state"], state["step"]


class CountIterCalls(torch.utils.data.IterableDataset[int]):
    """Counts ``iter()`` calls; its iterator is a plain list iterator."""

    def __init__(self, length: int) -> None:
        self.length, self.iter_calls = length, 0

    def __iter__(self) -> Iterator[int]:
        self.iter_calls += 1
        return iter(list(range(self.length)))

    def state_dict(self) -> dict[str, int]:
        return {"iter_calls": self.iter_calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


class CountIterCallsIter(torch.utils.data.IterableDataset[int]):
    """Counts ``iter()`` calls; its own iterator over worker w's share, whose position is only
    set by ``__iter__`` (so its state must be loaded after it)."""

    def __init__(self, length: int) -> None:
        self.length, self.iter_calls = length, 0

    def __iter__(self) -> CountIterCallsIter:
        self.iter_calls += 1
        info = torch.utils.data.get_worker_info()
        worker_id, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        share = self.length // num_workers
        self.curr, self.end = share * worker_id, share * (worker_id + 1)
        return self

    def __next__(self) -> int:
        if self.curr >= self.end:
            raise StopIteration
        self.curr += 1
        return self.curr - 1

    def state_dict(self) -> dict[str, Any]:
        return {"state": {"curr": self.curr, "end": self.end}, "iter_calls": self.iter_calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.curr, self.end = state["state"]["curr"], state["state"]["end"]


class GatedIndexDataset(torch.utils.data.Dataset[int]):
    """Item ``slow_index`` is slow: as upstream's, which sleeps 1 s, it waits 1 s, unless its
    ``gate`` opens first (the test opens it once the batches it must come after were taken)."""

    def __init__(self, end: int, slow_index: int) -> None:
        self.end, self.slow_index = end, slow_index
        self.gate = multiprocessing.Event()

    def __getitem__(self, idx: int) -> int:
        if idx == self.slow_index:
            self.gate.wait(1.0)
        return idx

    def __len__(self) -> int:
        return self.end


class GatedIterableDataset(torch.utils.data.IterableDataset[int]):
    """Worker w yields its share of [start, end); item ``mid`` (worker 1's first) waits until
    worker 0 has gone through its whole share (upstream sleeps 1 s there instead)."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.mid = math.ceil((end - start) / 2)
        self.worker_0_done = multiprocessing.Event()

    def __iter__(self) -> Iterator[int]:
        info = torch.utils.data.get_worker_info()
        assert info is not None
        per_worker = math.ceil((self.end - self.start) / info.num_workers)
        first = self.start + info.id * per_worker
        for i in range(first, min(first + per_worker, self.end)):
            if i == self.mid:
                self.worker_0_done.wait(60)
            yield i
        if info.id == 0:
            self.worker_0_done.set()
