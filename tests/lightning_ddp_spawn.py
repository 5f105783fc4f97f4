"""Lightning fits from a shmloader loader with strategy="ddp_spawn" (2 CPU processes): the
loader is pickled into each rank, re-created there with a DistributedSampler, and carries
every batch through its ring. Run by tests/integration/test_ecosystem.py."""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])  # the repo, not tests/ (its datasets.py would shadow HF datasets)

import lightning  # noqa: E402
import torch  # noqa: E402

import shmloader  # noqa: E402
from tests.datasets import Range  # noqa: E402


class Model(lightning.LightningModule):
    def __init__(self, report: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.report = report
        self.seen: list[int] = []

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        self.seen += batch.flatten().tolist()
        return self.layer(batch.float()).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.001)

    def on_train_end(self) -> None:
        loader = self.trainer.train_dataloader
        line = {"rank": self.global_rank, "class": f"{type(loader).__module__}.{type(loader).__name__}", "seen": self.seen,
                "ring_batches": loader.stats().batches if isinstance(loader, shmloader.DataLoader) else 0}
        with open(f"{self.report}.{self.global_rank}", "w") as f:
            json.dump(line, f)


def main() -> None:
    loader = shmloader.DataLoader(Range(64), batch_size=4, num_workers=2)
    trainer = lightning.Trainer(strategy="ddp_spawn", accelerator="cpu", devices=2, max_epochs=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model(sys.argv[1]), train_dataloaders=loader)


if __name__ == "__main__":
    main()
