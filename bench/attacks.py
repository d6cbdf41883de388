"""A legitimate job's throughput while each exhaustion attack runs, against the same job left alone.

A local cluster (one manager, two servers) and the job (this process) run on core 0; each attack
runs in a process of its own pinned to core 1 (``taskset``), so what is measured is the daemons'
defence, not two processes fighting for one core. The job reads a preloaded dataset over the
``tcp`` rail (whose receiver one of the attacks targets) with a short training step, every epoch
checked whole (each sample once, bytes intact). Per workload (sample size) and attack, the run
alternates baseline and attack ``--repeat`` times and reports the medians and their ratio; the
Done-when of the security review asks for at least 0.9.

Attacks (``tests/security/attacks.py``; each bounded in connections and time):

- ``drip-handshakes``: 32 dialers drip a hello one byte at a time at the job's tcp receiver;
- ``hold-watch-streams``: 40 grpc.health ``Watch`` streams held on a server, and on the manager;
- ``hold-bodiless-calls``: 40 unary calls on a server that never send their request;
- ``flood-stream-plan``: 20-chunk plans of 16 MiB chunks streamed at a server for a feed that does not exist;
- ``idle-http-connections``: 100 HTTP connections that never finish a request, on a server and the manager.

    python bench/attacks.py --json bench/results/attacks.json --png bench/results/attacks.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from _common import KIB, machine_info, write_json

from kspeed import DatasetSpec, KSpeedClient
from kspeed.cli.cluster import LocalCluster
from kspeed.config import ClientConfig, load_config
from kspeed.rdma.tcp import wire

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB_CORE, ATTACK_CORE = 0, 1


def write_samples(root: str, count: int, size: int) -> dict[str, bytes]:
    """``count`` files of about ``size`` bytes, each its own bytes; {relpath: bytes} in sample order."""
    rng = np.random.default_rng(3)
    files = {}
    for i in range(count):
        rel = f"c{i % 10}/{i:06d}.bin"
        os.makedirs(os.path.join(root, f"c{i % 10}"), exist_ok=True)
        body = rng.integers(0, 256, int(size * rng.uniform(0.5, 1.5)), dtype=np.uint8).tobytes()
        with open(os.path.join(root, rel), "wb") as fh:
            fh.write(body)
        files[rel] = body
    return dict(sorted(files.items()))


def attack_argv(name: str, cluster: LocalCluster, receiver: dict, duration: float) -> list[str]:
    """The command line of one attack (pinned to its own core)."""
    server = cluster.servers[0].ready
    hello = wire.HELLO.pack(wire.MAGIC, wire.BULK, receiver["consumer"], 0) + bytes(32)
    target, options = {
        "drip-handshakes": (
            f"{receiver['host']}:{receiver['port']}",
            ["--n", "32", "--payload-hex", hello.hex(), "--interval", "1.5"],
        ),
        "hold-watch-streams@server": (server["grpc"], ["--n", "40"]),
        "hold-watch-streams@manager": (cluster.address, ["--n", "40"]),
        "hold-bodiless-calls": (server["grpc"], ["--n", "40"]),
        "flood-stream-plan": (server["grpc"], ["--chunks", "20", "--chunk-bytes", str(16 << 20)]),
        "idle-http-connections@server": (server["http"], ["--n", "100"]),
        "idle-http-connections@manager": (cluster.http_address, ["--n", "100"]),
    }[name]
    attack = name.split("@")[0]
    timed = [] if attack == "flood-stream-plan" else ["--duration", str(duration)]
    return [
        "taskset",
        "-c",
        str(ATTACK_CORE),
        sys.executable,
        "-m",
        "tests.security.attacks",
        attack,
        target,
        *options,
        *timed,
    ]


def read_for(ds, files: dict[str, bytes], seconds: float, step: float, epoch: int) -> tuple[int, float, int]:
    """Read whole epochs for at least ``seconds``: (samples, seconds taken, next epoch); each checked."""
    keys = list(files)
    samples, started = 0, time.monotonic()
    while time.monotonic() - started < seconds:
        ds.set_epoch(epoch)
        seen: list[int] = []
        for batch in ds:
            for i, sid in enumerate(batch.ids.tolist()):
                if batch.numpy(i).tobytes() != files[keys[sid]]:
                    raise AssertionError(f"epoch {epoch} sample {sid}: wrong bytes")
            seen += batch.ids.tolist()
            time.sleep(step)
        if sorted(seen) != list(range(len(files))):
            raise AssertionError(f"epoch {epoch}: not every sample once")
        samples += len(seen)
        epoch += 1
    return samples, time.monotonic() - started, epoch


def one_workload(kib: int, args: argparse.Namespace, attacks: list[str]) -> list[dict]:
    """Every attack against one workload; returns a row per attack."""
    root = tempfile.mkdtemp(prefix=f"kspeed-bench-attacks-{kib}k-")
    state = tempfile.mkdtemp(prefix="kspeed-bench-attacks-cluster-")
    files = write_samples(root, args.samples, kib * KIB)
    memory = max(64 << 20, 2 * sum(len(b) for b in files.values()))
    cluster = LocalCluster(
        state,
        servers=2,
        server_args=["--backend-allow", root, "--memory", str(memory), "--region-size", "1MiB"],
        launch_prefix=lambda name: ["taskset", "-c", str(JOB_CORE)],
    )
    rows = []
    try:
        cluster.start()
        config = load_config(ClientConfig, environ={}, overrides={"manager": cluster.address, "security.auth": "none"})
        with KSpeedClient(config=config) as client:
            ds = client.dataset(DatasetSpec(name="data", uri=root), batch_size=args.batch, rail="tcp", quiet=True)
            ds.preload()
            receiver = json.loads(ds._feed.receiver.material)
            epoch = 0
            _, _, epoch = read_for(ds, files, 1.0, args.step, epoch)  # warm
            for name in attacks:
                base, under, reports = [], [], []
                for _ in range(args.repeat):
                    samples, took, epoch = read_for(ds, files, args.seconds, args.step, epoch)
                    base.append(samples / took)
                    attacker = subprocess.Popen(
                        attack_argv(name, cluster, receiver, args.seconds + 4),
                        cwd=ROOT,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.DEVNULL,
                        text=True,
                    )
                    time.sleep(2.0)  # its connections open and the target's limits engaged
                    samples, took, epoch = read_for(ds, files, args.seconds, args.step, epoch)
                    under.append(samples / took)
                    try:
                        out, _ = attacker.communicate(timeout=args.seconds + 60)
                    except subprocess.TimeoutExpired:
                        attacker.kill()
                        out, _ = attacker.communicate()
                    reports.append(json.loads(out) if out.strip() else {})
                row = {
                    "attack": name,
                    "sample_kib": kib,
                    "baseline_samples_per_s": round(float(np.median(base)), 1),
                    "attacked_samples_per_s": round(float(np.median(under)), 1),
                    "ratio": round(float(np.median(under) / np.median(base)), 3),
                    "runs": {"baseline": [round(x, 1) for x in base], "attacked": [round(x, 1) for x in under]},
                    "attack_reports": reports,
                }
                rows.append(row)
                print(
                    f"{kib:>4} KiB {name:<32} baseline {row['baseline_samples_per_s']:>9.1f}/s  under attack "
                    f"{row['attacked_samples_per_s']:>9.1f}/s  ratio {row['ratio']:.3f}",
                    flush=True,
                )
            ds.close()
    finally:
        cluster.stop()
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    return rows


def chart(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attacks = list(dict.fromkeys(r["attack"] for r in rows))
    sizes = sorted({r["sample_kib"] for r in rows})
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(sizes)
    for n, kib in enumerate(sizes):
        values = [next((r["ratio"] for r in rows if (r["attack"], r["sample_kib"]) == (a, kib)), 0) for a in attacks]
        ax.bar(np.arange(len(attacks)) + n * width, values, width, label=f"{kib} KiB samples")
    ax.axhline(0.9, color="gray", linestyle="--", linewidth=1, label="0.9 (target)")
    ax.set_xticks(np.arange(len(attacks)) + 0.4 - width / 2, attacks, rotation=20, ha="right")
    ax.set_ylabel("throughput under attack / alone")
    ax.set_ylim(0, 1.2)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="32,256", help="sample sizes in KiB (comma separated)")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--step", type=float, default=0.002, help="the training step, seconds")
    parser.add_argument("--seconds", type=float, default=6.0, help="reading time of each measurement")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--attacks",
        default="drip-handshakes,hold-watch-streams@server,hold-watch-streams@manager,hold-bodiless-calls,"
        "flood-stream-plan,idle-http-connections@server,idle-http-connections@manager",
    )
    parser.add_argument("--json", default="")
    parser.add_argument("--png", default="")
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2 or shutil.which("taskset") is None:
        raise SystemExit("needs two cores and taskset: the job on one, the attacker on the other")
    os.sched_setaffinity(0, {JOB_CORE})
    rows = []
    for kib in [int(x) for x in args.sizes.split(",")]:
        rows += one_workload(kib, args, args.attacks.split(","))
    result = {"machine": machine_info(), "settings": {k: v for k, v in vars(args).items() if k not in ("json", "png")}}
    result["runs"] = rows
    if args.json:
        write_json(args.json, result)
    if args.png:
        chart(rows, args.png)


if __name__ == "__main__":
    main()
