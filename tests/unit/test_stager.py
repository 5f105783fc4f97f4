"""DeviceStager's bookkeeping on the CPU, with CUDA streams and events stood in by fakes:
delivery order, notes, bytes, and slots returned only once their copy's event completed.
(tests/cuda runs the real thing on a GPU.)"""

from __future__ import annotations

import mmap
from typing import Any

import pytest
import torch

from shmloader.main import device as _device
from shmloader.wire.layout import Field, RingGeometry
from shmloader.wire.ring import _Views
from shmloader.worker.collate import SlotWriter
from tests.fakes import FakeEvent, FakeStream


def ring_with_batches(values: list[int]) -> _Views:
    g = RingGeometry(num_workers=1, num_slots=len(values), data_bytes=1 << 14)
    views = _Views(g, mmap.mmap(-1, g.total_bytes))
    writer = SlotWriter(views.mm)
    for slot, v in enumerate(values):
        writer.begin(views.data_offsets[slot], g.data_bytes)
        writer.finish({"x": torch.full((4,), v), "n": v})
        hdr = views.headers[slot]
        hdr[Field.TABLE_OFF], hdr[Field.TABLE_LEN] = writer.table_off, writer.table_len
        hdr[Field.PICKLED_OFF], hdr[Field.PICKLED_LEN] = writer.pickled_off, writer.pickled_len
    return views


def test_stager_delivers_in_order_and_frees_slots_only_after_their_copy(fake_cuda: FakeStream) -> None:
    views = ring_with_batches([10, 11, 12])
    stager = _device.DeviceStager(torch.device("cpu"), depth=2)
    assert stager.stage(views, 0, note="a") == 32  # type: ignore[arg-type]
    assert stager.stage(views, 1, note="b") == 32  # type: ignore[arg-type]
    assert not stager.has_room()
    assert stager.reap() == []  # no copy has completed: no slot goes back
    batch, note = stager.pop()
    assert note == "a" and batch["n"] == 10 and torch.equal(batch["x"], torch.full((4,), 10))
    events = stager.stream.events
    assert events[0].waited_on and not events[1].waited_on
    events[0].done = True
    assert stager.reap() == [0]
    assert stager.reap(block=True) == [1] and events[1].done  # waits for the oldest when asked
    stager.stage(views, 2, note="c")  # type: ignore[arg-type]
    assert [n for _, _, _, n in stager.staged] == ["b", "c"]
    stager.drain()
    assert not stager.staged and stager.reap() == [2]


def test_device_delivery_survives_worker_kills(fake_cuda: FakeStream, monkeypatch: pytest.MonkeyPatch) -> None:
    # The whole loader with device delivery, its CUDA stood in by the fakes ("copies" to the
    # CPU): workers killed mid-epoch lose no staged batch and duplicate none.
    import os
    import random
    import signal

    import shmloader
    from tests.datasets import Blocks, check_blocks

    monkeypatch.setattr(_device, "register_host", lambda mm, nbytes, cudart=None: False)
    loader = shmloader.DataLoader(Blocks(640, words=1024), batch_size=8, num_workers=2, prefetch_factor=3,
                                  max_worker_restarts=100)
    loader._shm_device = torch.device("cpu")  # device= without CUDA: what parse_device would refuse
    seed = random.randrange(2**32)
    print(f"kill schedule seed: {seed}")
    rng = random.Random(seed)
    it = iter(loader)
    n = 0
    for n, batch in enumerate(it, 1):
        assert it._life.scope.stager is not None
        check_blocks(batch.clone(), 8 * (n - 1))  # a CPU "copy" views the slot: check it at once
        if rng.random() < 0.1:
            os.kill(rng.choice([p.pid for p in it._life.pool.procs if p.exitcode is None]), signal.SIGKILL)
    assert n == 80
    assert loader.stats().worker_restarts >= 1


class GatedEvent(FakeEvent):
    """A copy that completes only when the test's ticker says so. Waiting on it blocks (here:
    raises), which ``async for`` must never do."""

    made: list[GatedEvent] = []

    def __init__(self) -> None:
        super().__init__()
        GatedEvent.made.append(self)

    def synchronize(self) -> None:
        raise AssertionError("a device copy was waited for by blocking the event loop")


class GatedStream(FakeStream):
    def synchronize(self) -> None:
        if any(not e.done for e in self.events):
            raise AssertionError("shutting down blocked the event loop on a running copy")


def test_async_for_waits_for_device_copies_without_blocking_the_loop(
    fake_cuda: FakeStream, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two slots, one staged batch: the consumer keeps running out of free slots and must wait
    # for a copy, and the epoch ends with copies running. Each copy completes only when a
    # ticker coroutine runs, so every batch arrives only if the loop kept turning.
    import asyncio

    import shmloader
    from tests.datasets import Range

    GatedEvent.made = []
    monkeypatch.setattr(torch.cuda, "Event", GatedEvent)
    monkeypatch.setattr(torch.cuda, "Stream", GatedStream)
    monkeypatch.setattr(_device, "register_host", lambda mm, nbytes, cudart=None: False)
    loader = shmloader.DataLoader(Range(40), batch_size=4, num_workers=2, prefetch_factor=1, device_prefetch=1)
    loader._shm_device = torch.device("cpu")  # device= without CUDA: the "copies" stay on the CPU
    got: list[list[int]] = []
    ticks = 0

    async def consume() -> None:
        async for batch in loader:
            got.append(batch.flatten().tolist())

    async def ticker(consumer: asyncio.Future[None]) -> None:
        nonlocal ticks
        while not consumer.done():
            ticks += 1
            running = [e for e in GatedEvent.made if not e.done]
            if running:
                running[0].done = True  # the oldest copy completes
            await asyncio.sleep(0)

    async def main() -> None:
        consumer = asyncio.ensure_future(consume())
        await asyncio.gather(consumer, ticker(consumer))

    asyncio.run(main())
    assert got == [list(range(i, i + 4)) for i in range(0, 40, 4)]
    assert len(GatedEvent.made) == 10 and all(e.done for e in GatedEvent.made)
    assert ticks >= 10


class InstantEvent(FakeEvent):
    """A copy that has completed as soon as it is recorded."""

    def record(self, stream: Any) -> None:
        super().record(stream)
        self.done = True


@pytest.mark.parametrize("prefetch_factor", [1, 2])
def test_device_delivery_dispatches_again_after_staging(
    fake_cuda: FakeStream, monkeypatch: pytest.MonkeyPatch, prefetch_factor: int
) -> None:
    # Batches staged for their device copy leave the tasks, as a delivered one does: the
    # next task is dispatched in the same next(), so the step runs with num_workers *
    # prefetch_factor batches drawn ahead (torch's count), never more.
    import shmloader
    from tests.integration.test_semantics import ahead

    monkeypatch.setattr(torch.cuda, "Event", InstantEvent)
    monkeypatch.setattr(_device, "register_host", lambda mm, nbytes, cudart=None: False)

    def make(dataset: Any, **kwargs: Any) -> Any:
        loader = shmloader.DataLoader(dataset, **kwargs)
        loader._shm_device = torch.device("cpu")  # device= without CUDA, its streams faked
        return loader

    seen = ahead(make, False, prefetch_factor)
    assert max(seen) == 2 * prefetch_factor, seen
