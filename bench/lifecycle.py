"""What a job waits when an operator acts on a server: a restart, a drain, a stop for good, a kill.

Each run starts a local cluster (one manager, two servers holding the dataset, one spare), attaches
a job as the README tells a user to (``client.dataset(spec, batch_size=...)``, defaults otherwise),
preloads the dataset, and reads ``--epochs`` epochs with a training step of ``--step`` seconds.
During the first epoch, after ``--at`` batches, the holder of the first share is

- ``none``: left alone (the baseline);
- ``restart``: stopped with SIGTERM and started again (its pool kept; ``restart_grace`` 30 s);
- ``drain``: drained with ``kspeed server drain`` (its share handed to the spare while it serves);
- ``stop``: stopped with SIGTERM for good (``restart_grace`` ``--grace``, then its share moves);
- ``kill``: killed with SIGKILL (declared failed after ``fail_after`` ``--fail-after``).

Per batch it records the wait for the batch (from asking for it to having it), and reports per
workload (sample size, batch size) and event the longest wait, the 99th percentile and the time
the job lost against the baseline (its wall time minus the baseline's). Every epoch is checked
whole and in order. The figures are in seconds of wall time on this machine; the daemons and the
job share its cores.

    python bench/lifecycle.py --json bench/results/lifecycle.json --png bench/results/lifecycle.png
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
from _common import KIB, machine_info, write_json

from kspeed import DatasetSpec, KSpeedClient
from kspeed.cli.cluster import LocalCluster
from kspeed.config import ClientConfig, load_config

EVENTS = ("none", "restart", "drain", "stop", "kill")
MANAGER_TIMERS = ["--heartbeat-interval", "200ms", "--suspect-after", "1s", "--probe-interval", "300ms"]


def write_samples(root: str, count: int, size: int) -> dict[str, bytes]:
    """``count`` files of about ``size`` bytes (each its own bytes) in ten folders; {relpath: bytes}."""
    rng = np.random.default_rng(7)
    files = {}
    for i in range(count):
        body = rng.integers(0, 256, int(size * rng.uniform(0.5, 1.5)), dtype=np.uint8).tobytes()
        rel = f"c{i % 10}/{i:06d}.bin"
        os.makedirs(os.path.join(root, f"c{i % 10}"), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as fh:
            fh.write(body)
        files[rel] = body
    return dict(sorted(files.items()))


def one_run(
    root: str, files: dict[str, bytes], event: str, *, batch: int, epochs: int, at: int, step: float, args
) -> dict:
    """Read ``epochs`` epochs with ``event`` done to the first share's holder after ``at`` batches."""
    state = tempfile.mkdtemp(prefix="kspeed-bench-lifecycle-")
    memory = max(64 << 20, 2 * sum(len(b) for b in files.values()))
    cluster = LocalCluster(
        state,
        servers=2,
        manager_args=[
            *MANAGER_TIMERS,
            "--fail-after",
            f"{args.fail_after}s",
            "--restart-grace",
            f"{args.grace}s" if event == "stop" else "30s",
        ],
        server_args=["--backend-allow", root, "--memory", str(memory), "--region-size", "1MiB"],
    )
    cluster.start()
    try:
        config = load_config(ClientConfig, environ={}, overrides={"manager": cluster.address, "security.auth": "none"})
        with KSpeedClient(config=config) as client:
            ds = client.dataset(DatasetSpec(name="data", uri=root), batch_size=batch, seed=1, quiet=True)
            ds.preload()
            spare = cluster.add_server()
            holder_id = client.manager.dataset("data").shares[0].server_id
            holder = next(s for s in cluster.servers if s.ready["id"] == holder_id)
            keys = sorted(files)
            waits: list[float] = []
            started = time.monotonic()
            drain: subprocess.Popen | None = None
            for epoch in range(epochs):
                ds.set_epoch(epoch)
                seen: list[int] = []
                asked = time.monotonic()
                for k, got in enumerate(ds):
                    waits.append(time.monotonic() - asked)
                    for i, sid in enumerate(got.ids.tolist()):
                        if got.numpy(i).tobytes() != files[keys[sid]]:
                            raise AssertionError(f"epoch {epoch} sample {sid}: wrong bytes")
                    seen += got.ids.tolist()
                    if epoch == 0 and k == at:
                        drain = act(cluster, holder, event)
                    time.sleep(step)
                    asked = time.monotonic()
                if sorted(seen) != list(range(len(files))):
                    raise AssertionError(f"epoch {epoch}: not every sample once ({len(seen)} of {len(files)})")
            elapsed = time.monotonic() - started
            if drain is not None:
                drain.wait(timeout=120)
            moved = client.manager.dataset("data").shares[0].server_id
            ds.close()
    finally:
        cluster.stop()
        shutil.rmtree(state, ignore_errors=True)
    w = np.array(waits)
    return {
        "event": event,
        "batches": len(w),
        "elapsed_s": round(elapsed, 3),
        "wait_max_s": round(float(w.max()), 4),
        "wait_p99_s": round(float(np.percentile(w, 99)), 4),
        "wait_p50_s": round(float(np.percentile(w, 50)), 4),
        "share_with": "spare" if moved == spare.ready["id"] else ("holder" if moved == holder_id else moved),
    }


def act(cluster: LocalCluster, holder, event: str) -> subprocess.Popen | None:
    """Do ``event`` to ``holder`` (a drain runs in the background: returns its process)."""
    if event == "restart":
        holder.stop()
        cluster.start_server(holder)
    elif event == "stop":
        holder.stop()
    elif event == "kill":
        holder.signal(signal.SIGKILL)
    elif event == "drain":
        argv = [sys.executable, "-m", "kspeed.cli", "server", "drain", holder.ready["id"], "--wait"]
        argv += ["--manager", cluster.address, "--auth", "none"]
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return None


def chart(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({(r["sample_kib"], r["batch"]) for r in rows})
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(workloads)
    for n, (kib, batch) in enumerate(workloads):
        values = [
            next((r["wait_max_s"] for r in rows if (r["sample_kib"], r["batch"], r["event"]) == (kib, batch, e)), 0)
            for e in EVENTS
        ]
        ax.bar(np.arange(len(EVENTS)) + n * width, values, width, label=f"{kib} KiB samples, batch {batch}")
    ax.set_xticks(np.arange(len(EVENTS)) + 0.4 - width / 2, EVENTS)
    ax.set_ylabel("longest wait for a batch (s)")
    ax.set_yscale("log")
    ax.set_title("What a job waits when a server is acted on")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="32,256", help="sample sizes in KiB (comma separated)")
    parser.add_argument("--batches", default="16,64", help="batch sizes (comma separated)")
    parser.add_argument("--samples", type=int, default=1024, help="samples in the dataset")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--at", type=int, default=3, help="batches of epoch 0 before the event")
    parser.add_argument("--step", type=float, default=0.005, help="the training step, seconds")
    parser.add_argument("--grace", type=float, default=2.0, help="restart_grace of the 'stop' runs, seconds")
    parser.add_argument("--fail-after", type=float, default=2.0, help="fail_after of every run, seconds")
    parser.add_argument("--events", default=",".join(EVENTS))
    parser.add_argument("--json", default="")
    parser.add_argument("--png", default="")
    args = parser.parse_args()
    rows = []
    for kib in [int(x) for x in args.sizes.split(",")]:
        root = tempfile.mkdtemp(prefix=f"kspeed-bench-lifecycle-{kib}k-")
        try:
            files = write_samples(root, args.samples, kib * KIB)
            for batch in [int(x) for x in args.batches.split(",")]:
                base = None
                for event in args.events.split(","):
                    row = one_run(
                        root, files, event, batch=batch, epochs=args.epochs, at=args.at, step=args.step, args=args
                    )
                    row.update(sample_kib=kib, batch=batch)
                    if event == "none":
                        base = row["elapsed_s"]
                    row["lost_s"] = round(row["elapsed_s"] - base, 3) if base is not None else None
                    rows.append(row)
                    print(
                        f"{kib:>4} KiB batch {batch:>3} {event:<8} longest wait {row['wait_max_s']:7.3f}s "
                        f"p99 {row['wait_p99_s']:6.3f}s lost {row['lost_s']}s share with {row['share_with']}",
                        flush=True,
                    )
        finally:
            shutil.rmtree(root, ignore_errors=True)
    result = {
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "png")},
        "runs": rows,
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        write_json(args.json, result)
    if args.png:
        chart(rows, args.png)


if __name__ == "__main__":
    main()
