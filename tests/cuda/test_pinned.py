"""With CUDA and pin_memory=True, slots are page-locked in place and copy to the GPU bit-exact."""

from __future__ import annotations

import torch

import shmloader
from tests.datasets import Rich


class Images(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8, generator=g)


def test_batches_are_pinned_in_place_and_copy_bit_exact() -> None:
    loader = shmloader.DataLoader(Images(), batch_size=16, num_workers=2, pin_memory=True)
    reference = list(torch.utils.data.DataLoader(Images(), batch_size=16))
    it = iter(loader)
    for want in reference:
        batch = next(it)
        assert it.pinned and batch.is_pinned()
        on_gpu = batch.to("cuda", non_blocking=True)
        assert torch.equal(on_gpu.cpu(), want)
        del batch
    torch.cuda.synchronize()


def test_nested_batches_pinned() -> None:
    got = list(shmloader.DataLoader(Rich(20), batch_size=5, num_workers=2, pin_memory=True))
    assert all(b["f32"].is_pinned() for b in got[:2])
    moved = [b["f32"].to("cuda", non_blocking=True) for b in got]
    torch.cuda.synchronize()
    for b, m in zip(got, moved):
        assert torch.equal(b["f32"], m.cpu())
