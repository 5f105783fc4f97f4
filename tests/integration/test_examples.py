"""The examples run as documented (small settings): sync, async on uvloop, DDP under torchrun."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"

pytestmark = pytest.mark.slow  # (make check leaves them out: frameworks, examples and the bench CLI)


def run(*args: str, timeout: float = 300) -> str:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=EXAMPLES.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"loss ([0-9.]+)", out)]


def test_train_sync() -> None:
    out = run(str(EXAMPLES / "train_sync.py"), "--epochs", "2")
    first, last = losses(out)
    assert last < first / 10 and "batches 128" in out


def test_train_async() -> None:
    out = run(str(EXAMPLES / "train_async.py"), "--epochs", "2")
    first, last = losses(out)
    assert last < first / 10
    # Each batch takes its worker >= 12.8 ms (64 samples x 0.2 ms), the training step far
    # less: the loop waits for most batches, and a heartbeat every 5 ms must keep beating
    # through those waits (a loader that blocked the loop while waiting would show 0).
    waiting = int(re.search(r"(\d+) of them while waiting for a batch", out).group(1))  # type: ignore[union-attr]
    assert waiting >= 20


def test_train_ddp_two_ranks(tmp_path: pathlib.Path) -> None:
    run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(EXAMPLES / "train_ddp.py"), "--epochs", "2", "--report", str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for epoch in (0, 1):
        a, b = (set(r["seen"][epoch]) for r in ranks)
        assert not a & b, "ranks' shards overlap"
        assert a | b == set(range(1000)), "the shards do not cover the dataset"
    assert ranks[0]["seen"][0] != ranks[0]["seen"][1]  # set_epoch reshuffled
    assert ranks[0]["segment"] != ranks[1]["segment"]
    assert all(r["workers_exited"] for r in ranks)
