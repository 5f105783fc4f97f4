"""GPU check: page-locked slots vs torch's pinned and pageable memory, and loader-to-GPU rate.

    python bench/gpu_check.py [--seconds 4] [--num-workers 4]

Prints markdown tables: host-to-device GB/s at 4, 64 and 256 MiB from a registered
shmloader segment, a torch pinned tensor and pageable memory; then the image workload
(128 x uint8[3,224,224]) delivered to the GPU by shmloader(pin_memory=True) and by torch's
DataLoader(pin_memory=True), each followed by .to("cuda", non_blocking=True) and a small
kernel, in the same run.
"""

from __future__ import annotations

import argparse
import subprocess
import time

import numpy as np
import torch

import shmloader
from shmloader import _device, _shm


def h2d_gbps(src: torch.Tensor, repeats: int = 20) -> float:
    dst = torch.empty(src.shape, dtype=src.dtype, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return src.numel() * repeats / (start.elapsed_time(end) / 1e3) / 1e9


def bandwidth_table() -> None:
    print("| size | registered slot GB/s | torch pinned GB/s | pageable GB/s | registered / pinned |")
    print("|---|---|---|---|---|")
    for mib in (4, 64, 256):
        n = mib << 20
        name, mm = _shm.create_segment(n)
        _shm.unlink_segment(name)
        assert _device.register_host(mm, n)
        registered = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
        registered.fill_(1)
        pinned = torch.ones(n, dtype=torch.uint8, pin_memory=True)
        pageable = torch.ones(n, dtype=torch.uint8)
        r, p, q = h2d_gbps(registered), h2d_gbps(pinned), h2d_gbps(pageable)
        print(f"| {mib} MiB | {r:.1f} | {p:.1f} | {q:.1f} | {r / p:.0%} |", flush=True)
        del registered


class Ready(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.item = torch.ones((3, 224, 224), dtype=torch.uint8)

    def __len__(self) -> int:
        return 1 << 28

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.item


def loader_rate(cls: type, workers: int, seconds: float) -> float:
    loader = cls(Ready(), batch_size=128, num_workers=workers, pin_memory=True, persistent_workers=True)
    it = iter(loader)
    acc = torch.zeros((), device="cuda")
    for _ in range(10):
        acc += next(it).to("cuda", non_blocking=True)[0, 0, 0, 0]
    torch.cuda.synchronize()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        batch = next(it).to("cuda", non_blocking=True)
        acc += batch[:, 0, 0, 0].float().mean()
        n += 1
    torch.cuda.synchronize()
    return n / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--num-workers", default="2,4")
    a = p.parse_args()
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%d')} GPU: {smi}; torch {torch.__version__}; CUDA {torch.version.cuda}")
    bandwidth_table()
    print()
    print("| workers | torch DataLoader(pin_memory) batches/s | shmloader(pin_memory) batches/s | ratio | shmloader GB/s |")
    print("|---|---|---|---|---|")
    for w in (int(x) for x in a.num_workers.split(",")):
        t = loader_rate(torch.utils.data.DataLoader, w, a.seconds)
        s = loader_rate(shmloader.DataLoader, w, a.seconds)
        print(f"| {w} | {t:,.1f} | {s:,.1f} | {s / t:.1f}x | {s * 128 * 3 * 224 * 224 / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
