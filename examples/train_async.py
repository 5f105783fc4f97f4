"""An async training loop on uvloop: `async for` over shmloader while another coroutine
(here a heartbeat; in a real program a server, a logger, an RPC) keeps running.

    python examples/train_async.py [--epochs 2] [--num-workers 2]
"""

from __future__ import annotations

import argparse
import asyncio

import torch
import uvloop

import shmloader
from train_sync import Regression


async def heartbeat(stop: asyncio.Event, beats: list[int]) -> None:
    while not stop.is_set():
        beats[0] += 1
        await asyncio.sleep(0.005)


async def train(epochs: int, workers: int) -> None:
    torch.manual_seed(0)
    data = Regression()
    model = torch.nn.Linear(data.dim, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = shmloader.DataLoader(data, batch_size=64, shuffle=True, num_workers=workers)
    stop, beats = asyncio.Event(), [0]
    beat = asyncio.create_task(heartbeat(stop, beats))
    for epoch in range(epochs):
        total = 0.0
        async for x, y in loader:  # waits on the loop: the heartbeat keeps beating meanwhile
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(x)
            await asyncio.sleep(0)  # let other coroutines run between steps too
        print(f"epoch {epoch} loss {total / len(data):.5f}", flush=True)
    stop.set()
    await beat
    print(f"heartbeats {beats[0]}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--num-workers", type=int, default=2)
    a = p.parse_args()
    uvloop.run(train(a.epochs, a.num_workers))


if __name__ == "__main__":
    main()
