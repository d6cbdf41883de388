"""A PyTorch Lightning module over a KSpeed dataset opened in ``train_dataloader()``, where
Lightning's process group exists, or in ``__init__``, before it does (its first process then
knows of no other; the second has ``LOCAL_RANK`` and ``WORLD_SIZE`` but no ``RANK``).
tests/integration/test_lightning.py trains it in the test's process, and runs this script as a
``ddp`` job of two CPU processes (Lightning starts the second by running the script again); each
rank records the sample IDs of each epoch and, as a script, writes them to ``<out>/rank-<rank>.json``."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytorch_lightning as pl
import torch

from kspeed import DatasetSpec, KSpeedClient


class Job(pl.LightningModule):
    """A model of one weight that records the sample IDs of each epoch's batches."""

    def __init__(self, client: KSpeedClient, uri: str, name: str, *, early: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.client, self.uri, self.name = client, uri, name
        self.ds: Any = self._open() if early else None
        self.seen: list[list[int]] = []

    def _open(self) -> Any:
        return self.client.dataset(DatasetSpec(name=self.name, uri=self.uri), batch_size=4, seed=7, quiet=True)

    def train_dataloader(self):
        if self.ds is None:
            self.ds = self._open()
        return self.ds

    def on_train_epoch_start(self) -> None:
        self.seen.append([])

    def training_step(self, batch, index):
        self.seen[-1].extend(batch.ids.tolist())
        return ((self.weight - 1.0) ** 2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(epochs: int, root: str, **options: Any) -> pl.Trainer:
    """A quiet CPU trainer (no logger, checkpoints, progress bar or sanity check)."""
    return pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
        **options,
    )


def main(uri: str, out: str, where: str) -> None:
    with KSpeedClient() as client:  # KSPEED_MANAGER and KSPEED_AUTH from the environment
        model = Job(client, uri, "lightning-ddp", early=where == "init")
        run = trainer(2, out, devices=2, strategy="ddp")
        run.fit(model)
        with open(os.path.join(out, f"rank-{run.global_rank}.json"), "w") as fh:
            json.dump({"rank": model.ds.rank, "world_size": model.ds.world_size, "epochs": model.seen}, fh)
        model.ds.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
