"""GPU check: page-locked slots vs torch's pinned and pageable memory, and loader-to-GPU rate.

    python bench/gpu_check.py [--seconds 4] [--num-workers 4]

Prints markdown tables: host-to-device GB/s at 4, 64 and 256 MiB from a registered
shmloader segment, a torch pinned tensor and pageable memory; then the image workload
(128 x uint8[3,224,224]) delivered to the GPU by shmloader(pin_memory=True) and by torch's
DataLoader(pin_memory=True), each followed by .to("cuda", non_blocking=True) and a small
kernel, in the same run, plus shmloader(device="cuda") delivering on its side stream;
finally the GPU idle share of a synthetic training step fed by each loader and by data
already resident on the GPU.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from typing import Any

import numpy as np
import torch

import shmloader
from shmloader.main import device as _device
from shmloader.wire import shm as _shm


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


LOADERS = {
    "torch DataLoader(pin_memory) + .to": (torch.utils.data.DataLoader, {"pin_memory": True}),
    "shmloader(pin_memory) + .to": (shmloader.DataLoader, {"pin_memory": True}),
    "shmloader(device='cuda')": (shmloader.DataLoader, {"device": "cuda"}),
}


def batches(name: str, workers: int) -> Any:
    cls, kw = LOADERS[name]
    it = iter(cls(Ready(), batch_size=128, num_workers=workers, persistent_workers=True, **kw))
    while True:
        yield next(it).to("cuda", non_blocking=True)  # a no-op for device batches


def loader_rate(name: str, workers: int, seconds: float) -> float:
    source = batches(name, workers)
    acc = torch.zeros((), device="cuda")
    for _ in range(10):
        acc += next(source)[0, 0, 0, 0]
    torch.cuda.synchronize()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        acc += next(source)[:, 0, 0, 0].float().mean()
        n += 1
    torch.cuda.synchronize()
    return n / (time.perf_counter() - start)


def idle_fraction(source: Any, step_cycles: int, steps: int) -> float:
    """GPU idle share of a synthetic training step (a fixed GPU spin plus a kernel reading
    the batch), measured with events on the consumer's stream."""
    for _ in range(5):
        torch.cuda._sleep(step_cycles)
        next(source).float().mean()
    torch.cuda.synchronize()
    events = []
    for _ in range(steps):
        batch = next(source)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        batch[:, 0].float().mean()
        torch.cuda._sleep(step_cycles)
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    busy = sum(s.elapsed_time(e) for s, e in events)
    wall = events[0][0].elapsed_time(events[-1][1])
    return max(0.0, 1 - busy / wall)


def cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def resident(batch_on_gpu: torch.Tensor) -> Any:
    while True:
        yield batch_on_gpu


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--num-workers", default="2,4")
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args()
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%d')} GPU: {smi}; torch {torch.__version__}; CUDA {torch.version.cuda}")
    bandwidth_table()
    print()
    names = list(LOADERS)
    print("| workers | " + " | ".join(f"{n} batches/s" for n in names) + " | device / torch |")
    print("|---|" + "---|" * (len(names) + 1))
    for w in (int(x) for x in a.num_workers.split(",")):
        r = [loader_rate(n, w, a.seconds) for n in names]
        print(f"| {w} | " + " | ".join(f"{x:,.1f}" for x in r) + f" | {r[-1] / r[0]:.1f}x |", flush=True)
    print()
    cycles = int(a.step_ms * cycles_per_ms())
    w = int(a.num_workers.split(",")[-1])
    print(f"GPU idle during a synthetic {a.step_ms} ms step ({a.steps} steps, {w} workers, image batches):")
    print()
    print("| data source | GPU idle |")
    print("|---|---|")
    on_gpu = torch.ones((128, 3, 224, 224), dtype=torch.uint8, device="cuda")
    print(f"| already resident on the GPU | {idle_fraction(resident(on_gpu), cycles, a.steps):.1%} |", flush=True)
    for n in names:
        print(f"| {n} | {idle_fraction(batches(n, w), cycles, a.steps):.1%} |", flush=True)


if __name__ == "__main__":
    main()
