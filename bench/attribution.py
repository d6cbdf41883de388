"""Attribution of the ranks' data wait while a job runs (docs/analyze.md): does it name the right server and cause?

Two servers hold a set of JPEG photographs; a job of two ranks (threads of this process, each its
own client, as two training processes would be) reads them through a pipeline the servers run
whole (``decode_image``, ``random_resized_crop(224)``, ``flip``, ``to_chw``; ``offload=1.0``), with a
fixed training step (a sleep: it costs no CPU). Per phase, on the same cluster:

- **even**: nothing slowed, a step long enough that the servers keep up. Target: no cause over
  10% of the ranks' step time (nothing invented).
- **slow**: one server's process tree (the daemon, its feeders and its preprocessing workers)
  put in a cgroup (v1 ``cpu`` controller) whose quota is ``--quota`` of one CPU, and a short step,
  so the job waits on that server's preprocessing. Target: at least 80% of the ranks' measured
  wait (their time inside ``next()``) attributed to that server with cause ``production``,
  ``prep`` or ``fetch``.
- **overhead**: the attribution's own bookkeeping (its ``overhead_s``: every per-batch call, the
  loop meter's, the folds) as a share of the step time, in both phases. Target: under 1%.

Figures are taken between a snapshot after the first ``--warmup`` batches of each rank (the
pipeline filling) and the end. The cgroup is removed on every way out (SIGTERM included). Writes
JSON and a PNG (``kspeed status --job --plot`` of the slowed phase)::

    sudo python bench/attribution.py --json docs/analyze/attribution.json --png docs/analyze/attribution.png
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_info, stop_on_sigterm, write_json
from preprocess import write_photos

CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000
PRODUCTION = ("production", "prep", "fetch")


class CpuQuota:
    """A cgroup (v1 ``cpu``) holding a process tree to ``quota`` CPUs; :meth:`close` moves the
    processes back and removes it."""

    def __init__(self, name: str, quota: float) -> None:
        if not (CGROUP_ROOT / "cpu.cfs_quota_us").exists():
            raise SystemExit(f"no cgroup v1 cpu controller at {CGROUP_ROOT}: cannot slow a server")
        self.path = CGROUP_ROOT / name
        self.path.mkdir()
        (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (self.path / "cpu.cfs_quota_us").write_text(str(int(quota * PERIOD_US)))

    def add_tree(self, pid: int) -> list[int]:
        """Put ``pid`` and its descendants in (children forked later start in it)."""
        moved = []
        for p in [pid, *descendants(pid)]:
            with contextlib.suppress(OSError):  # (gone meanwhile)
                (self.path / "cgroup.procs").write_text(str(p))
                moved.append(p)
        return moved

    def close(self) -> None:
        if not self.path.exists():
            return
        for line in (self.path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # (gone meanwhile)
                (CGROUP_ROOT / "cgroup.procs").write_text(line)
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            out.extend(kids)
            todo.extend(kids)
    return sorted(set(out))


def pipeline():
    from kspeed.preprocess.pipeline import Output, Pipeline, Stage

    return Pipeline(
        [
            Stage("decode_image", {"mode": "RGB"}),
            Stage("random_resized_crop", {"size": [224, 224]}),
            Stage("flip", {"p": 0.5}),
            Stage("to_chw", output=Output(shape=(3, 224, 224), dtype="uint8")),
        ]
    )


def figures(ds) -> dict:
    """The inner dataset's attribution figures."""
    inner = getattr(ds, "kspeed_dataset", ds)
    return inner.stats()["attribution"]


def delta(after: dict, before: dict) -> dict:
    """Seconds per (cause, server, stage), wait, step and overhead between two snapshots."""
    rows = {(r["cause"], r["server"], r["stage"]): r["seconds"] for r in after["rows"]}
    for r in before["rows"]:
        key = (r["cause"], r["server"], r["stage"])
        rows[key] = rows.get(key, 0.0) - r["seconds"]
    return {
        "rows": rows,
        "blocked_s": after["blocked_s"] - before["blocked_s"],
        "step_s": after["step_s"] - before["step_s"],
        "overhead_s": after["overhead_s"] - before["overhead_s"],
    }


def run_phase(address: str, spec, job: str, args, step_s: float, epochs: int) -> list[dict]:
    """Two ranks, each in a thread, ``epochs`` epochs with a ``step_s`` sleep per batch; per rank
    the figures from after its warm-up to the end."""
    from kspeed import KSpeedClient
    from kspeed.config import ClientConfig, load_config

    results: list[dict | None] = [None, None]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        config = load_config(
            ClientConfig,
            environ={},
            overrides={"manager": address, "security.auth": "none", "job": job, "stats_interval": "1s"},
        )
        client = KSpeedClient(config=config)
        try:
            ds = client.dataset(
                spec, batch_size=args.batch, rank=r, world_size=2, offload=1.0, num_workers=0, seed=0, quiet=True
            )
            ds.preload()
            seen, start, batches = 0, None, 0
            t0 = time.monotonic()
            for epoch in range(epochs):
                ds.set_epoch(epoch)
                for _batch in ds:
                    seen += 1
                    if seen == args.warmup:
                        start, t0 = figures(ds), time.monotonic()
                    elif seen > args.warmup:
                        batches += 1
                    time.sleep(step_s)
            end = figures(ds)
            out = delta(end, start)
            out.update(rank=r, batches=batches, wall_s=time.monotonic() - t0)
            results[r] = out
            time.sleep(1.5)  # a last report with every figure reaches the manager
            ds.close()
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]


def summarize(ranks: list[dict], slow: str | None) -> dict:
    rows: dict[str, float] = {}
    for r in ranks:
        for (cause, server, stage), seconds in r["rows"].items():
            label = cause + (f"@{server}" if server else "") + (f"[{stage}]" if stage else "")
            rows[label] = rows.get(label, 0.0) + seconds
    blocked = sum(r["blocked_s"] for r in ranks)
    step = sum(r["step_s"] for r in ranks)
    overhead = sum(r["overhead_s"] for r in ranks)
    batches = sum(r["batches"] for r in ranks)
    by_cause: dict[str, float] = {}
    for r in ranks:
        for (cause, _, _), seconds in r["rows"].items():
            by_cause[cause] = by_cause.get(cause, 0.0) + seconds
    out = {
        "ranks": len(ranks),
        "batches": batches,
        "blocked_s": blocked,
        "step_s": step,
        "wait_share_of_time": blocked / (blocked + step) if blocked + step else 0.0,
        "by_cause_s": by_cause,
        "by_cause_of_step": {c: v / step for c, v in by_cause.items()} if step else {},
        "rows_s": dict(sorted(rows.items(), key=lambda kv: -kv[1])),
        "overhead_s": overhead,
        "overhead_of_step": overhead / step if step else 0.0,
        "overhead_per_batch_us": 1e6 * overhead / batches if batches else 0.0,
    }
    if slow is not None:
        on_slow = sum(
            seconds
            for r in ranks
            for (cause, server, _), seconds in r["rows"].items()
            if server == slow and cause in PRODUCTION
        )
        out["slow_server"] = slow
        out["attributed_to_slow_production_s"] = on_slow
        out["attributed_to_slow_production_share"] = on_slow / blocked if blocked else 0.0
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="where to write the JSON (default: stdout)")
    parser.add_argument("--png", default=None, help="where to write the slowed phase's plot")
    parser.add_argument("--samples", type=int, default=480)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=4, help="batches per rank before the figures are taken")
    parser.add_argument("--even-step-ms", type=float, default=300.0, help="the step with nothing slowed")
    parser.add_argument("--slow-step-ms", type=float, default=20.0, help="the step with one server slowed")
    parser.add_argument("--quota", type=float, default=0.3, help="CPUs the slowed server's processes may use")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    stop_on_sigterm()

    from kspeed import DatasetSpec
    from kspeed.cli.cluster import LocalCluster, wait_for
    from kspeed.config import ClientConfig, load_config
    from kspeed.control.manager_client import ManagerClient
    from kspeed.control.status import job_dict
    from kspeed.proto import kspeed_pb2

    load_before = os.getloadavg()  # (the machine's other work slows the client's own part)
    work = Path(tempfile.mkdtemp(prefix="kspeed-bench-attr-"))
    quota: CpuQuota | None = None
    cluster = None
    try:
        root = work / "photos"
        write_photos(root, args.samples, sides=(320, 480))  # as the recorded runs
        cluster = LocalCluster(
            str(work / "cluster"),
            servers=2,
            server_args=["--backend-allow", str(work), "--memory", "256MiB", "--region-size", "16MiB"],
        )
        cluster.start()
        config = load_config(ClientConfig, environ={}, overrides={"manager": cluster.address, "security.auth": "none"})
        manager = ManagerClient(config)
        wait_for(lambda: len(manager.servers()) == 2, 30, "both servers to register")
        spec = DatasetSpec(name="photos", uri=str(root), labels="dirname", pipeline=pipeline())

        even = run_phase(cluster.address, spec, "attr-even", args, args.even_step_ms / 1e3, args.epochs)
        slowed = cluster.servers[1]
        slow_id = slowed.ready["id"]
        quota = CpuQuota(f"kspeed-bench-{os.getpid()}", args.quota)
        moved = quota.add_tree(slowed.process.pid)
        print(f"slowed {slow_id}: {len(moved)} process(es) held to {args.quota} CPU", file=sys.stderr)
        slow = run_phase(cluster.address, spec, "attr-slow", args, args.slow_step_ms / 1e3, args.epochs)
        job = manager.call("GetJobStats", kspeed_pb2.JobRequest(job="attr-slow", history=True))
        shown = job_dict(job)
        if args.png:
            from kspeed.cli.plot import plot_job

            os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
            plot_job(shown, args.png)
        manager.close()
    finally:
        if quota is not None:
            quota.close()
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(work, ignore_errors=True)

    even_sum, slow_sum = summarize(even, None), summarize(slow, slow_id)
    worst_even = max(even_sum["by_cause_of_step"].values(), default=0.0)
    overhead = max(even_sum["overhead_of_step"], slow_sum["overhead_of_step"])
    doc = {
        "benchmark": "attribution",
        "machine": machine_info(),
        "settings": vars(args),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "even": even_sum,
        "slow": slow_sum,
        "manager_view_slow": {
            "blocked": shown["blocked"],
            "ranks": [
                {k: r[k] for k in ("rank", "wait_share", "top_cause", "blocked_s", "step_s")} for r in shown["ranks"]
            ],
        },
        "targets": [
            {
                "name": "slowed server's production >= 80% of the ranks' wait",
                "value": slow_sum["attributed_to_slow_production_share"],
                "met": slow_sum["attributed_to_slow_production_share"] >= 0.8,
            },
            {"name": "nothing slowed: no cause over 10% of step time", "value": worst_even, "met": worst_even <= 0.10},
            {"name": "bookkeeping under 1% of step time", "value": overhead, "met": overhead < 0.01},
        ],
    }
    write_json(args.json, doc)
    for target in doc["targets"]:
        print(f"{'met' if target['met'] else 'MISSED'}: {target['name']}: {target['value']:.4f}", file=sys.stderr)
    return 0 if all(t["met"] for t in doc["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
