"""Datasets larger than pooled memory: the memory policies against a fully cached run and a DataLoader.

A dataset about three times the memory it is given (its quota) sits behind the throttled file
system standing in for object storage (``throttled`` over the local files: a latency per request,
the ranged reads of one call in flight together, a bandwidth cap per server process, and with
``--pause-every``/``--pause`` the store's pauses, as when it throttles its callers). Two ranks
(processes, as under torchrun) read three epochs each, with a fixed step per batch (a training
step that cannot hide stalls) set so that they consume ``--load`` of the backend's capacity.
With ``--pin`` (the default) the ranks run on one half of the cores and the manager and servers on
the other, as training nodes and spare nodes are apart in a cluster. Measured in one run, each on
a fresh cluster of two servers:

- ``cache``: enough memory, preloaded before the epochs (the fully cached reference);
- ``stream``, ``minio``, ``reuse``, ``lru``: the dataset held in a third of its size;
- ``dataloader``: a plain ``torch.utils.data.DataLoader`` per rank reading the same throttled
  backend (its workers share the servers' total bandwidth cap), with the same step.

Per run and epoch: samples/s, the ranks' data wait (time blocked waiting for a batch) as a share
of the epoch, with and without each epoch's first batch, and for the policies the servers' own
figures (backend bytes and requests, misses, grants' waits for production). The targets:
``stream`` within 10% of ``cache`` in samples/s while reading no more than the dataset (plus the
sampler's padding) per epoch; ``stream`` stalling least of the policies; ``minio`` reading fewer
backend bytes than ``lru``. Writes JSON and a PNG::

    python bench/policies.py --repeat 3 --json docs/policies/steady.json --png docs/policies/steady.png
    python bench/policies.py --repeat 3 --pause-every 3 --pause 0.5 --json docs/policies/pauses.json \
        --png docs/policies/pauses.png
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import MIB, machine_info, write_files, write_json
from _throttled import split_cores, throttled_cluster

from kspeed import DatasetSpec, KSpeedClient
from kspeed.cli.cluster import LocalCluster, wait_for
from kspeed.config import ClientConfig, load_config
from kspeed.server.production.core import TASK_SAMPLES

POLICIES = ("stream", "minio", "reuse", "lru")
RANKS = 2
SEED = 3


def config_for(address: str) -> ClientConfig:
    return load_config(ClientConfig, environ={}, overrides={"manager": address, "security.auth": "none"})


def cores(args: argparse.Namespace) -> tuple[set[int], set[int]]:
    """``(the ranks' cores, the daemons' cores)`` (``--pin``: apart, :func:`_throttled.split_cores`)."""
    return split_cores(args.pin)


def pin_rank(args: argparse.Namespace) -> None:
    """Put this rank (and the processes it starts) on the ranks' cores."""
    os.sched_setaffinity(0, cores(args)[0])


def kspeed_rank(address: str, spec: DatasetSpec, rank: int, args: argparse.Namespace, out: mp.Queue) -> None:
    """One rank: ``args.epochs`` epochs with a fixed step per batch; puts its per-epoch figures."""
    pin_rank(args)
    try:
        with KSpeedClient(config=config_for(address)) as client:
            ds = client.dataset(
                spec, batch_size=args.batch, seed=SEED, rank=rank, world_size=RANKS, ring_bytes=32 << 20, quiet=True
            )
            epochs = []
            for epoch in range(args.epochs):
                ds.set_epoch(epoch)
                epochs.append(_timed_epoch(iter(ds), args.step, lambda batch: (len(batch), batch.release())[0]))
            ds.close()
        out.put((rank, epochs))
    except BaseException as exc:
        out.put((rank, f"{type(exc).__name__}: {exc}"))
        raise


def _timed_epoch(batches, step: float, consume) -> dict:
    """Drain ``batches``, sleeping ``step`` seconds per batch: wall seconds, samples, data wait,
    and where in the epoch the waits of over a millisecond fell (``[seconds into it, wait]``)."""
    started = time.perf_counter()
    waited = 0.0
    samples = 0
    waits = []
    while True:
        asked = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            break
        wait = time.perf_counter() - asked
        waited += wait
        if wait > 1e-3:
            waits.append([round(asked - started, 3), round(wait, 4)])
        samples += consume(batch)
        time.sleep(step)
    return {"seconds": time.perf_counter() - started, "samples": samples, "wait_s": waited, "waits": waits}


class ThrottledFiles:
    """A map-style dataset of the files, read through a throttled file system of its own per worker."""

    def __init__(self, paths: list[str], options: dict[str, float]) -> None:
        self.paths, self.options = paths, options
        self._fs = None

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> bytes:
        if self._fs is None:
            from kspeed.testing.throttle import SlowFileSystem

            self._fs = SlowFileSystem(**self.options, skip_instance_cache=True)
        with self._fs.open(self.paths[i], "rb") as f:
            return f.read()


def as_list(items: list) -> list:
    """The DataLoader's collate function: the batch's samples as they are."""
    return items


def dataloader_rank(root: str, rank: int, args: argparse.Namespace, out: mp.Queue) -> None:
    """The baseline rank: DataLoader + DistributedSampler over the throttled files, same step
    (its worker processes share the rank's cores, as on a training node)."""
    pin_rank(args)
    try:
        from torch.utils.data import DataLoader, DistributedSampler

        paths = sorted(str(p) for p in Path(root).rglob("*.bin"))
        workers = args.loader_workers
        # the backend's total cap (one per server on the KSpeed side) shared by every worker
        files = ThrottledFiles(paths, {**store(args), "bandwidth": args.bandwidth * 2 / (RANKS * workers)})
        sampler = DistributedSampler(files, num_replicas=RANKS, rank=rank, shuffle=True, seed=SEED)
        loader = DataLoader(
            files,
            batch_size=args.batch,
            sampler=sampler,
            num_workers=workers,
            collate_fn=as_list,
            persistent_workers=True,
            prefetch_factor=4,
        )
        epochs = []
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            epochs.append(_timed_epoch(iter(loader), args.step, len))
        out.put((rank, epochs))
    except BaseException as exc:
        out.put((rank, f"{type(exc).__name__}: {exc}"))
        raise


def run_ranks(target, rank_args: tuple, args: argparse.Namespace) -> list[list[dict]]:
    """Run the ranks as processes at once; their per-epoch figures, by rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*rank_args, rank, args, out)) for rank in range(RANKS)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=args.timeout) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    failed = {r: v for r, v in results.items() if isinstance(v, str)}
    if failed:
        raise RuntimeError(f"ranks failed: {failed}")
    return [results[r] for r in range(RANKS)]


def start_cluster(state: Path, root: Path, args: argparse.Namespace, memory: int) -> LocalCluster:
    return throttled_cluster(
        state,
        root,
        servers=2,
        store=store(args),
        memory=memory,
        region=args.region_mib * MIB,
        pin=args.pin,
        extra=["--production-threads", str(args.threads)],
    )


def kspeed_run(policy: str, root: Path, total: int, args: argparse.Namespace) -> dict:
    """One policy (or ``cache``) on a fresh cluster: the ranks' epochs and the servers' figures."""
    state = Path(tempfile.mkdtemp(prefix=f"kspeed-policies-{policy}-"))
    memory = total // 2 + 96 * MIB  # enough for the whole dataset on either server's half, and a window
    cluster = start_cluster(state, root, args, memory)
    try:
        with KSpeedClient(config=config_for(cluster.address)) as client:
            quota = 0 if policy == "cache" else total // 3
            spec = DatasetSpec(name=f"ds-{policy}", uri=f"throttled://{root}", quota_bytes=quota, policy=policy)
            info = client.manager.create_dataset(spec.to_proto(), operator=True).dataset
            held = sum(s.memory_regions if s.policy else s.num_regions for s in info.shares) * args.region_mib * MIB
            if policy == "cache":
                client.manager.preload(spec.name)
                wait_for(lambda: client.manager.dataset(spec.name).state == 3 or None, 600, "the preload")
            started = time.perf_counter()
            ranks = run_ranks(kspeed_rank, (cluster.address, spec), args)
            seconds = time.perf_counter() - started
            figures = settled_figures(client, spec.name, args.epochs)
        stall = sum(f["stall_s"] for e, f in figures.items() if int(e) < args.epochs)
        extra = {"memory_bytes": held, "server_figures": figures, "production_stall_s": stall}
        return summarize(policy, ranks, seconds, extra)
    finally:
        cluster.stop()
        shutil.rmtree(state, ignore_errors=True)


def settled_figures(client: KSpeedClient, name: str, epochs: int, timeout: float = 30.0) -> dict:
    """The servers' figures per sampler epoch, summed over the shares, once every epoch shows as
    many samples written as planned (heartbeats carry them; the last ones come a moment after the
    ranks end). Empty for a dataset held whole."""
    deadline = time.monotonic() + timeout
    while True:
        figures: dict[str, dict] = {}
        for status in client.manager.dataset(name).share_status:
            for f in status.epochs:
                got = figures.setdefault(
                    str(f.epoch),
                    dict.fromkeys(("planned", "written", "misses", "backend_bytes", "backend_requests", "stall_s"), 0),
                )
                for key in got:
                    got[key] += getattr(f, key)
        done = all(
            str(e) in figures and figures[str(e)]["written"] >= figures[str(e)]["planned"] for e in range(epochs)
        )
        if not figures or done or time.monotonic() > deadline:
            return figures
        time.sleep(0.2)


def summarize(name: str, ranks: list[list[dict]], seconds: float, extra: dict) -> dict:
    """Per epoch over the ranks: samples/s (the slower rank's pace), data wait share; and over the
    epochs: samples/s and the data wait's share of the time (a stall share)."""
    epochs = []
    for e in range(len(ranks[0])):
        wall = max(r[e]["seconds"] for r in ranks)
        samples = sum(r[e]["samples"] for r in ranks)
        wait = max(r[e]["wait_s"] / r[e]["seconds"] for r in ranks)
        # the first batch's wait (the epoch's plan, and from an empty window its first reads) apart
        firsts = [sum(w for t, w in r[e].get("waits", []) if t == 0.0) for r in ranks]
        steady = max((r[e]["wait_s"] - f) / r[e]["seconds"] for r, f in zip(ranks, firsts))
        epochs.append(
            {
                "epoch": e,
                "seconds": wall,
                "samples": samples,
                "samples_per_s": samples / wall,
                "wait_share": wait,
                "first_batch_wait_s": max(firsts),
                "wait_share_after_first_batch": steady,
                "waits": [r[e].get("waits", []) for r in ranks],  # per rank: [seconds into the epoch, wait]
            }
        )
    total = sum(e["samples"] for e in epochs)
    busy = sum(e["seconds"] for e in epochs)
    waited = sum(e["wait_share"] * e["seconds"] for e in epochs)
    return {
        "name": name,
        "epochs": epochs,
        "samples_per_s": total / busy,
        "wait_share": waited / busy,  # the slower rank's data wait over all the epochs
        "wait_share_after_first_batch": sum(e["wait_share_after_first_batch"] * e["seconds"] for e in epochs) / busy,
        "worst_epoch_wait_share": max(e["wait_share"] for e in epochs),
        "seconds": seconds,
        **extra,
    }


def median_run(done: list[dict]) -> dict:
    """The run whose data wait is the median of the repeats, with every repeat's headline figures."""
    ranked = sorted(done, key=lambda r: r["wait_share"])
    run = dict(ranked[(len(ranked) - 1) // 2])
    keys = (
        "samples_per_s",
        "wait_share",
        "wait_share_after_first_batch",
        "worst_epoch_wait_share",
        "production_stall_s",
    )
    run["repeats"] = [{k: r[k] for k in keys if k in r} for r in done]
    return run


def targets(runs: dict[str, dict], total: int, count: int) -> list[dict]:
    out = []
    cache, stream = runs.get("cache"), runs.get("stream")
    if cache and stream:
        ratio = stream["samples_per_s"] / cache["samples_per_s"]
        out.append(
            {"target": "stream within 10% of cache (samples/s)", "value": ratio, "threshold": 0.9, "met": ratio >= 0.9}
        )
        pad = (-count) % RANKS
        most = max(f["backend_bytes"] for e, f in stream["server_figures"].items() if int(e) < len(stream["epochs"]))
        out.append(
            {
                "target": "stream reads at most the dataset per epoch (bytes)",
                "value": most,
                "threshold": total + pad * 48 * 1024,
                "met": most <= total + pad * 48 * 1024,
            }
        )
    policies = [p for p in POLICIES if p in runs]
    if len(policies) == len(POLICIES):
        # the policies' own stall: the seconds grants waited for the servers' production
        least = min(policies, key=lambda p: runs[p]["production_stall_s"])
        out.append(
            {
                "target": "stream stalls least of the policies (servers: grants' wait for production)",
                "value": {p: runs[p]["production_stall_s"] for p in policies},
                "met": least == "stream",
            }
        )
        # what the ranks feel: their data wait, which also holds the machine's contention; and the
        # same without each epoch's first batch (the plan and the first reads, alike for all)
        for key, what in (
            ("wait_share", "data wait"),
            ("wait_share_after_first_batch", "data wait after first batches"),
        ):
            least = min(policies, key=lambda p, key=key: runs[p][key])
            out.append(
                {
                    "target": f"stream stalls least of the policies (ranks: {what}, median of the repeats)",
                    "value": {p: runs[p][key] for p in policies},
                    "met": least == "stream",
                }
            )

        def later(p: str) -> int:
            return sum(
                f["backend_bytes"] for e, f in runs[p]["server_figures"].items() if 1 <= int(e) < len(runs[p]["epochs"])
            )

        out.append(
            {
                "target": "minio reads fewer backend bytes than lru (epochs after the first)",
                "value": [later("minio"), later("lru")],
                "met": later("minio") < later("lru"),
            }
        )
    return out


def store(args: argparse.Namespace) -> dict[str, float]:
    """The throttled store's settings (per server process; the DataLoader's workers split them)."""
    return {"latency": args.latency, "bandwidth": args.bandwidth, "pause_every": args.pause_every, "pause": args.pause}


def backend_capacity(args: argparse.Namespace, total: int) -> dict[str, float]:
    """Samples/s the two servers' backend serves at most: by its bandwidth cap, and by its latency
    (each production thread has one request of TASK_SAMPLES ranged reads in flight), less its
    pauses."""
    up = 1 - (args.pause / args.pause_every if args.pause_every else 0.0)
    return {
        "bandwidth": 2 * args.bandwidth / (total / args.samples) * up,
        "latency": 2 * args.threads * TASK_SAMPLES / args.latency * up,
    }


def chart(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = doc["runs"]
    names = list(runs)
    colors = dict(zip(names, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    epochs = np.arange(max(len(r["epochs"]) for r in runs.values()))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    ax.bar(names, [runs[n]["samples_per_s"] for n in names], color=[colors[n] for n in names])
    ax.axhline(doc["consumption_samples_per_s"], color="k", ls="--", lw=1, label="the step's pace")
    ax.set_title("samples/s (both ranks, over the epochs)")
    ax.legend(loc="lower left")
    for ax, title, values, shown in (
        (
            axes[1],
            "data wait, % of the epoch (slower rank)",
            lambda n: [e["wait_share"] * 100 for e in runs[n]["epochs"]],
            names,
        ),
        (
            axes[2],
            "backend MiB read per epoch (servers' figures)",
            lambda n: [runs[n]["server_figures"].get(str(e), {}).get("backend_bytes", 0) / MIB for e in epochs],
            [n for n in names if runs[n].get("server_figures")],
        ),
    ):
        width = 0.8 / max(len(shown), 1)
        for k, n in enumerate(shown):
            ax.bar(epochs + (k - (len(shown) - 1) / 2) * width, values(n), width, label=n, color=colors[n])
        ax.set_xticks(epochs)
        ax.set_xlabel("epoch")
        ax.set_title(title)
    axes[2].axhline(doc["dataset_bytes"] / MIB, color="k", ls="--", lw=1, label="the dataset")
    axes[1].legend(fontsize=8, loc="upper right")
    axes[2].legend(fontsize=8, loc="lower right")
    fig.suptitle(
        f"{doc['dataset_bytes'] / MIB:.0f} MiB dataset, {doc['memory_fraction']:.2f} of it in memory; "
        f"backend {doc['latency_ms']:g} ms/request, {doc['bandwidth_mb_s']:g} MB/s per server"
        + (f", pausing {doc['pause_s']:g} s every {doc['pause_every_s']:g} s" if doc.get("pause_every_s") else "")
        + f"; load {doc.get('load', 0):.2f}; "
        f"{RANKS} ranks, step {doc['step_ms']:.1f} ms/batch"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4800)
    parser.add_argument("--min-bytes", type=int, default=64 * 1024)
    parser.add_argument("--max-bytes", type=int, default=128 * 1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--load", type=float, default=0.75, help="the ranks consume this share of the backend's capacity"
    )
    parser.add_argument("--step", type=float, help="seconds of 'training' per batch (default: from --load)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--latency", type=float, default=0.005, help="seconds per backend request")
    parser.add_argument("--bandwidth", type=float, default=100e6, help="backend bytes/s per server process")
    parser.add_argument("--pause-every", type=float, default=0.0, help="the store pauses every this many seconds")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds each of the store's pauses lasts")
    parser.add_argument("--threads", type=int, default=16, help="the servers' production threads")
    parser.add_argument("--region-mib", type=int, default=4)
    parser.add_argument("--loader-workers", type=int, default=2)
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ranks on one half of the cores, the manager and servers on the other (as training and spare nodes)",
    )
    parser.add_argument("--runs", default="cache,stream,minio,reuse,lru,dataloader")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each, in rounds; the median is reported")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json")
    parser.add_argument("--png")
    parser.add_argument("--replot", metavar="JSON", help="draw the PNG of an earlier run's JSON and exit")
    args = parser.parse_args()
    if args.replot:
        chart(json.loads(Path(args.replot).read_text()), args.png or str(Path(args.replot).with_suffix(".png")))
        return
    root = Path(tempfile.mkdtemp(prefix="kspeed-policies-data-"))
    try:
        total = write_files(root, args.samples, args.min_bytes, args.max_bytes)
        capacity = backend_capacity(args, total)
        if args.step is None:
            args.step = RANKS * args.batch / (args.load * min(capacity.values()))
        repeats: dict[str, list[dict]] = {}
        for round_ in range(args.repeat):  # rounds, so that a drift of the machine spreads over every run
            for name in args.runs.split(","):
                started = time.perf_counter()
                if name == "dataloader":
                    ranks = run_ranks(dataloader_rank, (str(root),), args)
                    run = summarize(name, ranks, time.perf_counter() - started, {})
                else:
                    run = kspeed_run(name, root, total, args)
                repeats.setdefault(name, []).append(run)
                print(
                    f"{name} #{round_}: {run['samples_per_s']:.0f} samples/s, wait {run['wait_share']:.1%}"
                    f", production stall {run.get('production_stall_s', 0):.1f} s",
                    file=sys.stderr,
                )
        runs = {name: median_run(done) for name, done in repeats.items()}
        doc = {
            "benchmark": "policies",
            "machine": machine_info(),
            "dataset_bytes": total,
            "samples": args.samples,
            "memory_fraction": 1 / 3,
            "latency_ms": args.latency * 1000,
            "bandwidth_mb_s": args.bandwidth / 1e6,
            "step_ms": args.step * 1000,
            "pause_every_s": args.pause_every,
            "pause_s": args.pause,
            "batch": args.batch,
            "consumption_samples_per_s": RANKS * args.batch / args.step,
            "backend_capacity_samples_per_s": capacity,
            "load": RANKS * args.batch / args.step / min(capacity.values()),
            "repeat": args.repeat,
            "cores": {"ranks": sorted(cores(args)[0]), "daemons": sorted(cores(args)[1])},
            "runs": runs,
        }
        doc["targets"] = targets(runs, total, args.samples)
        write_json(args.json, doc)
        if args.png:
            chart(doc, args.png)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
