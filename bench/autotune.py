"""Does ``offload="auto"`` pick the best split? Fixed ratios against auto, on a 2-core machine.

The ImageNet-style pipeline of ``bench/preprocess.py`` (JPEG crops; decode, ``RandomResizedCrop(224)``,
``RandomHorizontalFlip``, ``PILToTensor``), wrapped as a user would::

    client.wrap(folder, batch_size=32, sampler=RandomSampler(folder, generator=...), offload=X)

(for auto, ``offload`` left out), each configuration in a fresh job process against the same
running cluster: 2 warm-up epochs, then timed epochs (steady state: the servers produce the next
epoch while one is consumed). The job and its workers run on core 0, every daemon on core 1; the
training step burns a set CPU time per sample (``torch.mm``). Scenarios, each a sweep of
``offload`` 0.0, 0.1, ..., 1.0 and auto:

- **starved**: the step costs as much CPU per sample as preprocessing it locally (best: ~1.0);
- **spare**: the step costs half that, leaving the client's core room (best: ~0.4-0.7);
- **narrow rail**: the daemons in one network-lab host, the job in another on the ``tcp`` rail,
  its switch port shaped so that a decoded sample (150 KB) takes far longer to send than to
  decode locally, and a cheap step (best: 0 or 0.1).

Mid-run changes, with auto, throughput and the ratio in force polled every batch: the step doubles
half way (spare -> starved), and a holder of the dataset is killed with a spare server ready.

Targets (written, never asserted; a missed one prints MISSED): auto >= 0.95x the best fixed ratio
and >= 0.98x ``offload=0`` in each scenario; after each change, back within 5% of the new best
within 10 s with at most two ratio changes. Writes JSON and, with matplotlib, a PNG::

    python bench/autotune.py --json bench/results/autotune.json --png bench/results/autotune.png
    python bench/autotune.py --quick          # 160 images, 1 timed epoch, ratios 0, 0.25, ..., 1
    python bench/autotune.py --repeat 3       # each configuration three times: its median run

A single run per configuration makes "the best fixed ratio" the luckiest of eleven on a noisy
machine; ``--repeat`` runs the sweep in rounds (a slow spell falls on every configuration alike).
Every job's JSON holds each timed batch's wait (``batch_waits_ms``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _autotune_report import best_fixed, chart, median_run, recovery, targets
from _autotune_setup import lab_cluster, loopback_cluster, on_core, run_job
from _common import machine_info, stop_on_sigterm, write_json

from tests.netlab import parse_rate

SAMPLE_BYTES = 3 * 224 * 224  # a decoded sample as the servers send it (CHW uint8)
DEFAULT_RATE = "50mbit"
#: Lab hosts share the machine's hostname, by which a client takes its servers for co-located (no
#: pacing, so no measured rail rate); the job runs under a hostname of its own, as on its own node.
OWN_HOSTNAME = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', "autotune-cli"]


def ratios(step: float) -> list[float]:
    """0, step, 2 step, ..., 1 (rounded)."""
    count = round(1 / step)
    return [round(i / count, 4) for i in range(count + 1)]


class Bench:
    """The run's settings, its work directory and what it measured."""

    def __init__(self, args: argparse.Namespace, work: Path, cost: float, op_seconds: float) -> None:
        self.args, self.work, self.cost, self.op_seconds = args, work, cost, op_seconds
        self.dataset_bytes = 0
        self.root = work / "photos"
        self.logs = work / "jobs"
        self.logs.mkdir(parents=True, exist_ok=True)
        cores = sorted(os.sched_getaffinity(0))
        self.train_core, self.server_core = {cores[0]}, {cores[1]}

    def job(self, offload, step_s: float, config: dict, **more) -> dict:
        return {
            "root": str(self.root),
            "batch": self.args.batch,
            "offload": offload,
            "warmup": self.args.warmup,
            "warmup_s": self.args.warmup_s,
            "epochs": self.args.epochs,
            "mode": "epochs",
            "step_s": step_s,
            "op_seconds": self.op_seconds,
            "cores": sorted(self.train_core),
            "sampler": self.args.sampler,
            "model": f"step-{round(step_s * 1e6)}us",
            "config": config,
            **more,
        }

    def sweep(self, name: str, step_s: float, config: dict, prefix: list[str] | None = None) -> dict:
        """Every fixed ratio, then auto, each in a fresh job; with ``--repeat N``, N rounds of the
        whole sweep (so that a slow spell of the machine falls on every configuration alike), each
        configuration then standing for its median run (:func:`median_run`)."""
        runs: dict[str, list[dict]] = {}
        fixed = [float(r) for r in self.args.ratios.split(",")] if self.args.ratios else ratios(self.args.step)
        for round_ in range(self.args.repeat):
            for offload in [*fixed, "auto"]:
                label = offload if offload == "auto" else f"{offload:.2f}"
                tag = f"{name}-{label}" + (f"-r{round_}" if self.args.repeat > 1 else "")
                result = run_job(self.job(offload, step_s, config), self.logs, tag, prefix=prefix)
                runs.setdefault(label, []).append(result)
                print(f"  {name} offload={label}: {_describe(result)}", flush=True)
        return {label: median_run(results) for label, results in runs.items()}


def _describe(result: dict) -> str:
    if not result.get("ok"):
        return f"FAILED: {result.get('error')}"
    text = (
        f"{result['samples_per_s']:.1f} samples/s, client CPU beyond the step "
        f"{result['client_cpu_s_per_sample_beyond_step'] * 1e3:.2f} ms/sample"
    )
    stats = result.get("stats_offload", {})
    if stats.get("mode") == "auto":
        text += f"; auto ended at {stats['ratio']:.2f} after {stats['changes']} change(s) ({stats['reason']})"
    return text


def _scenario(title: str, step_s: float, expected: str, configs: dict, **more) -> dict:
    best = best_fixed(configs)
    auto = configs.get("auto", {})
    return {
        "title": title,
        "step_s_per_sample": step_s,
        "expected_best": expected,
        "best_fixed": {"offload": best[0], "samples_per_s": best[1]} if best else None,
        "auto": {
            "samples_per_s": auto.get("samples_per_s"),
            "final_ratio": auto.get("stats_offload", {}).get("ratio"),
            "changes": auto.get("stats_offload", {}).get("changes"),
            "ratio_per_epoch": auto.get("ratio_per_epoch"),
        }
        if auto.get("ok")
        else {"error": auto.get("error")},
        "configs": configs,
        **more,
    }


def _change(title: str, result: dict, change_at: float | None, best: tuple[str, float] | None, **more) -> dict:
    out = {"title": title, "job": result, **more}
    if not result.get("ok") or change_at is None or best is None:
        out["error"] = result.get("error") or (
            "no change made" if change_at is None else "no best fixed ratio to compare"
        )
        return out
    end = result["series"][-1][0] if result["series"] else None
    out["figures"] = recovery(result["series"], change_at, best[1], end)
    out["figures"]["new_best_offload"] = best[0]
    logged = [(round(t - change_at, 2), message) for t, message in result.get("changes_logged", [])]
    out["figures"]["changes_logged"] = logged  # the tuner's own log lines, seconds after the change
    out["figures"]["changes_logged_after"] = sum(1 for t, _ in logged if t > 0)
    return out


def loopback_part(bench: Bench, scenarios: dict, changes: dict, settings: dict) -> None:
    """Scenarios starved and spare, then the two mid-run changes, on one loopback cluster."""
    args = bench.args
    with loopback_cluster(bench.work, bench.work, bench.server_core) as (cluster, cluster_settings):
        settings["loopback"] = cluster_settings
        config = {"manager": cluster.address}
        starved, spare = bench.cost, bench.cost / 2
        if "starved" in args.scenarios:
            print("starved: step = local preprocessing cost", flush=True)
            configs = bench.sweep("starved", starved, config)
            scenarios["starved"] = _scenario("step = local cost", starved, "about 1.0", configs)
        if "spare" in args.scenarios:
            print("spare: step = half the local preprocessing cost", flush=True)
            configs = bench.sweep("spare", spare, config)
            scenarios["spare"] = _scenario("step = half the local cost", spare, "about 0.4-0.7", configs)
        timed = {"mode": "timed", "before_s": args.before_s, "after_s": args.after_s}
        if "step" in args.changes:
            print("step doubles half way (spare -> starved), auto", flush=True)
            changes["step_doubles"] = _guarded(step_run, bench, config, timed, scenarios)
            _print_change("step_doubles", changes["step_doubles"])
        if "kill" in args.changes:
            print("a holder killed with a spare ready (step as in spare), auto", flush=True)
            config = {**config, "failover_timeout": "60s"}
            changes["server_killed"] = _guarded(kill_run, bench, cluster, config, timed, scenarios)
            _print_change("server_killed", changes["server_killed"])


def _guarded(run, *args) -> dict:
    """``run(*args)``, or its error as the change's record (the run goes on)."""
    try:
        return run(*args)
    except Exception as exc:
        return {"title": run.__name__, "error": f"{type(exc).__name__}: {exc}"}


def step_run(bench: Bench, config: dict, timed: dict, scenarios: dict) -> dict:
    """Auto under the spare step, which becomes the starved step ``before_s`` after the warm-up."""
    job = bench.job("auto", bench.cost / 2, config, change_step_s=bench.cost, **timed)
    result = run_job(job, bench.logs, "change-step")
    at = result["warm_at"] + bench.args.before_s if result.get("ok") else None
    best = best_fixed(scenarios["starved"]["configs"]) if "starved" in scenarios else None
    return _change("the step doubles (spare -> starved)", result, at, best)


def _shares(client, name: str) -> list[dict]:
    return [
        {"server_id": s.server_id, "first_id": s.first_id, "end_id": s.end_id}
        for s in client.manager.dataset(name).shares
    ]


def kill_run(bench: Bench, cluster, config: dict, timed: dict, scenarios: dict) -> dict:
    """Auto under the spare step; a spare server added once the job holds the dataset, and the
    holder of its biggest share killed ``before_s`` after the warm-up."""
    from kspeed import KSpeedClient

    record: dict = {}
    client = KSpeedClient(config=cluster.client_config())
    timers: list[threading.Timer] = []

    def kill(name: str) -> None:
        try:
            record["shares_before"] = shares = _shares(client, name)
            biggest = max(shares, key=lambda share: share["end_id"] - share["first_id"])
            victim = next(s for s in cluster.servers if s.ready["id"] == biggest["server_id"])
            victim.signal(signal.SIGKILL)
            record.update(killed_at=time.monotonic(), victim=biggest["server_id"])
        except Exception as exc:
            record["kill_error"] = f"{type(exc).__name__}: {exc}"

    def look(name: str) -> None:
        try:
            record["shares_after"] = _shares(client, name)
        except Exception as exc:
            record["shares_after_error"] = f"{type(exc).__name__}: {exc}"

    def on_warm(warm: float, name: str) -> None:
        # The dataset is registered anew by each job (it is dropped when its last job ends): the
        # spare joins now, holding nothing, on the server core.
        with on_core(bench.server_core):
            spare = cluster.add_server(timeout=60)
        record.update(spare=spare.ready["id"], spare_ready_s=time.monotonic() - warm, dataset=name)
        kill_at = warm + bench.args.before_s
        for when, what in ((kill_at, kill), (kill_at + bench.args.after_s * 0.8, look)):
            timer = threading.Timer(max(when - time.monotonic(), 0.0), what, args=(name,))
            timers.append(timer)
            timer.start()

    try:
        job = bench.job("auto", bench.cost / 2, config, **timed)
        result = run_job(job, bench.logs, "change-kill", on_warm=on_warm)
    finally:
        for timer in timers:
            timer.cancel()
        client.close()
    best = best_fixed(scenarios["spare"]["configs"]) if "spare" in scenarios else None
    return _change("a holder killed, a spare ready", result, record.get("killed_at"), best, kill=record)


def lab_part(bench: Bench, scenarios: dict, settings: dict) -> None:
    """Scenario narrow rail: the daemons in one lab host, the job in another behind a shaped port."""
    args = bench.args
    rate = parse_rate(args.rate)
    step_s = bench.cost / 4
    with lab_cluster(bench.work, bench.work, bench.server_core, rate) as (cluster, cluster_settings, lab):
        settings["lab"] = cluster_settings
        config = {"manager": cluster.address, "rail": "tcp"}
        print(f"narrow rail: {rate / 1e6:.0f} Mbit/s towards the job, step = a quarter of the local cost", flush=True)
        configs = bench.sweep("rail", step_s, config, prefix=[*lab.prefix("cli"), *OWN_HOSTNAME])
    scenarios["narrow_rail"] = _scenario(
        f"tcp rail at {rate / 1e6:.0f} Mbit/s, cheap step",
        step_s,
        "0 or 0.1",
        configs,
        rail={
            "rate_bits_per_s": rate,
            "decoded_sample_bytes": SAMPLE_BYTES,
            "send_decoded_s": SAMPLE_BYTES * 8 / rate,
            "raw_sample_bytes_mean": bench.dataset_bytes / args.images,
            "send_raw_s": bench.dataset_bytes / args.images * 8 / rate,
            "local_cost_s": bench.cost,
        },
    )


def _print_change(name: str, change: dict) -> None:
    figures = change.get("figures")
    if not figures:
        print(f"  {name}: FAILED: {change.get('error')}", flush=True)
        return
    back = figures["recovery_s"]
    back_text = "never" if back is None else f"{back:.1f} s"
    print(
        f"  {name}: {figures['samples_per_s_before']:.1f} samples/s before, "
        f"{figures['samples_per_s_last_10s']:.1f} in the last 10 s (new best "
        f"{figures['new_best_samples_per_s']:.1f} at offload={figures['new_best_offload']}); back within 5% "
        f"after {back_text}; ratio {_ratio(figures['ratio_at_change'])} -> {_ratio(figures['final_ratio'])}, "
        f"{figures['ratio_changes_after']} change(s) after",
        flush=True,
    )


def _ratio(value) -> str:
    return "?" if value is None else f"{value:.2f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=480, help="JPEG photographs")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2, help="warm-up epochs of every job")
    parser.add_argument(
        "--warmup-s",
        type=float,
        default=15.0,
        help="and at least this many seconds of them (auto's first decisions take a few seconds; "
        "a job of many epochs amortises them, a benchmark of 480 images would time them)",
    )
    parser.add_argument("--epochs", type=int, default=4, help="timed epochs per configuration")
    parser.add_argument("--step", type=float, default=0.1, help="the sweep's step of fixed ratios")
    parser.add_argument(
        "--repeat", type=int, default=1, help="rounds of each sweep; a configuration's figure is its median run"
    )
    parser.add_argument("--ratios", default="", help="the sweep's fixed ratios, comma-separated (instead of --step)")
    parser.add_argument("--rate", default=DEFAULT_RATE, help="the narrow rail's rate towards the job (tc units)")
    parser.add_argument("--before-s", type=float, default=20.0, help="a mid-run change's seconds before it")
    parser.add_argument("--after-s", type=float, default=25.0, help="and after it")
    parser.add_argument("--scenarios", default="starved,spare,rail", help="which sweeps (starved, spare, rail)")
    parser.add_argument("--changes", default="step,kill", help="which mid-run changes (step, kill)")
    parser.add_argument(
        "--sampler",
        choices=("random", "builtin"),
        default="random",
        help="random: RandomSampler(generator=...), drawn when each epoch starts; builtin: wrap's seeded "
        "shuffle (seed=0), whose next epoch is planned while one is consumed",
    )
    parser.add_argument("--quick", action="store_true", help="160 images, 1 timed epoch, ratios by 0.25, short changes")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (jobs' logs, daemons' logs)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--png", default=None)
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    if args.quick:
        args.images, args.epochs, args.step, args.before_s, args.after_s = 160, 1, 0.25, 10.0, 12.0
        args.warmup_s = min(args.warmup_s, 5.0)
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    args.changes = [s for s in args.changes.split(",") if s]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()  # a kill unwinds: the daemons stop, the work directory goes
    if len(os.sched_getaffinity(0)) < 2:
        print("needs two cores: one for training, one for the servers", file=sys.stderr)
        return 2
    from preprocess import TrainStep, local_cost, write_photos

    began, load, machine = time.monotonic(), os.getloadavg(), machine_info()  # before any pinning
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="kspeed-bench-autotune-"))
    scenarios: dict = {}
    changes: dict = {}
    settings: dict = {}
    try:
        dataset_bytes = write_photos(work / "photos", args.images)
        cores = sorted(os.sched_getaffinity(0))
        with on_core({cores[0]}):
            cost = local_cost(work / "photos")
            op_seconds = TrainStep(cost).op_seconds
        bench = Bench(args, work, cost, op_seconds)
        bench.dataset_bytes = dataset_bytes
        print(
            f"local preprocessing: {cost * 1e3:.2f} ms of CPU per sample; torch.mm {op_seconds * 1e3:.3f} ms",
            flush=True,
        )
        os.sched_setaffinity(0, bench.train_core)
        steps = [s for s in args.scenarios if s in ("starved", "spare")]
        if steps or args.changes:
            try:
                loopback_part(bench, scenarios, changes, settings)
            except Exception as exc:  # the lab part still runs; the error is in the JSON
                print(f"loopback cluster: FAILED: {type(exc).__name__}: {exc}", flush=True)
                settings["loopback_error"] = f"{type(exc).__name__}: {exc}"
        if "rail" in args.scenarios:
            try:
                lab_part(bench, scenarios, settings)
            except Exception as exc:
                print(f"network lab: FAILED: {type(exc).__name__}: {exc}", flush=True)
                settings["lab_error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if args.keep:
            print(f"kept {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)

    doc = {
        "benchmark": "autotune",
        "machine": machine,
        "load_average_at_start": load,
        "wall_s": time.monotonic() - began,
        "setup": {
            "images": args.images,
            "dataset_bytes": dataset_bytes,
            "batch_size": args.batch,
            "warmup_epochs": args.warmup,
            "timed_epochs": args.epochs,
            "sweep": [float(r) for r in args.ratios.split(",")] if args.ratios else ratios(args.step),
            "rounds": args.repeat,
            "pipeline": "decode (PIL), RandomResizedCrop(224), RandomHorizontalFlip, PILToTensor",
            "training_core": sorted(bench.train_core),
            "server_core": sorted(bench.server_core),
            "local_cost_s_per_sample": cost,
            "train_step": f"torch.mm of 192x192 floats, {op_seconds * 1e3:.3f} ms each (op count fixed per job)",
            "step_s_per_sample": {"starved": cost, "spare": cost / 2, "narrow_rail": cost / 4},
            "mid_run": {"before_s": args.before_s, "after_s": args.after_s},
            "warmup": {"epochs": args.warmup, "at_least_s": args.warmup_s},
            "quick": args.quick,
            "sampler": args.sampler,
        },
        "cluster": settings,
        "scenarios": scenarios,
        "changes": changes,
    }
    doc["targets"] = targets(scenarios, changes)
    if args.json:
        write_json(args.json, doc)
    for target in doc["targets"]:
        value = target["value"]
        shown = "none" if value is None else f"{value:.3g}"
        verdict = "met" if target["met"] else "MISSED"
        print(f"{target['name']}: {shown} {target['compare']} {target['threshold']} ({verdict})")
    if args.png:
        chart(doc, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
