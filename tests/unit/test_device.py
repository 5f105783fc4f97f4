"""Pinning the ring: failures are loud, successes are undone when the mapping dies, while
its memory is still mapped."""

from __future__ import annotations

import gc
import mmap

import pytest

from shmloader.main import device as _device
from shmloader.wire.shm import Mapping


def mapped(ptr: int) -> bool:
    """Whether address ``ptr`` lies in a mapping of this process (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False


class FakeCudart:
    def __init__(self, register_result: int, unregister_result: int = 0) -> None:
        self.register_result = register_result
        self.unregister_result = unregister_result
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.mapped_when_unregistered: list[bool] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.registered.append((ptr, size))
        return self.register_result

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        self.mapped_when_unregistered.append(mapped(ptr))  # the real call fails on unmapped memory
        return self.unregister_result


def test_registration_failure_warns_with_what_was_lost() -> None:
    fake = FakeCudart(register_result=2)
    mm = Mapping(-1, 8192)
    with pytest.warns(RuntimeWarning, match=r"cudaHostRegister of the 8,192-byte .* failed with CUDA error 2.*pageable"):
        assert not _device.register_host(mm, 8192, cudart=fake)
    del mm
    gc.collect()
    assert fake.unregistered == []


@pytest.mark.parametrize("how", ["last view dies", "close"])
def test_registration_is_undone_before_the_memory_is_unmapped(how: str) -> None:
    import numpy as np

    fake = FakeCudart(register_result=0)
    mm = Mapping(-1, 8192)
    assert _device.register_host(mm, 8192, cudart=fake)
    ptr = fake.registered[0][0]
    assert fake.unregistered == [] and ptr in _device.registered()
    if how == "close":
        mm.close()
    else:
        view = np.frombuffer(mm, dtype=np.uint8)  # a batch's view keeps the mapping
        del mm
        gc.collect()
        assert fake.unregistered == []
        del view
        gc.collect()
    assert fake.unregistered == [ptr] and fake.mapped_when_unregistered == [True]
    assert ptr not in _device.registered() and not mapped(ptr)


def test_a_failed_unregistration_is_said() -> None:
    fake = FakeCudart(register_result=0, unregister_result=1)
    mm = Mapping(-1, 8192)
    assert _device.register_host(mm, 8192, cudart=fake)
    with pytest.warns(RuntimeWarning, match="cudaHostUnregister of a 8,192-byte shmloader mapping failed with CUDA error 1"):
        mm.close()


def test_only_a_mapping_that_unregisters_first_can_be_registered() -> None:
    with pytest.raises(TypeError, match="needs a shmloader.wire.shm.Mapping"):
        _device.register_host(mmap.mmap(-1, 8192), 8192, cudart=FakeCudart(register_result=0))
