"""Pinning the ring: failures are loud, successes are undone when the mapping dies."""

from __future__ import annotations

import gc
import mmap

import pytest

from shmloader import _device


class FakeCudart:
    def __init__(self, register_result: int) -> None:
        self.register_result = register_result
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.registered.append((ptr, size))
        return self.register_result

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def test_registration_failure_warns_with_what_was_lost() -> None:
    fake = FakeCudart(register_result=2)
    mm = mmap.mmap(-1, 8192)
    with pytest.warns(RuntimeWarning, match=r"cudaHostRegister of the 8,192-byte .* failed with CUDA error 2.*pageable"):
        assert not _device.register_host(mm, 8192, cudart=fake)
    del mm
    gc.collect()
    assert fake.unregistered == []


def test_registration_is_undone_when_the_mapping_is_freed() -> None:
    fake = FakeCudart(register_result=0)
    mm = mmap.mmap(-1, 8192)
    assert _device.register_host(mm, 8192, cudart=fake)
    ptr = fake.registered[0][0]
    assert fake.unregistered == []
    del mm
    gc.collect()
    assert fake.unregistered == [ptr]
