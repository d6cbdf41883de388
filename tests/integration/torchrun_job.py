"""One rank of a job launched by torchrun (tests/integration/test_torchrun.py): a KSpeed dataset
opened without rank= or world_size=, one epoch; each rank writes the sample IDs it received to
``<out>/rank-<RANK>.json``.

Modes: ``group``: a gloo process group is initialised and torchrun's RANK/WORLD_SIZE are then
removed from the environment, so only the group can tell the rank; ``env``: no process group,
only torchrun's variables."""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from kspeed import DatasetSpec, KSpeedClient


def main(uri: str, out: str, mode: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if mode == "group":
        dist.init_process_group("gloo")
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            del os.environ[name]
    client = KSpeedClient()  # KSPEED_MANAGER and KSPEED_AUTH from the environment
    try:
        ds = client.dataset(DatasetSpec(name="torchrun", uri=uri), batch_size=8, seed=5, quiet=True)
        ids = [int(i) for batch in ds for i in batch.ids.tolist()]
        ds.close()
    finally:
        client.close()
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as fh:
        json.dump(
            {"rank": rank, "world_size": world, "ds_rank": ds.rank, "ds_world_size": ds.world_size, "ids": ids}, fh
        )
    if mode == "group":
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
