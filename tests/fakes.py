"""CUDA streams and events stood in by fakes, for device delivery on the CPU (tests/cuda runs
the real thing on a GPU). The ``fake_cuda`` fixture (tests/conftest.py) installs them."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch


class FakeEvent:
    def __init__(self) -> None:
        self.done = False
        self.waited_on = False

    def record(self, stream: Any) -> None:
        stream.events.append(self)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class FakeStream:
    def __init__(self, device: Any = None) -> None:
        self.events: list[FakeEvent] = []

    def synchronize(self) -> None:
        for e in self.events:
            e.done = True

    def wait_event(self, event: FakeEvent) -> None:
        event.waited_on = True


def install_fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeStream:
    """Fakes for torch.cuda's streams and events, and host registration that declines (so
    ``device=`` runs on the CPU); returns the consumer's stream."""
    from shmloader.main import device as _device
    monkeypatch.setattr(_device, "register_host", lambda mm, nbytes, cudart=None: False)
    consumer = FakeStream()
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: consumer)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None, raising=False)
    return consumer


def fake_device(loader: Any) -> Any:
    """``loader`` with device delivery to the CPU: ``device=`` without CUDA, which parse_device
    refuses, set behind its back; the copies go through the fakes."""
    loader._shm_device = torch.device("cpu")
    return loader
