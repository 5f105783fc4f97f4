"""Train a small model with a plain for-loop over shmloader.DataLoader.

    python examples/train_sync.py [--epochs 3] [--num-workers 2]
"""

from __future__ import annotations

import argparse

import torch

import shmloader


class Regression(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """y = x @ w_true + noise, deterministic per index."""

    def __init__(self, n: int = 4096, dim: int = 32) -> None:
        self.n, self.dim = n, dim
        self.w_true = torch.linspace(-1, 1, dim)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(self.dim, generator=g)
        return x, x @ self.w_true + 0.01 * torch.randn((), generator=g)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--num-workers", type=int, default=2)
    a = p.parse_args()
    torch.manual_seed(0)
    data = Regression()
    model = torch.nn.Linear(data.dim, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = shmloader.DataLoader(data, batch_size=64, shuffle=True, num_workers=a.num_workers,
                                  persistent_workers=a.num_workers > 0)
    for epoch in range(a.epochs):
        total = 0.0
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(x)
        print(f"epoch {epoch} loss {total / len(data):.5f}", flush=True)
    s = loader.stats()
    print(f"batches {s.batches} loader-bound {s.loader_bound:.0%}")


if __name__ == "__main__":
    main()
