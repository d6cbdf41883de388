"""Preprocessing offloaded to the servers on a CPU-starved training node.

An ImageNet-style pipeline (decode, ``RandomResizedCrop(224)``, ``RandomHorizontalFlip``,
``PILToTensor``: CHW uint8) over JPEG photographs of realistic size (crops of 300-500 px of the
photographs scikit-learn ships), served to a training loop whose step costs, per sample, as much
CPU as preprocessing that sample locally (so no configuration can exceed 2.0x the plain loader).
The training process and its worker processes are pinned to one core, the KSpeed daemons (and the
preprocessing workers they spawn) to the other. No preprocessed cache: the random work runs every
epoch. Measured in one run:

- **DataLoader**: ``DataLoader(ImageFolder(...), num_workers=2)``, its workers on the training core;
- **KSpeed all-local**: ``client.wrap(folder, offload=0)``: the files come from the servers, the
  loader and transforms run in the client's workers;
- **KSpeed all-offloaded** (``offload=1.0``) and fixed splits (``offload=0.25/0.5/0.75``): the
  servers decode and augment, the client only collates;
- the client's CPU seconds per sample beyond the training step (training process plus its
  workers), and the servers' staging memory (the production window's peak against its cap).

Throughput is steady state: timed epochs sit between a warm-up epoch and a trailing untimed one
(servers produce the next epoch while the current one is consumed, so the last epoch of a job
costs them one epoch of work nobody reads; over a long run that is negligible, over a two-epoch
measurement it is not).

Writes JSON and, with matplotlib, a PNG bar chart::

    python bench/preprocess.py --json bench/results/preprocess.json --png bench/results/preprocess.png
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import machine_info, pyplot, write_json

TARGET = 1.6
SPLITS = (0.25, 0.5, 0.75)
CLK_TCK = os.sysconf("SC_CLK_TCK")


def write_photos(root: Path, count: int, seed: int = 0, sides: tuple[int, int] = (300, 500)) -> int:
    """``count`` JPEG crops (``sides`` px, 300-500 by default) of scikit-learn's sample photographs in
    two class folders; total bytes."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    rng = np.random.default_rng(seed)
    total = 0
    for i in range(count):
        photo = photos[i % len(photos)]
        h, w = (
            int(min(v, side))
            for v, side in zip(rng.integers(sides[0], sides[1] + 1, size=2), photo.shape[:2], strict=True)
        )
        y, x = int(rng.integers(0, photo.shape[0] - h + 1)), int(rng.integers(0, photo.shape[1] - w + 1))
        folder = root / f"class{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        Image.fromarray(photo[y : y + h, x : x + w]).save(buffer, format="JPEG", quality=90)
        (folder / f"{i:05d}.jpg").write_bytes(buffer.getvalue())
        total += buffer.tell()
    return total


def transform():
    from torchvision import transforms

    return transforms.Compose(
        [transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.PILToTensor()]
    )


def local_cost(root: Path, samples: int = 160, rounds: int = 5) -> float:
    """CPU seconds to load and transform one sample in this (single-threaded) process, measured
    before any daemon runs: the fastest of ``rounds`` passes over ``samples`` photographs, after a
    warm-up (the cost of the work itself, least disturbed by the VM's neighbours)."""
    import torch
    from torchvision.datasets import ImageFolder

    torch.set_num_threads(1)
    folder = ImageFolder(str(root), transform=transform())
    for i in range(32):
        folder[i]
    passes = []
    for _ in range(rounds):
        began = time.thread_time()
        for i in range(samples):
            folder[i % len(folder)]
        passes.append((time.thread_time() - began) / samples)
    return min(passes)


class TrainStep:
    """A training step's host work: CPU-bound torch ops (which, like a real step's kernels and
    launches, release the GIL, so the loader's threads in the training process still run),
    calibrated to cost a given number of CPU seconds per sample."""

    SIZE = 192

    def __init__(self, seconds_per_sample: float) -> None:
        import torch

        self.a = torch.rand(self.SIZE, self.SIZE)
        self.b = torch.rand(self.SIZE, self.SIZE)
        for _ in range(20):
            torch.mm(self.a, self.b)
        began = time.thread_time()
        rounds = 400
        for _ in range(rounds):
            torch.mm(self.a, self.b)
        self.op_seconds = (time.thread_time() - began) / rounds
        self.per_sample = seconds_per_sample

    def __call__(self, samples: int) -> None:
        import torch

        for _ in range(max(round(self.per_sample * samples / self.op_seconds), 1)):
            torch.mm(self.a, self.b)


def cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU seconds of these processes so far."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return total


def run_epochs(batches, epochs: int, step: TrainStep, pids, set_epoch=None) -> dict:
    """Iterate ``epochs`` timed epochs between a warm-up epoch and a trailing one, with a training
    step per batch. The trailing epoch is not timed: while the last timed epoch is consumed the
    servers already produce the next one, as in any epoch of a longer run (steady state)."""
    if set_epoch:
        set_epoch(0)
    for images, _ in batches():
        step(len(images))
    samples = 0
    cpu0, began = cpu_seconds(pids()), time.perf_counter()
    for epoch in range(1, epochs + 1):
        if set_epoch:
            set_epoch(epoch)
        for images, _ in batches():
            assert images.shape[1:] == (3, 224, 224)
            step(len(images))
            samples += len(images)
    elapsed = time.perf_counter() - began
    used = cpu_seconds(pids()) - cpu0
    if set_epoch:
        set_epoch(epochs + 1)
    for images, _ in batches():
        step(len(images))
    return {
        "samples": samples,
        "seconds": elapsed,
        "samples_per_s": samples / elapsed,
        "client_cpu_s_per_sample": max(used - step.per_sample * samples, 0.0) / samples,
    }


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, flags=re.M)
    return float(match.group(1)) if match else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=480, help="JPEG photographs")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=4, help="timed epochs per configuration (after a warm-up)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--png", default=None)
    args = parser.parse_args()

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("needs two cores: one for training, one for the servers", file=sys.stderr)
        return 2
    train_core, server_core = {cores[0]}, {cores[1]}
    work = Path(tempfile.mkdtemp(prefix="kspeed-bench-prep-"))
    root = work / "photos"
    dataset_bytes = write_photos(root, args.images)

    from urllib.request import urlopen

    import torch
    from torch.utils.data import DataLoader, RandomSampler
    from torchvision.datasets import ImageFolder

    from kspeed import KSpeedClient
    from kspeed.cli.cluster import LocalCluster, wait_for
    from kspeed.config import ClientConfig, load_config

    os.sched_setaffinity(0, train_core)
    torch.set_num_threads(1)
    cost = local_cost(root)
    step = TrainStep(cost)
    print(f"local preprocessing: {cost * 1e3:.2f} ms of CPU per sample; the training step costs the same")
    # The daemons inherit the affinity of the process that spawns them: start them on the server core.
    os.sched_setaffinity(0, server_core)
    cluster = LocalCluster(
        str(work / "cluster"),
        servers=1,
        server_args=[
            "--backend-allow",
            str(work),
            "--memory",
            "512MiB",
            "--region-size",
            "16MiB",
            "--production-window",
            "128MiB",
        ],
    )
    cluster.start()
    os.sched_setaffinity(0, train_core)
    torch.set_num_threads(1)
    results: dict[str, dict] = {}
    try:
        config = load_config(ClientConfig, environ={}, overrides={"manager": cluster.address, "security.auth": "none"})
        client = KSpeedClient(config=config)
        server = cluster.servers[0]
        wait_for(lambda: len(client.manager.servers()) == 1, 30, "the server to register")

        folder = ImageFolder(str(root), transform=transform())
        sampler = RandomSampler(folder, generator=torch.Generator().manual_seed(0))
        loader: DataLoader | None = DataLoader(
            folder, batch_size=args.batch, sampler=sampler, num_workers=2, persistent_workers=True
        )
        workers: list[int] = []

        def loader_pids() -> list[int]:
            nonlocal workers
            if not workers:
                workers = [p.pid for p in torch.multiprocessing.active_children() if p.pid is not None]
            return [os.getpid(), *workers]

        results["dataloader"] = run_epochs(lambda: loader, args.epochs, step, loader_pids)
        loader = None  # its workers exit: the training core is the KSpeed client's now
        print(f"DataLoader: {results['dataloader']['samples_per_s']:.1f} samples/s")

        for label, offload in [("kspeed_local", 0.0), ("kspeed_offloaded", 1.0), *[(f"split_{f}", f) for f in SPLITS]]:
            wrapped = client.wrap(folder, batch_size=args.batch, seed=0, offload=offload, num_workers=2, quiet=True)
            figures = run_epochs(
                lambda wrapped=wrapped: wrapped,
                args.epochs,
                step,
                lambda wrapped=wrapped: [os.getpid(), *wrapped.worker_pids()],
                wrapped.set_epoch,
            )
            figures["offload"] = offload
            figures["client_stage_seconds"] = wrapped.stats().get("client_stage_seconds", {})
            results[label] = figures
            wrapped.close()
            print(f"{label}: {figures['samples_per_s']:.1f} samples/s")
        text = urlopen(f"http://{server.ready['http']}/metrics").read().decode()
        window = {kind: metric(text, f'kspeed_server_window_bytes{{kind="{kind}"}}') for kind in ("capacity", "peak")}
        preprocessed = metric(text, "kspeed_server_preprocessed_samples_total")
        client.close()
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)

    base = results["dataloader"]["samples_per_s"]
    local = results["kspeed_local"]["samples_per_s"]
    best_split = max(
        (k for k in results if k.startswith("split_") or k == "kspeed_offloaded"),
        key=lambda k: results[k]["samples_per_s"],
    )
    offloaded = results["kspeed_offloaded"]["samples_per_s"]
    doc = {
        "benchmark": "preprocess",
        "machine": machine_info(),
        "setup": {
            "images": args.images,
            "dataset_bytes": dataset_bytes,
            "batch_size": args.batch,
            "timed_epochs": args.epochs,
            "pipeline": "decode (PIL), RandomResizedCrop(224), RandomHorizontalFlip, PILToTensor",
            "training_core": sorted(train_core),
            "server_core": sorted(server_core),
            "local_cost_s_per_sample": cost,
            "train_step_s_per_sample": cost,
            "train_step": f"torch.mm of {TrainStep.SIZE}x{TrainStep.SIZE} floats, {step.op_seconds * 1e3:.3f} ms each",
            "ceiling": 2.0,
        },
        "results": results,
        "ratios": {
            "offloaded_vs_dataloader": offloaded / base,
            "offloaded_vs_local": offloaded / local,
            "best": best_split,
            "best_vs_dataloader": results[best_split]["samples_per_s"] / base,
        },
        "window": window,
        "server_preprocessed_samples": preprocessed,
        "targets": [
            {
                "name": "offloaded >= 1.6x DataLoader",
                "value": offloaded / base,
                "threshold": TARGET,
                "met": offloaded / base >= TARGET,
            },
            {
                "name": "offloaded >= 1.6x KSpeed all-local",
                "value": offloaded / local,
                "threshold": TARGET,
                "met": offloaded / local >= TARGET,
            },
            {
                "name": "staging within its cap",
                "value": window["peak"],
                "threshold": window["capacity"],
                "met": window["peak"] <= window["capacity"],
            },
        ],
    }
    write_json(args.json, doc)
    for target in doc["targets"]:
        print(f"{target['name']}: {target['value']:.3g} ({'met' if target['met'] else 'MISSED'})")
    if args.png:
        chart(doc, args.png)
    return 0


def chart(doc: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    results = doc["results"]
    labels = list(results)
    values = [results[k]["samples_per_s"] for k in labels]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(labels, values, color=["grey", "tab:orange", "tab:green", "tab:blue", "tab:blue", "tab:blue"][: len(labels)])
    base = results["dataloader"]["samples_per_s"]
    ax.axhline(base * 2.0, linestyle=":", color="black", label="ceiling (2.0x DataLoader)")
    ax.axhline(base * TARGET, linestyle="--", color="red", label=f"target ({TARGET}x)")
    ax.set_ylabel("samples/s")
    ax.set_title("CPU-starved node: decode + RandomResizedCrop(224) + flip, one training core")
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
