"""Fixed seeds reproduce torch's run: random augmentation drawn from each worker's torch,
numpy and random RNGs gives the same pixels as torch's DataLoader, on every run, whatever
the timing (the batch -> worker assignment is torch's round robin, not first-come)."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import shmloader
from tests.conftest import same
from tests.datasets import Augmented


def run(cls: Any, persistent: bool, jitter: random.Random | None) -> list[list[Any]]:
    loader = cls(Augmented(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=persistent,
                 generator=torch.Generator().manual_seed(0))
    epochs = []
    for _ in range(2):
        batches = []
        for batch in loader:
            batches.append(batch)
            if jitter is not None:  # a training step of random length: the workers' timing varies
                end = time.perf_counter() + jitter.uniform(0, 0.004)
                while time.perf_counter() < end:
                    pass
        epochs.append(batches)
    return epochs


@pytest.mark.parametrize("persistent", [False, True])
def test_fixed_seed_augmentation_is_torchs_on_every_run(persistent: bool) -> None:
    want = run(tud.DataLoader, persistent, None)
    seed = random.randrange(2**32)
    print(f"step-length seed: {seed}")
    for k in range(3):
        same(run(shmloader.DataLoader, persistent, random.Random(seed + k)), want)
