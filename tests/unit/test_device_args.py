"""device= and device_prefetch= are validated at construction, with what to do."""

from __future__ import annotations

import pytest
import torch

import shmloader
from tests.conftest import same
from tests.datasets import Range


def test_cpu_device_gives_cpu_batches() -> None:
    got = list(shmloader.DataLoader(Range(6), batch_size=2, num_workers=1, device="cpu"))
    same(got, list(torch.utils.data.DataLoader(Range(6), batch_size=2)))
    got = list(shmloader.DataLoader(Range(6), batch_size=2, num_workers=1, device=torch.device("cpu")))
    same(got, list(torch.utils.data.DataLoader(Range(6), batch_size=2)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_cuda_device_without_cuda_is_a_clear_error(device: object) -> None:
    with pytest.raises(RuntimeError, match=r"needs CUDA, but torch.cuda.is_available\(\) is False.*device=None"):
        shmloader.DataLoader(Range(6), num_workers=1, device=device)


@pytest.mark.parametrize(
    "kw, error, message",
    [
        ({"device": "meta"}, ValueError, "CUDA devices only"),
        ({"device": "nonsense"}, ValueError, "device should be None, 'cpu'"),
        ({"device_prefetch": 0}, ValueError, "device_prefetch should be a positive int"),
    ],
)
def test_bad_device_arguments(kw: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        shmloader.DataLoader(Range(6), num_workers=1, **kw)  # type: ignore[arg-type]
