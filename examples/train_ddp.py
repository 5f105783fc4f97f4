"""Data-parallel training under torchrun: DistributedSampler + set_epoch, one shmloader per
rank, gloo on CPU (nccl on GPUs).

    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py [--epochs 2] [--report DIR]

With --report, each rank writes DIR/rank<R>.json: the sample indices it saw per epoch,
its ring's segment name, and whether its workers were gone after shutdown.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib

import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

import shmloader
from train_sync import Regression


class Indexed(Regression):
    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:  # type: ignore[override]
        x, y = super().__getitem__(i)
        return x, y, i


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--report", type=pathlib.Path, default=None)
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    data = Indexed(n=1000)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(data.dim, 1).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = shmloader.DataLoader(data, batch_size=50, sampler=sampler, num_workers=a.num_workers,
                                  persistent_workers=True, device=device if cuda else None)
    seen: list[list[int]] = []
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        seen.append([])
        for x, y, idx in loader:
            loss = torch.nn.functional.mse_loss(model(x.to(device)).squeeze(1), y.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen[-1] += idx.tolist()
        print(f"rank {rank} epoch {epoch} loss {loss.item():.5f}", flush=True)
    segment = loader._iterator.ring.segment  # (for the test's report: the ring's name, long unlinked)
    dist.destroy_process_group()
    del loader  # its persistent workers stop with it
    workers = [c for c in multiprocessing.active_children() if c.name.startswith("shmloader-worker")]
    report = {"rank": rank, "world": world, "seen": seen, "segment": segment, "workers_exited": not workers}
    if a.report is not None:
        a.report.mkdir(parents=True, exist_ok=True)
        (a.report / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
