"""Issue 52's replay-buffer job, rebuilt from its description: an RL loop keeps every batch
(3 epochs of 200 batches of 64 x float32[1024], shuffled, 2 workers), sums each on receipt,
replays a random kept one after each, and hashes them all at the end. Prints the main
process's peak RSS (and its anonymous, file and shared-memory parts) and the process tree's
PSS, sampled every 50 batches, for torch's DataLoader and shmloader's, workers stopped after each
epoch or persistent. The hashes say both loops saw the same batches.

    python bench/replay_job.py
"""

from __future__ import annotations

import hashlib
import os
import random
import sys

import torch
import torch.utils.data as tud

import shmloader

FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


class Numbered(tud.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 200 * 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((1024,), float(i))


def main_rss() -> dict[str, int]:
    """This process's RSS and its parts, MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name = line.split(":")[0]
            if name in FIELDS:
                out[name] = int(line.split()[1]) // 1024
    return out


def tree_pss() -> int:
    """PSS of this process and its children (the workers), MiB."""
    me, pids = str(os.getpid()), [os.getpid()]
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and f.read().rsplit(")", 1)[1].split()[1] == me:
                    pids.append(int(entry))
        except (OSError, IndexError):
            continue
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except OSError:
            continue
    return total // 1024


def run(kind: str, persistent: bool) -> str:
    make = tud.DataLoader if kind == "torch" else shmloader.DataLoader
    loader = make(Numbered(), batch_size=64, shuffle=True, num_workers=2, persistent_workers=persistent,
                  generator=torch.Generator().manual_seed(0))
    kept: list[torch.Tensor] = []
    rng = random.Random(0)
    total = 0.0
    peak: dict[str, int] = {}

    def sample() -> None:
        now = {**main_rss(), "tree PSS": tree_pss()}
        peak.update({k: max(v, peak.get(k, 0)) for k, v in now.items()})

    for _ in range(3):
        for batch in loader:
            total += float(batch.sum())
            kept.append(batch)
            total += float(kept[rng.randrange(len(kept))].sum())
            if len(kept) % 50 == 0:
                sample()
    sample()
    digest = hashlib.sha256()
    for batch in kept:
        digest.update(batch.numpy().tobytes())
    copies = loader.stats().copies if hasattr(loader, "stats") else "-"
    parts = " | ".join(str(peak[k]) for k in (*FIELDS, "tree PSS"))
    return f"| {kind} | {persistent} | {parts} | {copies} | {digest.hexdigest()[:12]} |"


def main() -> None:
    print("| loader | persistent_workers | main VmRSS | RssAnon | RssFile | RssShmem | tree PSS | copies | hash |")
    print("|---|---|---|---|---|---|---|---|---|")
    for persistent in (False, True):
        for kind in ("torch", "shmloader"):
            print(run(kind, persistent), flush=True)


if __name__ == "__main__":
    sys.exit(main())
