"""The balanced, CPU-starved node: KSpeed's default split against the DataLoader, on two cores.

The training process (and any DataLoader or KSpeed client worker) is pinned to core 0, every KSpeed
daemon (and the server's preprocessing workers) to core 1. The pipeline is the ImageNet-style
``ImageFolder(root, transform=Compose([RandomResizedCrop(224), RandomHorizontalFlip(),
PILToTensor()]))``, and the training step costs, per sample, as much CPU as loading and transforming
that sample locally (``bench/preprocess.py``'s ``TrainStep``, calibrated per workload with its
``local_cost``): a balanced node, where moving all preprocessing to the idle core could at best
double the best DataLoader, less what receiving and collating the samples costs the training core.

Three workloads (``bench/_balanced_data.py``): ``project`` (``bench/preprocess.py``'s 480 crops, batch
32), ``crops600`` (600 crops, batch 32, ``RandomSampler(folder)`` with no generator, one warm-up then
two timed epochs), ``imagenet2048`` (2,048 photographs of ImageNet-like size, batch 64). Each is
run as ``DataLoader(folder, batch_size, sampler, num_workers=k)`` for k = 0, 1, 2 (persistent
workers) and as a user's ``client.wrap(folder, batch_size=..., sampler=...)`` with every other
argument at its default (``offload="auto"``), each configuration in a fresh process (and KSpeed on a
fresh cluster). Per configuration: steady-state samples/s, the training process's CPU per sample
beyond the step (with its workers), each core's use over the timed span (``others``: what the
machine's other work took of it, from ``/proc/stat`` less our processes), and for KSpeed the split
it chose and why, the data wait and the server core's CPU per sample. Ceiling per workload:
``1 / (1 / (2 x best DataLoader) + r)``, where ``r`` is KSpeed's measured client CPU per sample
beyond the step. Target: KSpeed >= 1.7x the best DataLoader configuration on each workload (printed
MISSED when missed, never asserted).

::

    python bench/balanced.py --json bench/results/balanced.json --png bench/results/balanced.png
    python bench/balanced.py --quick                       # small sets, one timed epoch: does it run
    python bench/balanced.py --workload crops600           # one workload (repeatable)
    python bench/balanced.py --region-decode               # also KSpeed opted in to region_decode=True

The photographs are written once under ``/var/tmp/kspeed-balanced`` and reused; the logs of each
run (each configuration's output, the daemons' logs) go to ``/var/tmp/kspeed-balanced/logs/<time>``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _balanced_data import CACHE, WORKLOADS, Workload, ensure_data, quick
from _balanced_run import SERVER_ARGS
from _common import machine_info, pyplot, stop_on_sigterm, write_json

TARGET = 1.7
WORKERS = (0, 1, 2)
RUNNER = Path(__file__).resolve().parent / "_balanced_run.py"
CONFIG_TIMEOUT = 1800  # seconds one configuration may take before it is counted as failed
PIPELINE = "ImageFolder: decode (PIL), RandomResizedCrop(224), RandomHorizontalFlip, PILToTensor"


def run_config(spec: dict, log: Path, timeout: float) -> dict:
    """Run one configuration in a fresh process; its figures, or ``{"error": ...}``."""
    with tempfile.TemporaryDirectory(prefix="kspeed-bench-balanced-") as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        began = time.perf_counter()
        with open(log, "w") as out:
            try:
                done = subprocess.run(
                    [sys.executable, str(RUNNER), str(spec_path), str(out_path)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=timeout,
                )
                failed = f"exit status {done.returncode}" if done.returncode else ""
            except subprocess.TimeoutExpired:
                failed = f"timed out after {timeout:.0f} s"
        if failed or not out_path.exists():
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            return {"error": f"{failed or 'no figures'}; log {log}: " + " | ".join(tail)}
        figures = json.loads(out_path.read_text())
        figures["process_wall_s"] = time.perf_counter() - began
        return figures


def run_workload(workload: Workload, cores: dict, log_dir: Path, timeout: float, region_decode: bool = False) -> dict:
    """Every configuration of one workload, and its ceiling; with ``region_decode``, also KSpeed
    opted in to ``wrap(..., region_decode=True)`` (``kspeed_region``, beside the target, not in it)."""
    root, record = ensure_data(workload)
    base = {"workload": asdict(workload), "root": str(root), "cores": cores, "log_dir": str(log_dir / workload.name)}
    calibration = run_config({**base, "mode": "calibrate"}, log_dir / f"{workload.name}-calibrate.log", timeout)
    if "error" in calibration:
        return {"error": calibration["error"], "data": record}
    cost = calibration["local_cost_s_per_sample"]
    print(f"{workload.name}: local preprocessing {cost * 1e3:.2f} ms of CPU per sample; the step costs the same")
    results: dict[str, dict] = {}
    configs = [(f"dataloader_w{k}", {"mode": "dataloader", "workers": k}) for k in WORKERS]
    configs.append(("kspeed", {"mode": "kspeed"}))
    if region_decode:
        configs.append(("kspeed_region", {"mode": "kspeed", "region_decode": True}))
    for label, extra in configs:
        spec = {**base, **extra, "step_s_per_sample": cost}
        figures = run_config(spec, log_dir / f"{workload.name}-{label}.log", timeout)
        results[label] = figures
        if "error" in figures:
            print(f"  {label}: FAILED: {figures['error']}")
            continue
        client_ms = figures["client_cpu_s_per_sample"] * 1e3
        line = f"  {label}: {figures['samples_per_s']:.1f} samples/s, client {client_ms:.2f} ms/sample beyond the step"
        others = figures["training_core"]["others"], figures["server_core"]["others"]
        line += f"; other work took {others[0]:.0%} of core 0, {others[1]:.0%} of core 1"
        if label.startswith("kspeed"):
            offload = figures["offload"]
            line += f", offload {offload.get('ratio')} ({offload.get('reason') or offload.get('last_decision')})"
        print(line)
    return {
        "data": record,
        "batch_size": workload.batch_size,
        "sampler": "RandomSampler(folder, generator=torch.Generator().manual_seed(0))"
        if workload.seeded_sampler
        else "RandomSampler(folder)",
        "warmup_epochs": workload.warmup_epochs,
        "timed_epochs": workload.timed_epochs,
        "local_cost_s_per_sample": cost,
        "train_step_s_per_sample": cost,
        "results": results,
        **summary(results),
    }


def summary(results: dict) -> dict:
    """The best DataLoader, KSpeed against it, and the ceiling from KSpeed's client cost."""
    loaders = {k: v["samples_per_s"] for k, v in results.items() if k.startswith("dataloader") and "error" not in v}
    kspeed = results.get("kspeed", {})
    if not loaders:
        return {"best_dataloader": None, "kspeed_vs_best": math.nan, "ceiling_samples_per_s": math.nan}
    best = max(loaders, key=loaders.get)
    out = {"best_dataloader": best, "best_dataloader_samples_per_s": loaders[best]}
    region = results.get("kspeed_region", {})
    if region and "error" not in region:
        out["kspeed_region_vs_best"] = region["samples_per_s"] / loaders[best]
    if "error" in kspeed or not kspeed:
        return {**out, "kspeed_vs_best": math.nan, "ceiling_samples_per_s": math.nan}
    receive = kspeed["client_cpu_s_per_sample"]
    ceiling = 1.0 / (1.0 / (2.0 * loaders[best]) + receive)
    return {
        **out,
        "kspeed_vs_best": kspeed["samples_per_s"] / loaders[best],
        "ceiling_samples_per_s": ceiling,
        "ceiling_vs_best": ceiling / loaders[best],
        "ceiling_basis": f"2x {best} less KSpeed's client CPU per sample beyond the step "
        f"({receive * 1e3:.3f} ms, at offload ratio {kspeed['offload'].get('ratio')})",
        "kspeed_vs_ceiling": kspeed["samples_per_s"] / ceiling,
        "server_core_bound_samples_per_s": 1.0 / kspeed["server_cpu_s_per_sample"]
        if kspeed.get("server_cpu_s_per_sample")
        else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="where to write the figures (stdout when left out)")
    parser.add_argument("--png", default=None, help="where to draw the chart (needs matplotlib)")
    parser.add_argument("--quick", action="store_true", help="small sets and one timed epoch: checks that it runs")
    parser.add_argument("--workload", action="append", choices=list(WORKLOADS), help="run only this workload")
    parser.add_argument("--timeout", type=float, default=CONFIG_TIMEOUT, help="seconds per configuration")
    parser.add_argument(
        "--region-decode",
        action="store_true",
        help="also run KSpeed opted in to wrap(..., region_decode=True) (kspeed_region; not in the target)",
    )
    args = parser.parse_args()
    stop_on_sigterm()  # a kill unwinds: the daemons stop, the work directory goes

    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        print("needs two cores: one for training, one for the servers", file=sys.stderr)
        return 2
    cores = {"training": [usable[0]], "server": [usable[1]]}
    load = os.getloadavg()
    started, began = time.strftime("%Y-%m-%dT%H:%M:%S%z"), time.perf_counter()
    log_dir = CACHE / "logs" / time.strftime("%Y%m%d-%H%M%S")
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; logs in {log_dir}")
    workloads = [WORKLOADS[name] for name in (args.workload or WORKLOADS)]
    if args.quick:
        workloads = [quick(w) for w in workloads]

    figures = {w.name: run_workload(w, cores, log_dir, args.timeout, args.region_decode) for w in workloads}
    targets = []
    for name, doc in figures.items():
        value = doc.get("kspeed_vs_best", math.nan)
        best = doc.get("best_dataloader")
        targets.append(
            {
                "name": f"{name}: KSpeed >= {TARGET}x the best DataLoader ({best})",
                "value": value,
                "threshold": TARGET,
                "met": bool(value >= TARGET),
            }
        )
    doc = {
        "benchmark": "balanced",
        "machine": machine_info(),
        "started": started,
        "load_average_at_start": list(load),
        "load_average_at_end": list(os.getloadavg()),
        "wall_s": time.perf_counter() - began,
        "quick": args.quick,
        "setup": {
            "pipeline": PIPELINE,
            "training_core": cores["training"],
            "server_core": cores["server"],
            "cluster": "one manager, one server (fresh per KSpeed configuration), shm pools, auth off",
            "server_args": SERVER_ARGS,
            "kspeed_call": "client.wrap(folder, batch_size=B, sampler=S)",
            "dataloader_call": "DataLoader(folder, batch_size=B, sampler=S, num_workers=k, persistent_workers=k>0)",
            "ceiling": "1 / (1 / (2 x best DataLoader samples/s) + KSpeed's client CPU s/sample beyond the step)",
            "data_cache": str(CACHE),
            "log_dir": str(log_dir),
        },
        "workloads": figures,
        "targets": targets,
    }
    write_json(args.json, doc)
    for target in targets:
        print(f"{target['name']}: {target['value']:.3g} ({'met' if target['met'] else 'MISSED'})")
    print(f"wall time {doc['wall_s']:.0f} s")
    if args.png:
        chart(doc, args.png)
    return 0


def chart(doc: dict, path: str) -> None:
    """Grouped bars per workload: DataLoader with 0/1/2 workers and KSpeed, with each ceiling."""
    plt = pyplot()
    if plt is None:
        return
    labels = [*(f"dataloader_w{k}" for k in WORKERS), "kspeed"]
    names = {
        "kspeed": "KSpeed (auto)",
        "kspeed_region": "KSpeed, region_decode=True",
        **{f"dataloader_w{k}": f"DataLoader w{k}" for k in WORKERS},
    }
    colours = ["lightgrey", "darkgrey", "dimgrey", "tab:blue", "tab:green"]
    if any("kspeed_region" in doc["workloads"][w].get("results", {}) for w in doc["workloads"]):
        labels.append("kspeed_region")
    workloads = list(doc["workloads"])
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, label in enumerate(labels):
        values = [doc["workloads"][w].get("results", {}).get(label, {}).get("samples_per_s", 0.0) for w in workloads]
        xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(workloads))]
        ax.bar(xs, values, width, label=names[label], color=colours[i])
    for j, w in enumerate(workloads):
        ceiling = doc["workloads"][w].get("ceiling_samples_per_s", math.nan)
        best = doc["workloads"][w].get("best_dataloader_samples_per_s", math.nan)
        if math.isfinite(ceiling):
            ax.hlines(ceiling, j - 0.45, j + 0.45, colors="black", linestyles=":", label="ceiling" if j == 0 else None)
        if math.isfinite(best):
            ax.hlines(
                best * TARGET,
                j - 0.45,
                j + 0.45,
                colors="red",
                linestyles="--",
                label=f"target ({TARGET}x best DataLoader)" if j == 0 else None,
            )
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("samples/s")
    ax.set_title("Balanced CPU-starved node: training on core 0, KSpeed daemons on core 1")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=4)  # below: no bar hidden
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
