"""Datasets shared by the tests; module-level so spawn and forkserver workers can import them."""

from __future__ import annotations

import collections
import os
import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

Point = collections.namedtuple("Point", ["x", "y"])


class Rich(Dataset):  # type: ignore[type-arg]
    """Samples of every leaf type default_collate handles, nested."""

    def __init__(self, n: int = 100) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(i)
        return {
            "f32": torch.randn(3, 4, generator=g),
            "i64": torch.arange(i, i + 5),
            "u8": torch.randint(0, 255, (2, 2), dtype=torch.uint8, generator=g),
            "np": np.full((2,), i, dtype=np.int32),
            "np_scalar": np.float64(i) / 3,
            "int": i,
            "float": i / 7,
            "bool": bool(i % 2),
            "str": f"item-{i}",
            "bytes": str(i).encode(),
            "tuple": (i, torch.tensor(float(i))),
            "list": [torch.zeros(1) + i, str(i)],
            "point": Point(x=torch.tensor([i, i]), y=i * 2),
            "nested": {"a": {"b": torch.full((1,), i, dtype=torch.float16)}},
        }


class Range(Dataset):  # type: ignore[type-arg]
    """Sample i is tensor([i]) (int64)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


class Sized(Dataset):  # type: ignore[type-arg]
    """Sample i is a float32 vector of ``sizes[i]`` elements, all equal to i."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.sizes[i],), float(i))


class SizedDicts(Sized):
    """Sample i is a dict: its number (default_collate makes a tensor of them when the skeleton
    is pickled, after it has stacked ``x`` into the slot), ``x`` as ``Sized``'s, and a pair."""

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        return {"n": i, "x": super().__getitem__(i), "pair": (float(i), f"s{i}")}


class Noise(Dataset):  # type: ignore[type-arg]
    """Sample i is a tensor of ``shape`` and ``dtype`` drawn from a generator seeded by i."""

    def __init__(self, n: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.n, self.shape, self.dtype = n, shape, dtype

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        return (torch.randn(self.shape, generator=g) * 1000).to(self.dtype)


class Failing(Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int, bad: int, exc: type[Exception] = ValueError) -> None:
        self.n, self.bad, self.exc = n, bad, exc

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad:
            raise self.exc(f"sample {i} is broken")
        return torch.tensor([i])


class Seeds(Dataset):  # type: ignore[type-arg]
    """Reports the worker's RNG state and identity."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, Any]:
        info = get_worker_info()
        tinfo = torch.utils.data.get_worker_info()
        return {
            "torch": torch.randint(0, 2**30, (1,)),
            "random": random.randint(0, 2**30),
            "numpy": int(np.random.randint(0, 2**30)),
            "worker": -1 if info is None else info.id,
            "same_info": info is tinfo,
            "seed": -1 if info is None else info.seed,
        }


class Shards(IterableDataset):  # type: ignore[type-arg]
    """Yields range(n) split between workers by get_worker_info(), as torch's docs do."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = get_worker_info()
        if info is None:
            return iter(range(self.n))
        per = -(-self.n // info.num_workers)
        start = info.id * per
        return iter(range(start, min(start + per, self.n)))


class Gated(Dataset):  # type: ignore[type-arg]
    """Blocks in __getitem__ until ``gate`` (a multiprocessing Event) is set."""

    def __init__(self, n: int, gate: Any) -> None:
        self.n, self.gate = n, gate

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.gate.wait()
        return torch.tensor([i])


class MidBatch(Dataset):  # type: ignore[type-arg]
    """Sample i sets ``started`` (a multiprocessing Event), then waits up to ``wait_s`` for
    ``gate``; it is (i, 1) when the gate opened while it waited, (i, 0) when the wait timed out.
    A test that opens the gate only from the event loop proves the loop ran while a worker was
    inside a batch, and never hangs if it did not."""

    def __init__(self, n: int, started: Any, gate: Any, wait_s: float = 10.0) -> None:
        self.n, self.started, self.gate, self.wait_s = n, started, gate, wait_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.started.set()
        return torch.tensor([i, int(self.gate.wait(self.wait_s))])


class Pid(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        return os.getpid()


class IndexPid(Dataset):  # type: ignore[type-arg]
    """Sample i: (i, pid of the process that made it)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, os.getpid()])


def init_marker(worker_id: int) -> None:
    os.environ["SHMLOADER_TEST_INIT"] = f"init-{worker_id}"


class InitMarker(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> str:
        return os.environ.get("SHMLOADER_TEST_INIT", "none")


class Custom:
    """A user object holding a tensor (travels pickled, its tensor as a leaf)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Custom) and torch.equal(self.t, other.t)


class PidStream(IterableDataset):  # type: ignore[type-arg]
    """Yields the worker's pid 50 times."""

    def __iter__(self) -> Any:
        return iter([os.getpid()] * 50)


class BrokenStream(IterableDataset):  # type: ignore[type-arg]
    """Yields 0, 1, 2, then raises ArithmeticError."""

    def __iter__(self) -> Any:
        for i in range(3):
            yield i
        raise ArithmeticError("stream broke after 3 items")


class LoudGate(Gated):
    """Gated, and says so on stdout (with the worker's pid) before it blocks."""

    def __getitem__(self, i: int) -> torch.Tensor:
        print(f"blocked {os.getpid()}", flush=True)
        return super().__getitem__(i)


class Blocks(Dataset):  # type: ignore[type-arg]
    """Sample i: ``words`` int32 all equal to i, so a torn or stale slot shows in any word."""

    def __init__(self, n: int, words: int = 16384) -> None:
        self.n, self.words = n, words

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.words,), i, dtype=torch.int32)


def check_blocks(batch: torch.Tensor, first: int, device: str = "cpu") -> None:
    """Batch of Blocks starting at sample ``first``, on ``device``, every word checked."""
    assert batch.device.type == device, batch.device
    want = torch.arange(first, first + batch.shape[0], dtype=torch.int32)[:, None].expand_as(batch)
    assert torch.equal(batch.cpu(), want), f"batch starting at {first} is torn or stale"


class StatefulShards(IterableDataset):  # type: ignore[type-arg]
    """range(n) split between workers; ``state_dict()`` is the position in this worker's
    shard, which starts over once the shard is exhausted (the next epoch)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pos = 0

    def _shard(self) -> range:
        info = get_worker_info()
        if info is None:
            return range(self.n)
        per = -(-self.n // info.num_workers)
        return range(info.id * per, min((info.id + 1) * per, self.n))

    def __iter__(self) -> Any:
        shard = self._shard()
        while self.pos < len(shard):
            self.pos += 1
            yield shard[self.pos - 1]
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


class Tokens(Dataset):  # type: ignore[type-arg]
    """Dynamic padding: sample i is (int64 tokens of a length in [8, 512], its raw text). Every
    ``big_every``-th text is ~100 KB. ``first_small``: the first ``first_small`` samples are
    the shortest, so the ring is sized from a small first batch."""

    def __init__(self, n: int, first_small: int = 0, big_every: int = 0) -> None:
        self.n, self.first_small, self.big_every = n, first_small, big_every

    def __len__(self) -> int:
        return self.n

    def length(self, i: int) -> int:
        return 8 if i < self.first_small else random.Random(i).randint(8, 512)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str]:
        n = self.length(i)
        text_len = 100_000 if self.big_every and i % self.big_every == self.big_every - 1 else n * 5
        return torch.arange(i, i + n, dtype=torch.int64), chr(ord("a") + i % 26) * text_len


def pad_collate(batch: list[tuple[torch.Tensor, str]]) -> dict[str, Any]:
    """What an NLP collate does: pad to the longest sample, a mask, and the raw strings."""
    tokens = torch.nn.utils.rnn.pad_sequence([t for t, _ in batch], batch_first=True, padding_value=-1)
    return {"input_ids": tokens, "attention_mask": tokens >= 0, "text": [s for _, s in batch]}


class Detection(Dataset):  # type: ignore[type-arg]
    """Detection-style samples: a multi-resolution image and k in [0, 50] boxes with labels."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, dict[str, Any]]:
        g = torch.Generator().manual_seed(i)
        k = int(torch.randint(0, 51, (1,), generator=g))
        side = int(torch.randint(8, 97, (1,), generator=g))
        image = torch.randint(0, 256, (3, side, side), dtype=torch.uint8, generator=g)
        return image, {"boxes": torch.rand(k, 4, generator=g), "labels": torch.randint(0, 80, (k,), generator=g),
                       "image_id": i}


def zip_collate(batch: list[Any]) -> tuple[Any, ...]:
    """torchvision's detection collate."""
    return tuple(zip(*batch))


class Planned(Dataset):  # type: ignore[type-arg]
    """Batches planned one by one: ``plan`` lists (samples, length, text length, dtype); sample
    i is {"x": ``length`` values of its batch's dtype, "text": str, "i": i}."""

    def __init__(self, plan: list[tuple[int, int, int, torch.dtype]]) -> None:
        self.items = [(length, text, dtype) for n, length, text, dtype in plan for _ in range(n)]
        self.batches: list[list[int]] = []
        for n, *_ in plan:
            start = sum(len(b) for b in self.batches)
            self.batches.append(list(range(start, start + n)))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        length, text, dtype = self.items[i]
        values = torch.randint(0, 100, (length,), generator=torch.Generator().manual_seed(i))
        return {"x": values.to(dtype), "text": chr(ord("a") + i % 26) * text, "i": i}


class BadSamples(Dataset):  # type: ignore[type-arg]
    """Sample i is tensor([i]); the samples in ``bad`` raise ``error`` (ValueError)."""

    def __init__(self, n: int, bad: tuple[int, ...], error: type[BaseException] = ValueError) -> None:
        self.n, self.bad, self.error = n, bad, error

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i in self.bad:
            raise self.error(f"sample {i} is broken")
        return torch.tensor([i])


class Augmented(Dataset):  # type: ignore[type-arg]
    """Random augmentation from the worker's three RNGs: torch, numpy and random."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> dict[str, Any]:
        image = torch.full((3, 8, 8), float(i))
        top, left = random.randint(0, 4), int(np.random.randint(0, 4))
        crop = image[:, top : top + 4, left : left + 4]
        if torch.rand(1).item() < 0.5:
            crop = crop.flip(-1)
        return {"image": crop + torch.rand(3, 4, 4), "noise": np.random.rand(2), "coin": random.random()}


class BadStream(IterableDataset):  # type: ignore[type-arg]
    """Each worker's shard of range(n) (torch's recipe), raising ValueError at the items in ``bad``."""

    def __init__(self, n: int, bad: tuple[int, ...]) -> None:
        self.n, self.bad = n, bad

    def __iter__(self) -> Any:
        info = get_worker_info()
        ids = range(self.n) if info is None else range(info.id, self.n, info.num_workers)
        for i in ids:
            if i in self.bad:
                raise ValueError(f"item {i} is broken")
            yield torch.tensor([i])


class BadBatches(BadSamples):
    """BadSamples fetched a batch at a time through ``__getitems__``."""

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        return [self[i] for i in indices]


def _local_error_class() -> type[Exception]:
    class DiskOnFire(Exception):  # defined inside a function: pickle cannot find it by name
        pass

    return DiskOnFire


class RaisesUnpicklable(Dataset):  # type: ignore[type-arg]
    """Sample ``bad`` raises an exception whose class cannot be pickled."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad:
            raise _local_error_class()(f"sample {i}: disk on fire")
        return torch.tensor([i])


class TaggedTensor(torch.Tensor):
    """A tensor subclass (its type survives torch.stack through __torch_function__)."""


class Runs(Dataset):  # type: ignore[type-arg]
    """Plain-tensor samples in planned batches: ``plan`` lists (count, sample shape, dtype,
    twist). Sample i holds values seeded by i; a batch's twist changes one of its samples:
    "dtype" (float64), "shape" (one more element in the last dimension), "subclass" (a
    ``TaggedTensor``) or "array" (a numpy array), at ``spot`` in the batch."""

    def __init__(self, plan: list[tuple[int, tuple[int, ...], torch.dtype, str | None, int]]) -> None:
        self.items: list[tuple[tuple[int, ...], torch.dtype, str | None]] = []
        self.batches: list[list[int]] = []
        for count, shape, dtype, twist, spot in plan:
            start = len(self.items)
            self.batches.append(list(range(start, start + count)))
            self.items += [(shape, dtype, twist if k == spot % count else None) for k in range(count)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        shape, dtype, twist = self.items[i]
        if twist == "shape":
            shape = (*shape[:-1], shape[-1] + 1) if shape else (1,)
        values = torch.randint(0, 100, shape, generator=torch.Generator().manual_seed(i))
        sample = values.to(torch.float64 if twist == "dtype" else dtype)
        if twist == "subclass":
            return sample.as_subclass(TaggedTensor)
        if twist == "array":
            return sample.numpy()
        return sample


class LenShards(IterableDataset):  # type: ignore[type-arg]
    """Worker ``w`` yields ``lengths[w]`` samples, ``w * 1000`` on: shards of any lengths, empty
    ones included (the shape of a sharded corpus whose files differ in size)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __iter__(self) -> Any:
        info = get_worker_info()
        w = 0 if info is None else info.id
        return iter(torch.tensor([w * 1000 + i]) for i in range(self.lengths[w]))
