"""Transport-bound benchmark: shmloader vs torch's DataLoader, side by side.

``__getitem__`` returns a preallocated tensor, so only transport and collation are
measured. Workloads (DESIGN.md): tiny = 32 x float32[16], tokens = 64 x int64[512],
image = 128 x uint8[3,224,224]. num_workers=2, prefetch_factor=2, persistent workers.

    python bench/transport.py [--seconds 3] [--workloads tiny,tokens,image]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch
import torch.utils.data

import shmloader

WORKLOADS = {
    "tiny": (32, (16,), torch.float32),
    "tokens": (64, (512,), torch.int64),
    "image": (128, (3, 224, 224), torch.uint8),
}


class Ready(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, n: int = 1 << 28) -> None:
        self.item = torch.ones(shape, dtype=dtype)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.item


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_pids(it: object) -> list[int]:
    procs = getattr(it, "_workers", None) or getattr(getattr(it, "_pool", None), "procs", [])
    return [p.pid for p in procs]


def rate(loader: torch.utils.data.DataLoader, seconds: float) -> tuple[float, list[float]]:  # type: ignore[type-arg]
    """Batches/s, and CPU µs per batch of the main process and each worker."""
    it = iter(loader)
    for _ in range(20):  # warm up: workers started, ring sized, pages touched
        next(it)
    pids = [os.getpid(), *worker_pids(it)]
    cpu0 = [cpu_seconds(p) for p in pids]
    n = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            next(it)
        n += 10
    elapsed = time.perf_counter() - start
    cpu = [(cpu_seconds(p) - c) / n * 1e6 for p, c in zip(pids, cpu0)]
    del it
    return n / elapsed, cpu


def make(cls: type, workload: str, workers: int, prefetch: int) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    bs, shape, dtype = WORKLOADS[workload]
    return cls(Ready(shape, dtype), batch_size=bs, num_workers=workers, prefetch_factor=prefetch,
               persistent_workers=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--workloads", default="tiny,tokens,image")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--prefetch-factor", type=int, default=2)
    a = p.parse_args()
    print(f"# {time.strftime('%Y-%m-%d')} {platform.machine()} {torch.__version__} "
          f"num_workers={a.num_workers} prefetch_factor={a.prefetch_factor} seconds={a.seconds}")
    print("| workload | batch bytes | torch batches/s | shmloader batches/s | shmloader GB/s | ratio "
          "| CPU µs/batch main+workers: torch | shmloader |")
    print("|---|---|---|---|---|---|---|---|")
    for w in a.workloads.split(","):
        bs, shape, dtype = WORKLOADS[w]
        nbytes = bs * torch.Size(shape).numel() * dtype.itemsize
        t, t_cpu = rate(make(torch.utils.data.DataLoader, w, a.num_workers, a.prefetch_factor), a.seconds)
        s, s_cpu = rate(make(shmloader.DataLoader, w, a.num_workers, a.prefetch_factor), a.seconds)
        fmt = lambda c: " + ".join(f"{x:.0f}" for x in c)  # noqa: E731
        print(f"| {w} | {nbytes:,} | {t:,.0f} | {s:,.0f} | {s * nbytes / 1e9:.2f} | {s / t:.1f}x "
              f"| {fmt(t_cpu)} | {fmt(s_cpu)} |", flush=True)


if __name__ == "__main__":
    main()
