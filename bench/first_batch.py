"""Training that starts before the preload ends: time to the first batch on a slow backend.

10,000 small files behind the throttled file system (``slowfile``: a fixed latency per open, 5 ms
by default, standing in for remote storage), one server, not preloaded. Measured in one run:

- **one batch**: the time the server's producers need to read one batch's files (a batch of files
  read by as many threads as the server has producers), the reference the first batch is
  compared with;
- **KSpeed, serving while producing**: ``client.dataset()`` (registration: listing the backend,
  allocating, opening the feed), then from the start of iteration to the first batch, the epoch,
  and when the background preload finished;
- **preload first** (the behaviour before serving while producing): a fresh cluster preloads the
  whole share, then the first batch;
- the production window's cap and its peak fill, and how many grants waited on production.

The target is a first batch within a small multiple (5x) of one batch's load time, counted from
the start of iteration (registration costs the same whether or not the share is preloaded, and is
reported apart). Writes JSON and,
when matplotlib is installed, a PNG timeline of samples delivered and loaded::

    python bench/first_batch.py --json bench/results/first_batch.json --png bench/results/first_batch.png
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import machine_info, write_json

from kspeed import DatasetSpec, KSpeedClient, KSpeedError
from kspeed.cli.cluster import LocalCluster
from kspeed.config import ClientConfig, load_config
from kspeed.testing.throttle import SlowFileSystem

TARGET_MULTIPLE = 5.0
THREADS = 8  # the server's production threads (its default)


def write_files(root: Path, count: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for i in range(count):
        folder = root / f"c{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:06d}.bin").write_bytes(rng.bytes(int(rng.integers(1024, 4096))))


def one_batch_seconds(root: Path, batch: int, latency: float) -> float:
    """Time to read ``batch`` of the files through the throttled file system with :data:`THREADS` threads."""
    fs = SlowFileSystem(latency=latency)
    paths = sorted(str(p) for p in root.rglob("*.bin"))[:batch]

    def read(path: str) -> int:
        with fs.open(path, "rb") as fh:
            return len(fh.read())

    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(read, paths))
        best = min(best, time.perf_counter() - started)
    return best


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, flags=re.M)
    return float(match.group(1)) if match else float("nan")


def start_cluster(state: Path, root: Path, latency: float, window: str) -> LocalCluster:
    cluster = LocalCluster(
        str(state),
        servers=1,
        server_args=[
            "--backend-allow",
            f"slowfile://{root}",
            "--backend-options",
            f'{{"slowfile": {{"latency": {latency}}}}}',
            "--memory",
            "256MiB",
            "--region-size",
            "8MiB",
            "--production-window",
            window,
            "--keep-pool-on-exit",
            "false",
        ],
    )
    cluster.start()
    return cluster


def serve_while_producing(state: Path, root: Path, args: argparse.Namespace) -> dict:
    from urllib.request import urlopen

    cluster = start_cluster(state, root, args.latency, args.window)
    try:
        config = load_config(ClientConfig, environ={}, overrides={"manager": cluster.address, "security.auth": "none"})
        client = KSpeedClient(config=config)
        spec = DatasetSpec(name="slow", uri=f"slowfile://{root}")
        loaded: list[tuple[float, int]] = []
        stop = threading.Event()
        started = time.perf_counter()

        def watch() -> None:
            while not stop.wait(0.05):
                try:
                    progress = client.manager.dataset("slow").progress
                except KSpeedError:  # not registered yet
                    continue
                loaded.append((time.perf_counter() - started, progress.samples_loaded))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        ds = client.dataset(spec, batch_size=args.batch, seed=1, quiet=True)
        opened = time.perf_counter() - started
        delivered: list[tuple[float, int]] = []
        count = 0
        first = None
        for batch in ds:
            count += len(batch)
            now = time.perf_counter() - started
            if first is None:
                first = now
                at_first = client.manager.dataset("slow").progress.samples_loaded
            delivered.append((now, count))
            batch.release()
        epoch = time.perf_counter() - started
        while not loaded or loaded[-1][1] < args.files:  # the background preload finishes the share
            time.sleep(0.05)
        preloaded = loaded[-1][0]
        stop.set()
        watcher.join()
        text = urlopen(f"http://{cluster.servers[0].ready['http']}/metrics").read().decode()
        ds.close()
        client.close()
        return {
            "open_s": opened,
            "first_batch_s": first,
            "first_batch_after_open_s": first - opened,
            "loaded_at_first_batch": at_first,
            "epoch_s": epoch,
            "preload_finished_s": preloaded,
            "window_capacity_bytes": metric(text, 'kspeed_server_window_bytes{kind="capacity"}'),
            "window_peak_bytes": metric(text, 'kspeed_server_window_bytes{kind="peak"}'),
            "grants_waited": metric(text, "kspeed_server_grant_wait_seconds_count"),
            "grant_wait_s_total": metric(text, "kspeed_server_grant_wait_seconds_sum"),
            "produced_samples": metric(text, "kspeed_server_produced_samples_total"),
            "delivered": delivered,
            "loaded": loaded,
        }
    finally:
        cluster.stop()


def preload_first(state: Path, root: Path, args: argparse.Namespace) -> dict:
    cluster = start_cluster(state, root, args.latency, args.window)
    try:
        config = load_config(ClientConfig, environ={}, overrides={"manager": cluster.address, "security.auth": "none"})
        client = KSpeedClient(config=config)
        started = time.perf_counter()
        ds = client.dataset(DatasetSpec(name="slow", uri=f"slowfile://{root}"), batch_size=args.batch, quiet=True)
        ds.preload(quiet=True)
        preloaded = time.perf_counter() - started
        next(iter(ds))
        first = time.perf_counter() - started
        ds.close()
        client.close()
        return {"preload_s": preloaded, "first_batch_s": first}
    finally:
        cluster.stop()


def chart(path: str, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = result["serve_while_producing"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    t, n = zip(*run["delivered"], strict=True)
    ax.plot(t, n, label="samples delivered to the training loop")
    if run["loaded"]:
        t2, n2 = zip(*run["loaded"], strict=True)
        ax.plot(t2, n2, label="samples at home in the pool (as each heartbeat reports)")
    ax.axvline(run["first_batch_s"], color="green", linestyle=":", label=f"first batch {run['first_batch_s']:.2f} s")
    before = result["preload_first"]["first_batch_s"]
    ax.axvline(before, color="red", linestyle="--", label=f"first batch after a full preload {before:.1f} s")
    ax.set_xlabel("seconds since client.dataset() was called (registration included)")
    ax.set_ylabel("samples")
    ax.set_title(f"{result['files']:,} files, {result['latency_s'] * 1e3:.0f} ms per file, not preloaded")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--latency", type=float, default=0.005, help="seconds per file open")
    parser.add_argument("--window", default="16MiB", help="the server's production window")
    parser.add_argument("--json", help="write the results here (default: stdout)")
    parser.add_argument("--png", help="write a timeline chart here (needs matplotlib)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kspeed-bench-first-"))
    try:
        root = work / "data"
        write_files(root, args.files)
        batch_s = one_batch_seconds(root, args.batch, args.latency)
        live = serve_while_producing(work / "live", root, args)
        before = preload_first(work / "before", root, args)
        multiple = live["first_batch_after_open_s"] / batch_s
        result = {
            "benchmark": "first_batch",
            "machine": machine_info(),
            "files": args.files,
            "batch": args.batch,
            "latency_s": args.latency,
            "one_batch_load_s": batch_s,
            "serve_while_producing": live,
            "preload_first": before,
            "first_batch_multiple_of_one_batch": multiple,
            "first_batch_speedup_over_preload_first": before["first_batch_s"] / live["first_batch_s"],
            "target": {"multiple_at_most": TARGET_MULTIPLE, "met": multiple <= TARGET_MULTIPLE},
        }
        write_json(args.json, result)
        print(
            f"one batch {batch_s * 1e3:.0f} ms; registration {live['open_s'] * 1e3:.0f} ms, then the first batch "
            f"in {live['first_batch_after_open_s'] * 1e3:.0f} ms ({multiple:.1f}x, target <= {TARGET_MULTIPLE:g}x) "
            f"with {live['loaded_at_first_batch']} of "
            f"{args.files} preloaded; epoch {live['epoch_s']:.1f} s; preload first: first batch after "
            f"{before['first_batch_s']:.1f} s; window peak {live['window_peak_bytes'] / (1 << 20):.1f} of "
            f"{live['window_capacity_bytes'] / (1 << 20):.0f} MiB",
            file=sys.stderr,
        )
        if args.png:
            chart(args.png, result)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
