"""Frameworks that re-create a DataLoader from its attributes (Lightning, Accelerate) to inject
a DistributedSampler."""

from __future__ import annotations

import importlib.util
import inspect
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

import shmloader
from tests.datasets import Range

pytestmark = pytest.mark.slow  # (make check leaves them out: frameworks, examples and the bench CLI)


def reinstantiate(loader: torch.utils.data.DataLoader, sampler: Any) -> Any:  # type: ignore[type-arg]
    """What Lightning does: read the constructor's arguments back from the instance, replace the
    sampler, and call the loader's own class."""
    params = inspect.signature(type(loader).__init__).parameters
    kwargs = {name: getattr(loader, name) for name in params if name != "self" and hasattr(loader, name)}
    kwargs.update(sampler=sampler, batch_sampler=None, shuffle=False)
    return type(loader)(**kwargs)


def test_reinstantiation_keeps_the_class_and_every_option() -> None:
    loader = shmloader.DataLoader(Range(40), batch_size=4, num_workers=2, prefetch_factor=3, drop_last=True,
                                  slot_bytes=1 << 16, memory_budget="8MiB", max_worker_restarts=7, in_order=False)
    shards = []
    for rank in (0, 1):
        new = reinstantiate(loader, DistributedSampler(loader.dataset, num_replicas=2, rank=rank, shuffle=False))
        assert type(new) is shmloader.DataLoader and isinstance(new, torch.utils.data.DataLoader)
        for name in ("batch_size", "num_workers", "prefetch_factor", "drop_last", "slot_bytes", "memory_budget",
                     "max_worker_restarts", "in_order", "device", "device_prefetch"):
            assert getattr(new, name) == getattr(loader, name), name
        shards.append(sorted(int(v) for b in new for v in b.flatten()))
    assert not set(shards[0]) & set(shards[1]) and sorted(shards[0] + shards[1]) == list(range(40))


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed")
def test_accelerate_prepare_without_install_warns_once_that_the_ring_is_lost() -> None:
    # Accelerate's prepare_data_loader builds its own DataLoaderShard (a torch DataLoader) from
    # the attributes: batches are right, but without shmloader.install() the ring is not used,
    # and the user is told so, once.
    from accelerate.data_loader import prepare_data_loader

    loader = shmloader.DataLoader(Range(40), batch_size=4, num_workers=2)
    shards = []
    with pytest.warns(UserWarning, match=r"a torch DataLoader over the dataset of a shmloader.DataLoader will not "
                                         r"use shmloader's ring: .* Call shmloader.install\(\)") as caught:
        # Python >= 3.12 warns when a process with threads forks (torch's workers, here, on a
        # machine whose torch runs CUDA threads): not what this test is about.
        warnings.filterwarnings("ignore", r"This process .* is multi-threaded, use of fork\(\)", DeprecationWarning)
        for rank in (0, 1):
            prepared = prepare_data_loader(loader, num_processes=2, process_index=rank, put_on_device=False)
            assert not isinstance(prepared, shmloader.DataLoader)
            shards.append(sorted(int(v) for b in prepared for v in b.flatten()))
    assert len([w for w in caught if "shmloader's ring" in str(w.message)]) == 1
    assert sorted(shards[0] + shards[1]) == list(range(40))


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning is not installed")
def test_lightning_update_dataloader_keeps_shmloader() -> None:
    from lightning.fabric.utilities.data import _update_dataloader

    loader = shmloader.DataLoader(Range(40), batch_size=4, num_workers=2, slot_bytes=1 << 16, max_worker_restarts=5)
    shards = []
    for rank in (0, 1):
        new = _update_dataloader(loader, DistributedSampler(loader.dataset, num_replicas=2, rank=rank, shuffle=False))
        assert type(new) is shmloader.DataLoader
        assert (new.slot_bytes, new.max_worker_restarts, new.num_workers) == (1 << 16, 5, 2)
        shards.append(sorted(int(v) for b in new for v in b.flatten()))
    assert not set(shards[0]) & set(shards[1]) and sorted(shards[0] + shards[1]) == list(range(40))


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning is not installed")
def test_lightning_ddp_spawn_fits_from_a_shmloader_loader(tmp_path: Any) -> None:
    # ddp_spawn pickles the loader into each rank (it could not be pickled before): each rank
    # re-creates it with a DistributedSampler and every batch comes through its ring.
    import json
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[1] / "lightning_ddp_spawn.py"
    report = tmp_path / "rank"
    done = subprocess.run([sys.executable, str(script), str(report)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank.{r}").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["class"] == "shmloader.DataLoader" and rank["ring_batches"] == 8
    assert not set(ranks[0]["seen"]) & set(ranks[1]["seen"])
    assert sorted(ranks[0]["seen"] + ranks[1]["seen"]) == list(range(64))


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_transformers_trainer_through_the_ring_and_resumed_mid_epoch(tmp_path: Any) -> None:
    # Unmodified Trainer + shmloader.install(): every batch comes through the ring, the loss
    # falls, and resuming from a mid-epoch checkpoint (step 15 of 24, epoch 2) trains on
    # exactly the batches the uninterrupted run trained on after it.
    import json
    import pathlib
    import shutil
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[1] / "transformers_trainer.py"

    def train(out: pathlib.Path, mode: str) -> dict[str, Any]:
        done = subprocess.run([sys.executable, str(script), str(out), "24", mode], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads((out / "report.json").read_text())  # type: ignore[no-any-return]

    whole = train(tmp_path / "whole", "fresh")
    assert len(whole["seen"]) == 24 and all(whole["ring"])
    first, last = whole["losses"][:4], whole["losses"][-4:]
    assert sum(last) < sum(first)
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "whole" / "checkpoint-15", resumed_dir / "checkpoint-15")
    resumed = train(resumed_dir, "resume")
    assert resumed["seen"] == whole["seen"][15:] and all(resumed["ring"])
