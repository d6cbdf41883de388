"""Shared preparation: 1, 2, 4 and 8 jobs on one dataset, in a group and not.

A hyperparameter search runs many jobs over the same dataset at once. Each job here is a separate
process with its own batch size, calling ``client.dataset`` as the README tells a user to, all on
the training core; one server with one preprocessing worker on the other core
(``bench/_throttled.py``). Every job runs the server stages (decode, ``RandomResizedCrop``, flip of
JPEG photographs) on the servers (``offload=1.0``, what ``offload="auto"`` gives a job in a group),
so the servers' preprocessing is the bottleneck, as on a cluster whose training nodes' CPUs are
busy; a lone job with ``offload="auto"``, which also preprocesses on its own idle core, is
measured beside it. Two datasets: held in
memory (preloaded), and three times the server's memory (``policy="stream"``, read every epoch
through the throttled store). For each, in the same run:

- one job alone, first and again last (ratios are taken against the faster of the two, and CPU
  and bytes against the lesser: on the shared two-core machine a job alone ran at 272-392 samples/s
  from one run to the next);
- 2, 4 and 8 jobs, each without a group and all in one group (``group="hp"``, ``share="samples"``);
- 8 jobs in a group, one of them stepping three times slower than a job alone consumes.

Per job: samples/s over its timed epochs (all jobs start them together, after a warm-up epoch);
per run: the server's CPU seconds (the server and every process under it) and the bytes its
producers read from the backend, per epoch of every job together and per delivered sample; the
group's figures (outputs produced, positions shared, served alone, evicted). Every job hashes the
bytes and labels of each epoch, and the grouped run's hashes must equal the same job's without a
group: exactly once, in its own order, bytes equal to a solo run.

Writes JSON and, with matplotlib, a PNG::

    python bench/shared_prep.py --json bench/results/shared_prep.json --png bench/results/shared_prep.png
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import MIB, machine_info, pyplot, write_json
from _throttled import split_cores, throttled_cluster
from preprocess import write_photos

from kspeed import DatasetSpec, KSpeedClient
from kspeed.cli.cluster import LocalCluster, wait_for
from kspeed.config import ClientConfig, load_config
from kspeed.preprocess import Output, Pipeline, Stage

NAME = "photos"
SEED = 3
GROUP = "hp"
BATCHES = (32, 16, 24, 48, 20, 40, 28, 36)  # job k's batch size
READY = 3  # the manager's dataset state once preloaded
CLK_TCK = os.sysconf("SC_CLK_TCK")
SLOWER = 3.0


def pipeline(side: int) -> Pipeline:
    return Pipeline(
        [
            Stage("decode_image", {"mode": "RGB"}),
            Stage("random_resized_crop", {"size": [side, side]}),
            Stage("flip", {"p": 0.5}),
            Stage("to_chw", output=Output(shape=(3, side, side), dtype="uint8")),
        ]
    )


def config_for(address: str, job: str = "") -> ClientConfig:
    overrides = {"manager": address, "security.auth": "none"}
    if job:
        overrides["job"] = job
    return load_config(ClientConfig, environ={}, overrides=overrides)


# -- one job ---------------------------------------------------------------------------------------


def job_main(address: str, k: int, job: dict, cores: list[int], begin, stop, out) -> None:
    """One job: a warm-up epoch, then from ``begin`` an untimed epoch and timed epochs until it
    has run ``epochs`` (or ``stop`` is set, for a job that is to be measured while the others
    run), hashing each epoch."""
    os.sched_setaffinity(0, cores)
    import torch

    torch.set_num_threads(1)
    try:
        with KSpeedClient(config=config_for(address, f"job{k}")) as client:
            ds = client.dataset(NAME, job["batch"], seed=SEED, group=job["group"], offload=job["offload"], quiet=True)
            step = job["step_s"]
            digests = []

            def epoch(e: int, stoppable: bool) -> tuple[int, bool]:
                ds.set_epoch(e)
                h = hashlib.sha1()
                n = 0
                for images, labels in ds:
                    h.update(images.numpy().tobytes())
                    h.update(labels.numpy().tobytes())
                    n += len(images)
                    if step:
                        time.sleep(step)
                    if stoppable and stop.is_set():
                        return n, False
                digests.append(h.hexdigest())
                return n, True

            epoch(0, False)
            out.put(("ready", k, None))
            begin.wait()
            # (the servers produced ahead while the jobs waited for each other: an untimed epoch
            # takes what that left in the window, so the timed ones run at the servers' pace)
            epoch(1, False)
            began, cpu0 = time.perf_counter(), time.process_time()
            samples = 0
            for e in range(2, job["epochs"] + 2):
                n, whole = epoch(e, job["stoppable"])
                samples += n
                if not whole:
                    break
            seconds, cpu = time.perf_counter() - began, time.process_time() - cpu0
            out.put(("done", k, {"samples": samples, "seconds": seconds, "cpu_s": cpu, "digests": digests}))
            group = ds.group_figures()
            stop.wait()  # open until every job is measured (the group and its figures stay)
            out.put(("figures", k, group))
            ds.close()
    except BaseException as exc:
        out.put(("failed", k, f"{type(exc).__name__}: {exc}"))
        raise


# -- the server's figures --------------------------------------------------------------------------


def tree_cpu(root: int) -> dict[str, float]:
    """CPU seconds of process ``root`` and every process under it, by role: ``main`` (``root``),
    ``feeders`` (the processes that write to the clients), ``prep`` (the preprocessing workers)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    roles = {"main": 0.0, "feeders": 0.0, "prep": 0.0}
    for pid, t in times.items():
        p = pid
        while p > 1:
            if p == root:
                roles[role(pid, root)] += t
                break
            p = parents.get(p, 0)
    return roles


def role(pid: int, root: int) -> str:
    if pid == root:
        return "main"
    try:
        line = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "feeders"
    return "prep" if b"prep.worker" in line else "feeders"


def server_cpu(pids: list[int]) -> dict[str, float]:
    out = {"main": 0.0, "feeders": 0.0, "prep": 0.0}
    for pid in pids:
        for k, v in tree_cpu(pid).items():
            out[k] += v
    return out


def fetched_bytes(cluster: LocalCluster) -> float:
    """Bytes the servers' producers read from the backend for feeds so far."""
    from urllib.request import urlopen

    from preprocess import metric

    name = f'kspeed_server_fetched_bytes_total{{dataset="{NAME}"}}'
    texts = [urlopen(f"http://{s.ready['http']}/metrics").read().decode() for s in cluster.servers]
    return sum(v for v in (metric(t, name) for t in texts) if v == v)  # (none yet: NaN)


# -- one run ---------------------------------------------------------------------------------------


def run(cluster: LocalCluster, jobs: list[dict], ranks_cores: list[int]) -> dict:
    """The jobs at once; their rates and digests, the server's CPU and backend reads over the timed part."""
    ctx = mp.get_context("spawn")
    begin, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=job_main, args=(cluster.address, k, job, ranks_cores, begin, stop, out))
        for k, job in enumerate(jobs)
    ]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    figures: dict[int, dict | None] = {}
    ready: dict[int, None] = {}
    servers = [s.process.pid for s in cluster.servers]
    try:

        def until(done, timeout: float) -> None:
            deadline = time.monotonic() + timeout
            while not done():
                what, k, value = out.get(timeout=max(deadline - time.monotonic(), 0.1))
                if what == "failed":
                    raise RuntimeError(f"job {k} failed: {value}")
                {"ready": ready, "done": results, "figures": figures}[what][k] = value

        until(lambda: len(ready) == len(jobs), 600)
        cpu0, read0 = server_cpu(servers), fetched_bytes(cluster)
        began = time.perf_counter()
        begin.set()
        timed = [k for k, job in enumerate(jobs) if not job["stoppable"]]
        until(lambda: all(k in results for k in timed), 900)
        stop.set()
        seconds = time.perf_counter() - began
        roles = {k: v - cpu0[k] for k, v in server_cpu(servers).items()}
        cpu, read = sum(roles.values()), fetched_bytes(cluster) - read0
        until(lambda: len(results) == len(jobs) and len(figures) == len(jobs), 120)
    finally:
        stop.set()
        begin.set()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    samples = sum(r["samples"] for r in results.values())
    return {
        "jobs": [
            {
                **job,
                **results[k],
                "samples_per_s": results[k]["samples"] / results[k]["seconds"],
                # (the job's own process, every thread: what it costs the training core per sample)
                "client_cpu_s_per_sample": results[k]["cpu_s"] / max(results[k]["samples"], 1),
            }
            for k, job in enumerate(jobs)
        ],
        # (the most each job could take if the training cores did nothing but its own work)
        "client_core_bound_per_job": len(ranks_cores)
        / max(sum(results[k]["cpu_s"] / max(results[k]["samples"], 1) for k in results), 1e-9),
        "seconds": seconds,
        "server_cpu_s": cpu,
        "server_cpu_s_by_role": roles,
        "backend_bytes": read,
        "samples": samples,
        # (the measured span holds the untimed epoch after the barrier too: as many samples per epoch)
        "server_cpu_s_per_sample": cpu / max(samples * (jobs[0]["epochs"] + 1) / jobs[0]["epochs"], 1),
        # (the measured span holds the untimed epoch after the barrier and the timed ones)
        "server_cpu_s_per_epoch": cpu / (jobs[0]["epochs"] + 1),
        "backend_bytes_per_epoch": read / (jobs[0]["epochs"] + 1),
        "group": next((f for f in figures.values() if f), None),
        "group_mine": [(figures.get(k) or {}).get("mine") for k in range(len(jobs))],  # each job's own counts
    }


def attempt(cluster: LocalCluster, jobs: list[dict], ranks_cores: list[int]) -> dict | None:
    """:func:`run`, or None (logged) when a job of it failed."""
    try:
        return run(cluster, jobs, ranks_cores)
    except RuntimeError as exc:
        print(f"FAILED: {exc}", flush=True)
        return None


def jobs_of(n: int, group: str | None, epochs: int, slow_step: float = 0.0, offload: float | None = 1.0) -> list[dict]:
    jobs = [
        {"batch": BATCHES[k], "group": group, "step_s": 0.0, "epochs": epochs, "stoppable": False, "offload": offload}
        for k in range(n)
    ]
    if slow_step:
        jobs[-1].update(step_s=slow_step, epochs=10**6, stoppable=True)
    return jobs


def scenario(kind: str, root: Path, total: int, count: int, args: argparse.Namespace) -> dict:
    """Every run of one dataset (``memory``: held whole and preloaded; ``streamed``: 3x memory) on a fresh cluster."""
    state = Path(tempfile.mkdtemp(prefix=f"kspeed-shared-{kind}-"))
    ranks, _ = split_cores(args.pin)
    window = args.window_mib * MIB
    memory = (total if kind == "memory" else total // 3) + window + 8 * MIB
    cluster = throttled_cluster(
        state,
        root,
        servers=1,
        store={"latency": args.latency, "bandwidth": args.bandwidth},
        memory=memory,
        region=MIB,
        pin=args.pin,
        extra=["--preprocess-workers", str(args.server_workers), "--production-window", str(window)],
    )
    try:
        with KSpeedClient(config=config_for(cluster.address)) as client:
            quota = total // 3 if kind == "streamed" else 0
            spec = DatasetSpec(
                name=NAME,
                uri=f"throttled://{root}",
                labels="dirname",
                pipeline=pipeline(args.side),
                quota_bytes=quota,
                policy="stream" if kind == "streamed" else "auto",
            )
            client.manager.create_dataset(spec.to_proto(), operator=True)
            if kind == "memory":
                client.manager.preload(NAME)
                wait_for(lambda: client.manager.dataset(NAME).state == READY or None, 600, "the preload")
            runs: dict[str, dict] = {}
            failed: dict[str, str] = {}  # runs a job of which failed: recorded, the others still run
            runs["solo"] = run(cluster, jobs_of(1, None, args.epochs), sorted(ranks))
            solo_rate = runs["solo"]["jobs"][0]["samples_per_s"]
            print(f"{kind}: solo {solo_rate:.0f} samples/s", flush=True)
            # (the README's default: a lone job also runs server stages on its own idle core)
            runs["solo-auto"] = run(cluster, jobs_of(1, None, args.epochs, offload=None), sorted(ranks))
            print(f"{kind}: solo, offload='auto' {runs['solo-auto']['jobs'][0]['samples_per_s']:.0f} samples/s")
            for n in args.jobs:
                if n == 1:
                    continue
                for group in (None, GROUP):
                    key = f"{n}-{'group' if group else 'apart'}"
                    got = attempt(cluster, jobs_of(n, group, args.epochs), sorted(ranks))
                    if got is None:
                        failed[key] = "a job failed (see the log)"
                        continue
                    runs[key] = got
                    rates = [j["samples_per_s"] for j in got["jobs"]]
                    print(f"{kind}: {key} {min(rates):.0f}-{max(rates):.0f} samples/s per job", flush=True)
            if 8 in args.jobs:
                slow = BATCHES[7] / (solo_rate / SLOWER)
                got = attempt(cluster, jobs_of(8, GROUP, args.epochs, slow_step=slow), sorted(ranks))
                if got is None:
                    failed["8-slow-group"] = "a job failed (see the log)"
                else:
                    runs["8-slow-group"] = got
                    rates = [j["samples_per_s"] for j in got["jobs"]]
                    print(
                        f"{kind}: 8-slow-group fast {min(rates[:-1]):.0f}-{max(rates[:-1]):.0f}, slow {rates[-1]:.0f}"
                    )
            # (one job alone again, last: on this shared machine a job alone ran at 272-392 samples/s
            # from one run to the next; the ratios are taken against the faster of the two)
            runs["solo-again"] = run(cluster, jobs_of(1, None, args.epochs), sorted(ranks))
            again = runs["solo-again"]["jobs"][0]["samples_per_s"]
            print(f"{kind}: solo again {again:.0f} samples/s", flush=True)
        return {
            "kind": kind,
            "dataset_bytes": total,
            "samples": count,
            "solo_samples_per_s": max(solo_rate, again),
            "runs": runs,
            "failed": failed,
        }
    finally:
        cluster.stop()
        if not os.environ.get("KSPEED_BENCH_KEEP"):  # (kept: the daemons' logs, to read after a failure)
            shutil.rmtree(state, ignore_errors=True)


# -- verdicts --------------------------------------------------------------------------------------


def targets(doc: dict) -> list[dict]:
    out = []
    for sc in doc["scenarios"]:
        runs, kind = sc["runs"], sc["kind"]
        solo = runs["solo"]
        solos = [runs[k] for k in ("solo", "solo-again") if k in runs]
        if "4-group" in runs and "4-apart" in runs:
            g = runs["4-group"]
            # (against the lesser of the two lone runs' CPU, as the rate is against the faster)
            cpu = g["server_cpu_s_per_epoch"] / max(min(r["server_cpu_s_per_epoch"] for r in solos), 1e-9)
            rate = min(j["samples_per_s"] for j in g["jobs"]) / sc["solo_samples_per_s"]
            apart = min(j["samples_per_s"] for j in runs["4-apart"]["jobs"]) / sc["solo_samples_per_s"]
            out.append(
                {
                    "scenario": kind,
                    "target": "4 jobs in a group: server CPU per epoch <= 1.2x one job's",
                    "value": round(cpu, 3),
                    "met": cpu <= 1.2,
                }
            )
            if kind == "streamed":
                b = g["backend_bytes_per_epoch"] / max(min(r["backend_bytes_per_epoch"] for r in solos), 1.0)
                out.append(
                    {
                        "scenario": kind,
                        "target": "4 jobs in a group: backend bytes per epoch <= 1.2x one job's",
                        "value": round(b, 3),
                        "met": b <= 1.2,
                    }
                )
            out.append(
                {
                    "scenario": kind,
                    "target": "4 jobs in a group: each job >= 0.9x one job alone",
                    "value": round(rate, 3),
                    "met": rate >= 0.9,
                    "apart": round(apart, 3),
                }
            )
        if "8-slow-group" in runs:
            s = runs["8-slow-group"]
            fast = min(j["samples_per_s"] for j in s["jobs"][:-1]) / sc["solo_samples_per_s"]
            slow = s["jobs"][-1]["samples_per_s"] / sc["solo_samples_per_s"]
            mine = s["group_mine"][-1] or {}
            read = sum(mine.get(k, 0) for k in ("produced", "shared", "alone"))
            alone = mine.get("alone", 0) / max(read, 1)
            out.append(
                {
                    "scenario": kind,
                    "target": "8 jobs, one 3x slower: fast jobs >= 0.85x their solo rate",
                    "value": round(fast, 3),
                    "met": fast >= 0.85,
                    # With the servers' preprocessing the bottleneck (a job alone runs at their
                    # rate), what the slow job has made for it alone takes its part of that rate
                    # from the others: they can reach at most 1 - (its rate x its share alone).
                    "ceiling": round(1 - slow * alone, 3),
                    "slow_alone_fraction": round(alone, 3),
                    "slow_positions": read,
                }
            )
        same = all(
            runs[f"{key}-group"]["jobs"][k]["digests"] == runs[f"{key}-apart"]["jobs"][k]["digests"]
            for key in [str(n) for n in (2, 4, 8) if f"{n}-group" in runs and f"{n}-apart" in runs]
            for k in range(len(runs[f"{key}-group"]["jobs"]))
        ) and all(
            runs[f"{n}-group"]["jobs"][0]["digests"] == solo["jobs"][0]["digests"]
            for n in (2, 4, 8)
            if f"{n}-group" in runs
        )
        out.append(
            {"scenario": kind, "target": "every job's epochs in a group hash as the same job's alone", "met": same}
        )
    return out


def chart(doc: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(doc["scenarios"]), figsize=(6 * len(doc["scenarios"]), 4.2), squeeze=False)
    for ax, sc in zip(axes[0], doc["scenarios"], strict=True):
        ns = [n for n in doc["jobs"] if n == 1 or (f"{n}-group" in sc["runs"] and f"{n}-apart" in sc["runs"])]
        solo = sc["solo_samples_per_s"]
        for label, key, marker in (("in a group", "group", "o"), ("apart", "apart", "s")):
            ys = [
                min(j["samples_per_s"] for j in (sc["runs"]["solo"] if n == 1 else sc["runs"][f"{n}-{key}"])["jobs"])
                / solo
                for n in ns
            ]
            ax.plot(ns, ys, marker=marker, label=f"slowest job, {label}")
        ax.axhline(0.9, color="grey", linestyle=":", label="target 0.9x")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_ylim(0, 1.2)
        ax.set_xlabel("jobs on one dataset")
        ax.set_ylabel("samples/s per job / one job alone")
        ax.set_title(f"{sc['kind']}: one job alone {solo:.0f} samples/s")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--photos", type=int, default=1024, help="JPEG photographs in the dataset")
    parser.add_argument("--side", type=int, default=128, help="output side of RandomResizedCrop")
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per job")
    parser.add_argument("--jobs", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    parser.add_argument("--scenarios", default="memory,streamed")
    parser.add_argument("--server-workers", type=int, default=1)
    parser.add_argument("--window-mib", type=int, default=32, help="the server's production window")
    parser.add_argument("--latency", type=float, default=0.005, help="throttled store: seconds per request")
    parser.add_argument("--bandwidth", type=float, default=40e6, help="throttled store: bytes/s per server")
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="do not split the cores")
    parser.add_argument("--json", default="bench/results/shared_prep.json")
    parser.add_argument("--png", default="bench/results/shared_prep.png")
    args = parser.parse_args()
    base = Path(os.environ.get("KSPEED_BENCH_CACHE", "/var/tmp/kspeed-shared-prep")) / f"{args.photos}"
    cache = base / "photos"
    if not (base / "done").exists():
        shutil.rmtree(base, ignore_errors=True)
        cache.mkdir(parents=True)
        write_photos(cache, args.photos)
        (base / "done").write_text("")
    files = list(cache.rglob("*.jpg"))
    total = sum(p.stat().st_size for p in files)
    doc = {
        "benchmark": "shared_prep",
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "png")},
        "jobs": args.jobs,
        "batch_sizes": BATCHES,
        "scenarios": [scenario(kind, cache, total, len(files), args) for kind in args.scenarios.split(",")],
    }
    doc["targets"] = targets(doc)
    for t in doc["targets"]:
        print(
            ("MET " if t["met"] else "MISSED ")
            + t["scenario"]
            + ": "
            + t["target"]
            + (f" ({t['value']})" if "value" in t else "")
        )
    write_json(args.json, doc)
    chart(doc, args.png)


if __name__ == "__main__":
    main()
