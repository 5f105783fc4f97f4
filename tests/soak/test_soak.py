"""Soak (make soak; excluded from the default run): long runs with workers killed at random,
and 100,000 fuzzed slots (header fields and tables, and slots written by a worker, then damaged). Prints its figures for bench/RESULTS.md."""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import random
import resource
import signal
import time
from typing import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset

import shmloader
from shmloader import _native
from shmloader.main.lease import read_batch
from shmloader.wire.layout import LONE_LEAF, Field, RingGeometry
from shmloader.wire.ring import _Views
from shmloader.worker.collate import SlotWriter

pytestmark = [pytest.mark.soak, pytest.mark.timeout(1800)]


class Rows(Dataset):  # type: ignore[type-arg]
    """Sample i: float32[16] all equal to i (exact below 2**24)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((16,), float(i))


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.parametrize("context, batches, every", [("fork", 200_000, 5000), ("spawn", 40_000, 2000),
                                                      ("forkserver", 40_000, 2000)])
def test_tiny_batches_with_workers_killed_at_random(context: str, batches: int, every: int) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    bs = 32
    # spawn and forkserver open one fd of their own, once per process (the resource tracker,
    # the fork server): a first short run opens it before the count
    list(shmloader.DataLoader(Rows(64), batch_size=bs, num_workers=2, multiprocessing_context=context))
    gc.collect()
    fds_before = len(os.listdir("/proc/self/fd"))
    shm_before = sorted(os.listdir("/dev/shm"))
    loader = shmloader.DataLoader(Rows(batches * bs), batch_size=bs, num_workers=2, max_worker_restarts=1000,
                                  multiprocessing_context=context)
    offsets = torch.arange(bs, dtype=torch.float32)[:, None].expand(bs, 16)
    it = iter(loader)
    kills = 0
    rss_warm = 0
    start = time.perf_counter()
    for k, batch in enumerate(it):
        if not torch.equal(batch, offsets + float(k * bs)):
            raise AssertionError(f"batch {k} has wrong contents (kill schedule seed {seed})")
        if k == 10_000:
            gc.collect()
            rss_warm = rss_bytes()
        if rng.random() < 1 / every:
            os.kill(rng.choice([p.pid for p in it._life.pool.procs if p.exitcode is None]), signal.SIGKILL)
            kills += 1
    elapsed = time.perf_counter() - start
    assert k == batches - 1, f"{k + 1} batches (seed {seed})"
    del batch
    gc.collect()
    rss_end = rss_bytes()
    restarts = loader.stats().worker_restarts
    del it, loader
    gc.collect()
    fds_after = len(os.listdir("/proc/self/fd"))
    print(f"\nsoak ({context}): {batches:,} batches in {elapsed:.1f} s ({batches / elapsed:,.0f}/s), {kills} kills, "
          f"{restarts} restarts, RSS {rss_warm / 2**20:.1f} -> {rss_end / 2**20:.1f} MiB "
          f"(+{(rss_end - rss_warm) / 2**20:.2f}), fds {fds_before} -> {fds_after}, seed {seed}")
    assert restarts >= kills - 1 and kills > 5
    assert rss_end - rss_warm < 5 * 2**20
    assert fds_after == fds_before
    assert sorted(os.listdir("/dev/shm")) == shm_before


GEOMETRY = RingGeometry(num_workers=1, num_slots=1, data_bytes=1 << 16)
VIEWS = _Views(GEOMETRY, mmap.mmap(-1, GEOMETRY.total_bytes))
FIELD = st.integers(-(2**63), 2**63 - 1) | st.integers(0, 1 << 17)
# What read_batch may raise for a corrupted slot besides CorruptSlotError: a skeleton that names
# a class the main process lacks (what a class defined only in the worker raises, too).
NAMED_MISSING = (ImportError, AttributeError)


@contextlib.contextmanager
def memory_headroom(extra: int = 2 << 30) -> Iterator[None]:
    """Address space capped at what this process maps now plus ``extra`` bytes, for the block.

    A damaged skeleton can ask the unpickler for any amount of memory: a byte flipped into a
    LONG_BINPUT opcode names a memo index of up to 2**32, and CPython grows the memo to twice
    that and zero-fills it (tens of GB, touched: the OOM killer took this test twice on a
    24 GiB machine). Capped, the allocation fails, and read_batch reports the skeleton as
    CorruptSlotError (it does not unpickle: MemoryError)."""
    with open("/proc/self/status") as f:
        mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = mapped + extra
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def read_honestly(where: str) -> None:
    """read_batch of slot 0: a batch, or CorruptSlotError (or a missing class), nothing else."""
    try:
        with memory_headroom():
            read_batch(VIEWS, 0)  # type: ignore[arg-type]
    except (shmloader.CorruptSlotError, *NAMED_MISSING):
        pass


@settings(max_examples=50_000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(table=st.binary(max_size=400), table_off=FIELD, table_len=FIELD, count=st.integers(0, 20))
def test_fuzz_50k_slot_headers(table: bytes, table_off: int, table_len: int, count: int) -> None:
    """Random leaf tables and header fields, mostly out of range: a batch or CorruptSlotError."""
    base = VIEWS.data_offsets[0]
    payload = (0x544C4853 | count << 32).to_bytes(8, "little") + table
    VIEWS.bytes[base : base + len(payload)] = list(payload)
    pickled_off = 1 << 15
    VIEWS.bytes[base + pickled_off : base + pickled_off + len(LONE_LEAF)] = list(LONE_LEAF)
    hdr = VIEWS.headers[0]
    hdr[Field.REGION] = 0
    hdr[Field.TABLE_OFF], hdr[Field.TABLE_LEN] = table_off, table_len
    hdr[Field.PICKLED_OFF], hdr[Field.PICKLED_LEN] = pickled_off, len(LONE_LEAF)
    try:
        batch, _, nbytes = read_batch(VIEWS, 0)  # type: ignore[arg-type]
    except shmloader.CorruptSlotError:
        return
    leaves = _native.decode_table(VIEWS.mm, base + table_off, table_len, GEOMETRY.data_bytes)
    assert len(leaves) == 1 and nbytes == leaves[0][3]


BATCHES = st.recursive(
    st.integers(0, 3).map(lambda n: torch.arange(n * 4, dtype=torch.float32).reshape(n, 4)) | st.text(max_size=5)
    | st.integers(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4),
    max_leaves=8,
)


@settings(max_examples=50_000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(batch=BATCHES, flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=4),
       target=st.sampled_from(["skeleton", "table", "offsets"]))
def test_fuzz_50k_written_slots_mutated(batch: object, flips: list[tuple[int, int]], target: str) -> None:
    """A slot as a worker writes it (SlotWriter), then damaged where the checks must hold:
    bytes of the skeleton or of the leaf table, or header offsets moved to other in-range
    places. A batch, or CorruptSlotError (or a missing class), never a crash or another error."""
    writer = SlotWriter(VIEWS.mm)
    writer.begin(VIEWS.data_offsets[0], GEOMETRY.data_bytes)
    writer.finish(batch)
    hdr = VIEWS.headers[0]
    hdr[Field.REGION] = 0
    hdr[Field.TABLE_OFF], hdr[Field.TABLE_LEN] = writer.table_off, writer.table_len
    hdr[Field.PICKLED_OFF], hdr[Field.PICKLED_LEN] = writer.pickled_off, writer.pickled_len
    base = VIEWS.data_offsets[0]
    if target == "offsets":
        for at, value in flips:
            field = (Field.TABLE_OFF, Field.TABLE_LEN, Field.PICKLED_OFF, Field.PICKLED_LEN)[value % 4]
            hdr[field] = (at % GEOMETRY.data_bytes) // 8 * 8
    else:
        off, length = ((writer.pickled_off, writer.pickled_len) if target == "skeleton"
                       else (writer.table_off, writer.table_len))
        for at, value in flips:
            if length:
                VIEWS.bytes[base + off + at % length] = value
    read_honestly(target)
