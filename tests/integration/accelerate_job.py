"""One process of a job launched by torchrun that prepares a model, its optimizer and a KSpeed
dataset with Hugging Face Accelerate (tests/integration/test_accelerate.py), on CPU.

Modes: ``dataset``: ``accelerator.prepare(model, optimizer, ds)``, two epochs of training steps;
each process writes the sample IDs it received per epoch to ``<out>/rank-<process index>.json``.
``loader``: ``accelerator.prepare(DataLoader(ds, batch_size=None))``; the process writes the error
its iteration raised."""

from __future__ import annotations

import json
import os
import sys

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from kspeed import DatasetSpec, KSpeedClient


def main(uri: str, out: str, mode: str) -> None:
    accelerator = Accelerator(cpu=True)
    client = KSpeedClient()  # KSPEED_MANAGER and KSPEED_AUTH from the environment
    result: dict = {"process": accelerator.process_index, "processes": accelerator.num_processes}
    try:
        ds = client.dataset(DatasetSpec(name="accelerate", uri=uri, labels="dirname"), batch_size=6, seed=5, quiet=True)
        model = torch.nn.Linear(16, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        if mode == "loader":
            loader = accelerator.prepare(DataLoader(ds, batch_size=None))
            try:
                next(iter(loader))
                result["error"] = ""
            except Exception as exc:
                result["error"] = f"{type(exc).__name__}: {exc}"
        else:
            model, optimizer, prepared = accelerator.prepare(model, optimizer, ds)
            result["same"] = prepared is ds
            result["epochs"] = []
            for epoch in range(2):
                prepared.set_epoch(epoch)
                ids = []
                for batch in prepared:
                    heads = [batch.tensor(i)[:16].float() / 255 for i in range(len(batch))]  # (files of 0-4000 bytes)
                    x = torch.stack([torch.nn.functional.pad(h, (0, 16 - len(h))) for h in heads])
                    loss = torch.nn.functional.cross_entropy(model(x), batch.labels.long())
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                    ids += batch.ids.tolist()
                result["epochs"].append(ids)
            result["rank"], result["world_size"] = ds.rank, ds.world_size
        ds.close()
    finally:
        client.close()
    with open(os.path.join(out, f"rank-{accelerator.process_index}.json"), "w") as fh:
        json.dump(result, fh)
    accelerator.end_training()


if __name__ == "__main__":
    main(*sys.argv[1:4])
