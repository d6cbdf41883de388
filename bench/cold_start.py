"""A new user's first run: a folder dataset with torchvision transforms, wrapped against a server
that was just started.

Each run starts a fresh one-server local cluster and a fresh Python process that imports torch,
torchvision and kspeed, wraps ``ImageFolder(root, transform=RandomResizedCrop + PILToTensor)``
(registration: the server checks the pipeline, lists, allocates and preloads) and iterates one
epoch. Reported per run and as medians: the imports, ``wrap()``, the first batch after it and
the epoch. The baseline is a plain ``DataLoader`` (``num_workers=0``) over the same folder in a
fresh process: its imports, first batch and epoch. Writes JSON::

    python bench/cold_start.py --json bench/results/cold_start.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import machine_info, write_json
from preprocess import write_photos

from kspeed.cli.cluster import LocalCluster

COMMON = r"""
import json, sys, time
t0 = time.monotonic()
import torch
from torchvision import transforms
from torchvision.datasets import ImageFolder
from kspeed import KSpeedClient
t1 = time.monotonic()
tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.PILToTensor()])
folder = ImageFolder(sys.argv[1], transform=tf)
"""
KSPEED = (
    COMMON
    + r"""
client = KSpeedClient()
loader = client.wrap(folder, batch_size=64, num_workers=0)
t2 = time.monotonic()
"""
)
BASELINE = (
    COMMON
    + r"""
loader = torch.utils.data.DataLoader(folder, batch_size=64, shuffle=True, num_workers=0)
t2 = time.monotonic()
"""
)
ITERATE = r"""
batches = iter(loader)
next(batches)
t3 = time.monotonic()
for _ in batches:
    pass
t4 = time.monotonic()
print(json.dumps({"imports_s": t1 - t0, "wrap_s": t2 - t1, "first_batch_s": t3 - t2, "epoch_s": t4 - t2}))
"""


def run_child(code: str, root: Path, env: dict[str, str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", code, str(root)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def medians(runs: list[dict]) -> dict:
    return {key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh clusters (and baselines) to time")
    parser.add_argument("--photos", type=int, default=256, help="JPEGs in the folder")
    parser.add_argument("--json", help="write the results here (stdout when omitted)")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    kspeed, baseline = [], []
    with tempfile.TemporaryDirectory(prefix="kspeed-cold-") as tmp:
        root = Path(tmp) / "photos"
        total = write_photos(root, args.photos)
        for run in range(args.runs):
            cluster = LocalCluster(os.path.join(tmp, f"cluster-{run}"), servers=1, server_args=["--backend-allow", tmp])
            cluster.start()
            try:
                kspeed.append(run_child(KSPEED + ITERATE, root, {**env, "KSPEED_MANAGER": cluster.address}))
            finally:
                cluster.stop()
            baseline.append(run_child(BASELINE + ITERATE, root, env))
            print(f"run {run}: kspeed {kspeed[-1]}, dataloader {baseline[-1]}", file=sys.stderr)
    write_json(
        args.json,
        {
            "bench": "cold_start",
            "machine": machine_info(),
            "photos": args.photos,
            "photo_bytes": total,
            "kspeed": {"median": medians(kspeed), "runs": kspeed},
            "dataloader": {"median": medians(baseline), "runs": baseline},
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
