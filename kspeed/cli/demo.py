"""``kspeed demo`` (``make demo``): train a small model through KSpeed and through a plain DataLoader.

It brings up a local cluster (one manager, two servers) on loopback, writes a small dataset of raw
samples of varied size in class folders, preloads it with a progress bar, trains a small torch
model for a few epochs on batches the servers write into this process's receive ring, trains the
same model on a ``torch.utils.data.DataLoader`` over the same files, prints samples/s and data-wait
per batch of both side by side, and stops everything, leaving nothing behind.

The samples are random bytes whose distribution depends on the class, so a byte histogram is
enough for a linear model to learn; decoding images comes with the preprocessing pipelines.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterable, Iterator

import numpy as np

from kspeed.cli.cluster import LocalCluster

CLASSES = 4
PER_CLASS = 600
EPOCHS = 3
BATCH = 64


def make_dataset(root: str, seed: int = 0) -> int:
    """Class folders of random-byte samples of 2-24 KiB; returns the number of samples."""
    rng = np.random.default_rng(seed)
    for c in range(CLASSES):
        folder = os.path.join(root, f"class{c}")
        os.makedirs(folder, exist_ok=True)
        for i in range(PER_CLASS):
            size = int(rng.integers(2 << 10, 24 << 10))
            values = np.clip(rng.normal(40 + 55 * c, 30, size), 0, 255).astype(np.uint8)
            with open(os.path.join(folder, f"{i:05d}.bin"), "wb") as fh:
                fh.write(values.tobytes())
    return CLASSES * PER_CLASS


def _features(samples: Iterable, torch) -> object:
    """A normalized 32-bin byte histogram per sample (reads every byte of every sample)."""
    rows = [torch.bincount(s >> 3, minlength=32).float() / max(int(s.numel()), 1) for s in samples]
    return torch.stack(rows)


def _train(batches: Iterator, torch) -> dict:
    """Train a linear classifier on ``batches`` of (samples, labels); time the data waits.

    The first batch (plans, connections, the first writes) is timed on its own; throughput and
    waits are those of the steady state after it.
    """
    torch.manual_seed(0)
    model = torch.nn.Linear(32, CLASSES)
    optimizer = torch.optim.SGD(model.parameters(), lr=2.0)
    waits, samples, correct, first_s = [], 0, 0, 0.0
    started = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        try:
            batch_samples, labels, release = next(batches)
        except StopIteration:
            break
        if first_s == 0.0:
            first_s = time.perf_counter() - t0
            started = time.perf_counter()
        else:
            waits.append(time.perf_counter() - t0)
            samples += len(labels)
        x = _features(batch_samples, torch)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        correct += int((logits.argmax(1) == labels).sum())
        release()
    elapsed = time.perf_counter() - started
    waits = waits or [0.0]
    return {
        "first_ms": 1e3 * first_s,
        "samples_per_s": samples / max(elapsed, 1e-9),
        "wait_p50_ms": 1e3 * statistics.median(waits),
        "wait_max_ms": 1e3 * max(waits),
        "accuracy": correct / max(samples, 1),
        "batches": len(waits) + 1,
    }


def _kspeed_batches(ds) -> Iterator:
    for epoch in range(EPOCHS):
        ds.set_epoch(epoch)
        for batch in ds:
            yield batch.samples, batch.labels, batch.release


def _loader_batches(root: str, torch) -> Iterator:
    from torch.utils.data import DataLoader, Dataset

    class Files(Dataset):
        def __init__(self) -> None:
            self.items = [
                (os.path.join(root, c, f), int(c.removeprefix("class")))
                for c in sorted(os.listdir(root))
                for f in sorted(os.listdir(os.path.join(root, c)))
            ]

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, i: int):
            path, label = self.items[i]
            with open(path, "rb") as fh:
                return torch.frombuffer(bytearray(fh.read()), dtype=torch.uint8), label

    loader = DataLoader(
        Files(),
        batch_size=BATCH,
        shuffle=True,
        num_workers=0,
        collate_fn=lambda items: ([s for s, _ in items], torch.tensor([y for _, y in items])),
    )
    for _ in range(EPOCHS):
        for samples, labels in loader:
            yield samples, labels, lambda: None


def run(servers: int = 2) -> int:
    """Run the demo; returns the exit status."""
    import torch

    from kspeed import DatasetSpec, KSpeedClient
    from kspeed.config import ClientConfig, load_config

    state_dir = tempfile.mkdtemp(prefix="kspeed-demo-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    data_dir = tempfile.mkdtemp(prefix="kspeed-demo-data-")
    cluster = LocalCluster(
        state_dir,
        servers=servers,
        server_args=["--memory", "128MiB", "--region-size", "8MiB", "--backend-allow", data_dir],
    )
    client = None
    try:
        print(f"starting a local cluster: 1 manager, {servers} servers", flush=True)
        cluster.start()
        count = make_dataset(data_dir)
        print(f"dataset: {count} samples of 2-24 KiB in {CLASSES} class folders under {data_dir}", flush=True)
        config = load_config(ClientConfig, environ={}, overrides={"manager": cluster.address, "security.auth": "none"})
        client = KSpeedClient(cluster.address, config=config)
        ds = client.dataset(DatasetSpec(name="demo", uri=data_dir, labels="dirname"), batch_size=BATCH, seed=0)
        ds.preload()
        _train(
            iter([([torch.zeros(8, dtype=torch.uint8)], torch.zeros(1, dtype=torch.long), lambda: None)]), torch
        )  # warm torch up (lazy imports, first backward) outside both measurements
        print(f"training {EPOCHS} epochs of {len(ds)} batches through KSpeed ...", flush=True)
        ours = _train(_kspeed_batches(ds), torch)
        print("training the same model on a plain DataLoader over the same files ...", flush=True)
        theirs = _train(_loader_batches(data_dir, torch), torch)
        print()
        print(f"{'':24}{'first batch':>12}{'then samples/s':>16}{'wait p50':>11}{'wait max':>11}{'accuracy':>10}")
        for name, r in ((f"KSpeed ({ds.rail} rail)", ours), ("DataLoader (workers=0)", theirs)):
            print(
                f"{name:24}{r['first_ms']:>10.1f}ms{r['samples_per_s']:>16,.0f}{r['wait_p50_ms']:>9.2f}ms"
                f"{r['wait_max_ms']:>9.2f}ms{r['accuracy']:>10.1%}"
            )
        stats = ds.stats()
        shares = ", ".join(
            f"{server} {100 * n / max(stats['bytes'], 1):.0f}%" for server, n in sorted(stats["server_bytes"].items())
        )
        print(
            f"\nKSpeed, this rank: data wait p50 {stats['wait_p50_ms']:.2f} ms, p99 "
            f"{stats['wait_p99_ms']:.2f} ms over the recent batches; bytes from {shares}; rail {stats['rail']}; "
            f"{stats['stale_completions']} stale completions"
        )
        return 0
    finally:
        if client is not None:
            client.close()
        cluster.stop()
        shutil.rmtree(state_dir, ignore_errors=True)
        shutil.rmtree(data_dir, ignore_errors=True)
        print("\ncluster stopped; nothing left running", flush=True)
