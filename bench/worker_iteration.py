"""A worker's per-batch cost, hot, in one process: one iteration of the worker loop (task
read and index decode, fetch, collate into the slot, skeleton, publish) on a ring without a peer,
against limit_probe's bare-ring worker (a list of samples, ``torch.stack(out=)``), and the
parts of the iteration on their own. limit_probe's workloads; µs, best of seven.

Usage: python bench/worker_iteration.py [tiny|tokens|image]
"""

from __future__ import annotations

import sys
import time
import timeit
from pathlib import Path

import torch
from torch.utils.data._utils import collate as torch_collate

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "shared" / "bench"))
import limit_probe as lp  # noqa: E402

from shmloader import _native, _worker  # noqa: E402
from shmloader._collate import SlotWriter, slot_collate_map  # noqa: E402
from shmloader._layout import RingGeometry  # noqa: E402
from shmloader._ring import AttachedRing, Ring  # noqa: E402


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "tokens"
    torch.set_num_threads(1)
    shape, dtype, bs, n = lp.WORK[name]
    ds = lp.Tagged(shape, dtype, n * bs)
    cfg = _worker.WorkerConfig(worker_id=0, num_workers=1, dataset=ds, iterable=False, auto_collation=True,
                               collate_fn=torch_collate.default_collate, drop_last=False, base_seed=0,
                               worker_init_fn=None, parent_pid=0)
    sample_bytes = torch.empty(shape, dtype=dtype).nbytes
    geometry = RingGeometry(1, 3, -(-(bs * sample_bytes + (1 << 16)) // 4096) * 4096)
    ring = Ring(geometry)
    worker = AttachedRing(geometry, ring.mm, 0)
    producer = _worker._Producer(cfg)
    writer = SlotWriter(worker.mm)
    fn_map = slot_collate_map(writer)
    index = list(range(bs))
    start = worker.data_offsets[1]

    def iteration() -> None:
        ring.post_task(0, 1, 0, 7, index)  # the main process's part, ~0.3 µs
        task = worker.take_task(0.5)
        assert type(task) is tuple
        slot, epoch, seq, idx = task
        began = time.monotonic_ns()
        writer.begin(worker.data_offsets[slot], worker.data_bytes)
        outcome, batch = producer.produce(epoch, idx, writer, fn_map)
        counters = worker.counters[0]
        counters[_worker._BUSY_NS] += time.monotonic_ns() - began
        counters[_worker._BATCHES] += 1
        _worker._deliver(worker, slot, cfg, writer, outcome, batch, producer.dataset_state, epoch, seq, None, -1)
        _native.sem_wait(ring.mm, ring.ready_sem, 0.0)

    items = ds.items
    view = torch.frombuffer(ring.mm, dtype=dtype, count=bs * sample_bytes // dtype.itemsize,
                            offset=worker.data_offsets[2]).view((bs, *shape))
    samples = [ds[i] for i in index]
    stack = fn_map[torch.Tensor]

    def bare_ring() -> None:
        torch.stack([items[i % len(items)] for i in range(bs)], out=view)

    def fetch() -> None:
        [ds[i] for i in index]

    def dtype_check() -> None:
        _native.same_attr(samples, "dtype")

    def torch_stack() -> None:
        torch.stack(samples, 0, out=view)

    def collate() -> None:
        writer.begin(start, worker.data_bytes)
        stack(samples, collate_fn_map=fn_map)

    def produce() -> None:
        writer.begin(start, worker.data_bytes)
        producer.produce(0, index, writer, fn_map)

    for part in (iteration, bare_ring, produce, fetch, collate, torch_stack, dtype_check):
        number = 300 if name == "image" else 3000
        best = min(timeit.repeat(part, number=number, repeat=7)) / number
        print(f"{name} {part.__name__:12s} {best * 1e6:8.2f} µs")
    ring.close()


if __name__ == "__main__":
    main()
