"""An async training loop on uvloop: `async for` over shmloader while another coroutine
(here a heartbeat; in a real program a server, a logger, an RPC) keeps running.

    python examples/train_async.py [--epochs 2] [--num-workers 2] [--io-ms 0.2]

``--io-ms`` makes each sample take that long in the workers (as reading it from disk
would), so the loop waits for batches; the heartbeats counted while it waits show that
waiting for a batch does not block the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
import uvloop

import shmloader
from train_sync import Regression


class SlowRead(Regression):
    """Regression whose samples take ``io_s`` to read."""

    def __init__(self, io_s: float) -> None:
        super().__init__()
        self.io_s = io_s

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.io_s)
        return super().__getitem__(i)


async def heartbeat(stop: asyncio.Event, beats: list[int]) -> None:
    while not stop.is_set():
        beats[0] += 1
        await asyncio.sleep(0.005)


async def train(epochs: int, workers: int, io_ms: float) -> None:
    torch.manual_seed(0)
    data = SlowRead(io_ms / 1000)
    model = torch.nn.Linear(data.dim, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = shmloader.DataLoader(data, batch_size=64, shuffle=True, num_workers=workers)
    stop, beats = asyncio.Event(), [0]
    beat = asyncio.create_task(heartbeat(stop, beats))
    beats_while_waiting = 0
    for epoch in range(epochs):
        total = 0.0
        batches = aiter(loader)
        while True:
            before = beats[0]
            try:
                x, y = await anext(batches)  # waits on the loop: the heartbeat keeps beating meanwhile
            except StopAsyncIteration:
                break
            beats_while_waiting += beats[0] - before
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(x)
            await asyncio.sleep(0)  # let other coroutines run between steps too
        print(f"epoch {epoch} loss {total / len(data):.5f}", flush=True)
    stop.set()
    await beat
    print(f"heartbeats {beats[0]}, {beats_while_waiting} of them while waiting for a batch")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--io-ms", type=float, default=0.2, help="time each sample takes to read, in ms")
    a = p.parse_args()
    uvloop.run(train(a.epochs, a.num_workers, a.io_ms))


if __name__ == "__main__":
    main()
