"""The benchmark's workloads: transport-bound (tiny, tokens, image, pairs, hold), real (jpeg, memmap,
varlen), and a dataset that reads a large index of Python objects, as a plain list (index) or
through ``shmloader.share()`` (shared-index): what its workers copy shows in "loader MB".

Datasets are module-level classes so that every loader's workers can import them. Every
random choice is seeded by the sample index, so runs are comparable.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import Dataset

# Where the real workloads' files are written once (``shmloader bench --cache``'s default).
CACHE = pathlib.Path.home() / ".cache" / "shmloader-bench"


class Ready(Dataset):  # type: ignore[type-arg]
    """``__getitem__`` returns one preallocated tensor: only transport is measured."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, n: int) -> None:
        self.item = torch.ones(shape, dtype=dtype)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.item


class ReadyPairs(Dataset):  # type: ignore[type-arg]
    """(image, class) pairs as torchvision's datasets return them: one preallocated tensor and a
    Python int per sample; the batch is a list of two tensors. Only transport is measured."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, n: int) -> None:
        self.item = torch.ones(shape, dtype=dtype)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.item, i % 10


class Index(Dataset):  # type: ignore[type-arg]
    """An ImageFolder-style index of (path, label, size) dicts, read at a pseudo-random entry per
    sample (the work of a dataset that loads nothing else): a small tensor per sample. Over a
    plain list, every worker copies the entries it reads (reading writes their reference
    counts); over ``shmloader.share()`` no worker copies anything."""

    def __init__(self, entries: Any, n: int) -> None:
        self.entries, self.n = entries, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        entry = self.entries[(i * 2654435761) % len(self.entries)]
        return torch.tensor([entry["label"], entry["size"], len(entry["path"])])


def index_entries(count: int) -> Any:
    """``count`` index entries, made as they are read (never a list of them at once)."""
    return ({"path": f"/data/class{i % 1000:04d}/img{i:08d}.jpg", "label": i % 1000, "size": 1000 + i % 5000}
            for i in range(count))


def _index(shared: bool) -> Callable[..., Dataset]:  # type: ignore[type-arg]
    def make(cache: pathlib.Path, quick: bool, data: pathlib.Path | None, n: int) -> Dataset:  # type: ignore[type-arg]
        count = 200_000 if quick else 2_000_000
        if shared:
            import shmloader

            return Index(shmloader.share(index_entries(count)), n)
        return Index(list(index_entries(count)), n)

    return make


class Jpegs(Dataset):  # type: ignore[type-arg]
    """Decode a JPEG, crop 224x224 at a random place, flip half of them: uint8 CHW."""

    def __init__(self, files: list[str], n: int) -> None:
        self.files, self.n = files, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        from PIL import Image

        rng = np.random.default_rng(i)
        with Image.open(self.files[i % len(self.files)]) as f:
            rgb = f.convert("RGB")
        w, h = rgb.size
        x, y = int(rng.integers(0, w - 223)), int(rng.integers(0, h - 223))
        crop = rgb.crop((x, y, x + 224, y + 224))
        if rng.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.array(crop)).permute(2, 0, 1)


class TokenWindows(Dataset):  # type: ignore[type-arg]
    """Random windows of 1,025 tokens of a uint16 file: (input, target) as in GPT training."""

    def __init__(self, path: str, n: int, window: int = 1025) -> None:
        self.path, self.n, self.window = path, n, window
        self._tokens: np.memmap[Any, Any] | None = None

    def __len__(self) -> int:
        return self.n

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        start = int(np.random.default_rng(i).integers(0, len(self._tokens) - self.window))
        chunk = torch.from_numpy(self._tokens[start : start + self.window].astype(np.int64))
        return chunk[:-1], chunk[1:]


class Sentences(Dataset):  # type: ignore[type-arg]
    """Dynamic padding's input: sample i is (int64 token ids of a length in [8, 512], the raw
    text they came from); the length is seeded by i, so every epoch and loader sees the same."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str]:
        length = int(np.random.default_rng(i).integers(8, 513))
        return torch.arange(i, i + length, dtype=torch.int64) % 50257, "w" * (length * 5)


def pad_collate(batch: list[tuple[torch.Tensor, str]]) -> dict[str, Any]:
    """Pad to the longest sequence of the batch, with its mask and the raw strings."""
    ids = torch.nn.utils.rnn.pad_sequence([t for t, _ in batch], batch_first=True, padding_value=0)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for row, (t, _) in enumerate(batch):
        mask[row, : len(t)] = True
    return {"input_ids": ids, "attention_mask": mask, "text": [s for _, s in batch]}


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    batch_size: int
    batches: int  # measured batches per repeat (full run)
    quick_batches: int
    make: Callable[[pathlib.Path, bool, pathlib.Path | None, int], Dataset]  # type: ignore[type-arg]
    what: str
    collate_fn: Callable[[Any], Any] | None = None
    # Each repeat is one epoch of a dataset this long (persistent workers, shuffled): the
    # first epoch is the measured warm-up, as the ring adapts to the batches it sees.
    epochs: bool = False
    hold: bool = False  # the loop keeps every batch of a repeat (a replay buffer)
    by_name: bool = False  # run only when named (--workloads): too large for the default run


def _ready(shape: tuple[int, ...], dtype: torch.dtype) -> Callable[..., Dataset]:  # type: ignore[type-arg]
    return lambda cache, quick, data, n: Ready(shape, dtype, n)


def jpeg_files(cache: pathlib.Path, count: int, data: pathlib.Path | None = None) -> list[str]:
    """``data``'s JPEGs, or ``count`` files of 256-512 px written once into ``cache``."""
    if data is not None:
        found = sorted(str(p) for p in data.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
        if found:
            return found
    from PIL import Image

    folder = cache / f"jpeg-{count}"
    done = folder / ".complete"
    if not done.exists():
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            rng = np.random.default_rng(1_000_000 + i)
            w, h = (int(v) for v in rng.integers(256, 513, 2))
            coarse = rng.integers(0, 256, (h // 16 + 1, w // 16 + 1, 3), dtype=np.uint8)
            img = Image.fromarray(coarse).resize((w, h), Image.Resampling.BILINEAR)
            noisy = np.asarray(img).astype(np.int16) + rng.integers(-12, 13, (h, w, 3))
            Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(folder / f"img_{i:05d}.jpg", quality=90)
        done.touch()
    return sorted(str(p) for p in folder.glob("img_*.jpg"))


def token_file(cache: pathlib.Path, megabytes: int, data: pathlib.Path | None = None) -> str:
    """``data``'s token file (*.bin, *.u16), or a uint16 file of ``megabytes`` written once."""
    if data is not None:
        for pattern in ("*.u16", "*.bin"):
            found = sorted(data.rglob(pattern))
            if found:
                return str(found[0])
    path = cache / f"tokens-{megabytes}MB.u16"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(7)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            for _ in range(megabytes):
                f.write(rng.integers(0, 50257, 1 << 19, dtype=np.uint16).tobytes())
        os.replace(tmp, path)
    return str(path)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload("tiny", 32, 2000, 300, _ready((16,), torch.float32), "32 x float32[16], ready tensors"),
        Workload("tokens", 64, 2000, 300, _ready((512,), torch.int64), "64 x int64[512], ready tensors"),
        Workload("image", 128, 200, 30, _ready((3, 224, 224), torch.uint8), "128 x uint8[3,224,224], ready tensors"),
        Workload("pairs", 64, 2000, 300, lambda cache, quick, data, n: ReadyPairs((3, 32, 32), torch.uint8, n),
                 "64 x (uint8[3,32,32], int class), ready: CIFAR's (image, label) pairs"),
        Workload("big", 16, 12, 4, _ready((4096, 1024), torch.float32),
                 "16 x float32[4096,1024] (256 MiB), ready tensors: the workers the bottleneck", by_name=True),
        Workload("hold", 64, 600, 200, _ready((1024,), torch.float32),
                 "64 x float32[1024], ready tensors, every batch kept by the loop (a replay buffer)", hold=True),
        Workload(
            "jpeg", 32, 60, 15,
            lambda cache, quick, data, n: Jpegs(jpeg_files(cache, 200 if quick else 2000, data), n),
            "32 JPEGs of 256-512 px: decode, random 224 crop, flip",
        ),
        Workload(
            "memmap", 32, 1000, 200,
            lambda cache, quick, data, n: TokenWindows(token_file(cache, 20 if quick else 200, data), n),
            "32 random windows of 1,025 uint16 tokens via np.memmap -> (input, target) int64",
        ),
        Workload("index", 64, 300, 100, _index(shared=False),
                 "64 reads of a 2M-entry index of dicts (200k with --quick), a plain list: workers copy it"),
        Workload("shared-index", 64, 300, 100, _index(shared=True),
                 "the same index through shmloader.share(): stored once, read by every worker in place"),
        Workload(
            "varlen", 32, 300, 100, lambda cache, quick, data, n: Sentences(n),
            "dynamic padding: 32 sequences of 8..512 int64 tokens in random order, padded, mask, raw strings",
            collate_fn=pad_collate, epochs=True,
        ),
    ]
}
