"""device="cuda": batches arrive on the GPU bit-exact, ordered after their copies, and a slot is
never rewritten while its copy is in flight."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest
import torch
import uvloop

import shmloader
from shmloader.main import device as _device
from tests.datasets import Blocks, Range, Rich, check_blocks


def test_device_batches_equal_cpu_batches_bit_for_bit() -> None:
    loader = shmloader.DataLoader(Rich(64), batch_size=8, num_workers=2, device="cuda")
    reference = list(torch.utils.data.DataLoader(Rich(64), batch_size=8))
    got = list(loader)
    assert len(got) == len(reference)
    for b, r in zip(got, reference):
        assert b["f32"].device.type == "cuda" and b["point"].x.device.type == "cuda"
        assert torch.equal(b["f32"].cpu(), r["f32"]) and torch.equal(b["u8"].cpu(), r["u8"])
        assert torch.equal(b["nested"]["a"]["b"].cpu(), r["nested"]["a"]["b"])
        assert b["str"] == r["str"] and b["bytes"] == r["bytes"]


def test_a_slot_is_not_reused_while_its_copy_is_in_flight() -> None:
    # Two slots, and a side stream slowed down after every batch: if a slot went back to
    # the workers before its copy finished, a later batch would be torn or stale.
    loader = shmloader.DataLoader(Blocks(400), batch_size=2, num_workers=2, prefetch_factor=1,
                                  device="cuda", device_prefetch=1)
    it = iter(loader)
    for i in range(200):
        batch = next(it)
        assert it._life.scope.stager is not None
        with torch.cuda.stream(it._life.scope.stager.stream):
            torch.cuda._sleep(2_000_000)  # delay the copies still to come
        torch.cuda._sleep(1_000_000)  # and a slow consumer stream
        check_blocks(batch, 2 * i, device="cuda")
    with pytest.raises(StopIteration):
        next(it)


def test_registration_is_undone_when_the_loader_is_gone() -> None:
    before = _device.registered()
    loader = shmloader.DataLoader(Range(20), batch_size=4, num_workers=2, device="cuda")
    it = iter(loader)
    next(it)
    assert it.pinned and len(_device.registered() - before) == 1
    for _ in it:
        pass
    del it, loader
    gc.collect()
    assert _device.registered() == before


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run])
def test_async_device_delivery(run: Any) -> None:
    loader = shmloader.DataLoader(Blocks(64), batch_size=4, num_workers=2, device="cuda:0")

    async def collect() -> list[torch.Tensor]:
        return [b async for b in loader]

    for i, batch in enumerate(run(collect())):
        check_blocks(batch, 4 * i, device="cuda")


def test_out_of_order_and_persistent_epochs_on_device() -> None:
    got = list(shmloader.DataLoader(Blocks(60), batch_size=3, num_workers=2, in_order=False, device="cuda"))
    firsts = sorted(int(b[0, 0]) for b in got)
    assert firsts == list(range(0, 60, 3))
    loader = shmloader.DataLoader(Blocks(30), batch_size=3, num_workers=2, persistent_workers=True, device="cuda")
    for i, batch in enumerate(loader):
        if i == 3:
            break
    for epoch in range(2):
        batches = list(loader)
        assert len(batches) == 10
        for i, batch in enumerate(batches):
            check_blocks(batch, 3 * i, device="cuda")
    loader._iterator._shutdown_workers()


def test_device_needs_workers() -> None:
    with pytest.raises(ValueError, match="needs num_workers > 0"):
        shmloader.DataLoader(Range(4), device="cuda")


def test_a_worker_error_comes_after_the_batches_before_it() -> None:
    from tests.datasets import Failing

    got = []
    with pytest.raises(ValueError, match="sample 13 is broken"):
        for batch in shmloader.DataLoader(Failing(40, bad=13), batch_size=4, num_workers=2, device="cuda"):
            got.append(batch.cpu().flatten().tolist())
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_device_delivery_survives_worker_kills(context: str) -> None:
    import os
    import random
    import signal

    seed = random.randrange(2**32)
    print(f"kill schedule seed: {seed}")
    rng = random.Random(seed)
    loader = shmloader.DataLoader(Blocks(640), batch_size=8, num_workers=2, device="cuda", max_worker_restarts=20,
                                  multiprocessing_context=context)
    it = iter(loader)
    n = 0
    for n, batch in enumerate(it, 1):
        check_blocks(batch, 8 * (n - 1), device="cuda")
        if n in (7, 31, 55):
            os.kill(rng.choice([p.pid for p in it._life.pool.procs if p.exitcode is None]), signal.SIGKILL)
    assert n == 80 and loader.stats().worker_restarts >= 1
