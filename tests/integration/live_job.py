"""One rank of a torchrun job (``--max-restarts 1``) that reads a KSpeed dataset with
``resume="live"`` (tests/integration/test_resize.py). On the first attempt each rank reads
``<batches>`` batches, recording each batch's IDs in ``<out>/try0-rank-<RANK>.json`` as it gets it;
then rank 1, once rank 0 has recorded its batches, kills itself (SIGKILL), and rank 0 waits to be
stopped. torchrun restarts both; the
second attempt opens the dataset again, continues the epoch from the servers' record of where the
ranks had got, with no checkpoint, and records what it reads in ``try1-rank-<RANK>.json``."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from kspeed import DatasetSpec, KSpeedClient

EPOCH = 2


def wait_for_rank_0(out: str, samples: int) -> None:
    """Until rank 0 has recorded ``samples`` samples of its first attempt."""
    path = os.path.join(out, "try0-rank-0.json")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with open(path) as fh:
                if len(json.load(fh)["ids"]) >= samples:
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise TimeoutError("rank 0 did not record its batches")


def main(uri: str, out: str, batches: str) -> None:
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    path = os.path.join(out, f"try{attempt}-rank-{rank}.json")
    client = KSpeedClient()  # KSPEED_MANAGER and KSPEED_AUTH from the environment; no KSPEED_JOB
    ds = client.dataset(DatasetSpec(name="live", uri=uri), batch_size=3, seed=5, quiet=True, resume="live")
    if attempt == 0:
        ds.set_epoch(EPOCH)
    got: list[int] = []
    record = {"rank": rank, "epoch": ds.epoch, "ids": got}
    for k, batch in enumerate(ds):
        got += batch.ids.tolist()
        with open(path + ".new", "w") as fh:  # (what the rank was handed, before anything else happens)
            json.dump(record, fh)
        os.replace(path + ".new", path)
        if attempt == 0 and k + 1 == int(batches):
            if rank == 1:
                wait_for_rank_0(out, len(got))  # (so that what each rank was handed is on record)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(120)  # rank 0: stopped by torchrun when rank 1 is gone
    with open(path, "w") as fh:
        json.dump(record, fh)
    ds.close()
    client.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
