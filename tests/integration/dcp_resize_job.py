"""One rank of a torchrun job that saves a KSpeed dataset with ``torch.distributed.checkpoint`` part
way through an epoch, or loads it at another world size and finishes the epoch
(tests/integration/test_resize.py); each rank writes the sample IDs it received to
``<out>/rank-<RANK>.json``.

Modes: ``save``: read 37% of the epoch's batches, then ``dcp.save({"loader": ds})``; ``load``:
``dcp.load({"loader": ds})`` (every rank saved the dataset under one key: the checkpoint keeps one
rank's copy), then the rest of the epoch."""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from kspeed import DatasetSpec, KSpeedClient

EPOCH = 1


def main(uri: str, out: str, checkpoint: str, mode: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    client = KSpeedClient()  # KSPEED_MANAGER and KSPEED_AUTH from the environment
    try:
        ds = client.dataset(DatasetSpec(name="dcp-resize", uri=uri), batch_size=4, seed=5, quiet=True)
        ids: list[int] = []
        if mode == "save":
            ds.set_epoch(EPOCH)
            batches = iter(ds)
            for _ in range(round(0.37 * len(ds))):
                ids += next(batches).ids.tolist()
            dcp.save({"loader": ds}, checkpoint_id=checkpoint)
        else:
            dcp.load({"loader": ds}, checkpoint_id=checkpoint)
            ds.set_epoch(EPOCH)
            ids = [i for batch in ds for i in batch.ids.tolist()]
        ds.close()
    finally:
        client.close()
    with open(os.path.join(out, f"{mode}-rank-{rank}.json"), "w") as fh:
        json.dump({"rank": rank, "world": dist.get_world_size(), "ids": ids}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
