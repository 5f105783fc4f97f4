from __future__ import annotations

import gc
import multiprocessing
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from shmloader.wire.shm import SEGMENT_PREFIX, SHM_DIR
from tests.fakes import FakeStream, install_fake_cuda


def ours() -> set[str]:
    """Our segments, and named semaphores of the kind shmloader once made (it makes none now)."""
    return {n for n in os.listdir(SHM_DIR) if n.startswith(SEGMENT_PREFIX) or n.startswith("sem.shml-")}


@pytest.fixture(scope="session", autouse=True)
def nothing_left_in_dev_shm() -> Iterator[None]:
    before = ours()
    yield
    gc.unfreeze()
    gc.collect()
    assert ours() - before == set(), "shmloader left entries in /dev/shm"


@pytest.fixture(autouse=True)
def workers_stopped() -> Iterator[None]:
    before = ours()
    yield
    gc.collect()
    children = multiprocessing.active_children()
    assert not [c for c in children if c.name.startswith("shmloader-worker")], children
    assert ours() - before == set()
    # What is alive now is not this test's garbage: later collections skip it. A full
    # collection costs 0.25-0.4 s once transformers and lightning are imported, a third of
    # the run's time when every test paid it. The session's end unfreezes and collects all.
    gc.freeze()


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeStream:
    """torch.cuda's streams and events faked (tests/fakes.py): device delivery on the CPU."""
    return install_fake_cuda(monkeypatch)


async def drain(loader: Any) -> list[Any]:
    """Every batch of one ``async for`` over ``loader``."""
    return [b async for b in loader]


def same(a: Any, b: Any) -> None:
    """Assert two batches are equal type for type and bit for bit."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
        assert raw(a) == raw(b), (a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif hasattr(a, "dtype") and hasattr(a, "tobytes"):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    else:
        assert a == b or (a != a and b != b), (a, b)


def raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes in logical order (bit-exact, NaNs included)."""
    if t.numel() == 0:
        return b""
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


CHECK = os.environ.get("SHMLOADER_TEST_TIER") == "check"  # make check: the edit-test loop's tier


def examples(n: int) -> int:
    """A property test's example count: ``n``, or about a fifth of it in ``make check``."""
    return max(3, n // 5) if CHECK else n


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` are skipped, with the reason, where CUDA is missing. A test run
    under the spawn or forkserver start method (a parameter of that name) is ``slow``: each
    worker imports torch afresh."""
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        params = getattr(item, "callspec", None)
        if params is not None and {"spawn", "forkserver"} & {v for v in params.params.values() if isinstance(v, str)}:
            item.add_marker(pytest.mark.slow)
        if not torch.cuda.is_available() and item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
