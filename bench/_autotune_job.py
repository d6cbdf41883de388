"""One training job of the auto-offload benchmark, run in a fresh process by ``bench/autotune.py``.

::

    python bench/_autotune_job.py --job '{"manager": "127.0.0.1:7070", "root": "...", ...}' --out result.json

It pins itself (and so the worker processes it starts) to its core, wraps the photographs as a user
would (``client.wrap(folder, batch_size, sampler=RandomSampler(...), offload=X)``, or with the
built-in seeded shuffle instead of the sampler when asked; with
``offload="auto"`` the argument is left out), and runs a training loop whose step is a fixed number
of ``torch.mm`` per sample (the op count calibrated once by the parent, so every configuration runs
the same step). Two modes:

- **epochs**: ``warmup`` epochs (and at least ``warmup_s`` seconds of them), then ``epochs``
  timed epochs; samples/s and the client's CPU
  seconds per sample beyond the step (this process and its children: transform workers, the tcp
  receiver), the split at the end of each epoch and ``ds.stats()["offload"]``.
- **timed** (a mid-run change): ``warmup`` epochs, then epochs until ``before_s + after_s``
  seconds have passed, with every batch's time, size and ``ds.stats()["offload"]["ratio"]``; at
  ``before_s`` the step changes to ``change_step_s`` when given (the parent kills a server at that
  time otherwise).

It prints ``warm <monotonic time> <dataset name>`` when the warm-up is over (``time.monotonic`` is
the system's ``CLOCK_MONOTONIC``, so the parent's times compare). The result is written as JSON to
``--out``; on failure the error is written there instead, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

__all__ = ["descendants", "main", "tree_cpu_seconds"]

CLK_TCK = os.sysconf("SC_CLK_TCK")
#: The logger of offload="auto": each adopted change is one INFO record.
TUNER_LOG = "kspeed.client.tuning.auto"


class Changes(logging.Handler):
    """Keeps the tuner's records of adopted changes, with their time (``time.monotonic``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if ": offload " in message:
            self.records.append((time.monotonic(), message[:400]))


def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def descendants(root: int) -> list[int]:
    """``root`` and every process below it, now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def tree_cpu_seconds(root: int) -> dict[int, float]:
    """User plus system CPU seconds of ``root`` and its descendants, per process."""
    out = {}
    for pid in descendants(root):
        fields = _stat_fields(pid)
        if fields is not None:
            out[pid] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def _cpu_between(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds used between two readings (a process that started meanwhile counts whole)."""
    return sum(after[pid] - before.get(pid, 0.0) for pid in after)


def run(job: dict) -> dict:
    """Run the job described by ``job`` (see ``bench/autotune.py``) and return its figures."""
    import torch
    from preprocess import TrainStep, transform
    from torch.utils.data import RandomSampler
    from torchvision.datasets import ImageFolder

    from kspeed import KSpeedClient
    from kspeed.config import ClientConfig, load_config

    torch.set_num_threads(1)
    changes = Changes()
    tuner_log = logging.getLogger(TUNER_LOG)
    tuner_log.addHandler(changes)
    tuner_log.setLevel(logging.INFO)
    step = TrainStep(0.0)
    step.op_seconds = job["op_seconds"]  # the parent's calibration: the same op count in every job
    step.per_sample = job["step_s"]
    config = load_config(ClientConfig, environ={}, overrides={"security.auth": "none", **job["config"]})
    client = KSpeedClient(config=config)
    figures: dict = {"pid": os.getpid()}
    try:
        folder = ImageFolder(job["root"], transform=transform())
        # auto: what a user passes (the model, here its step's name), under which the manager keeps
        # the decision for the next run of the same job; a scenario with another step is another model
        options = {"model": job["model"]} if job["offload"] == "auto" else {"offload": job["offload"]}
        if job.get("sampler", "random") == "random":
            options["sampler"] = RandomSampler(folder, generator=torch.Generator().manual_seed(0))
        else:  # the built-in seeded shuffle, whose next epoch is planned ahead
            options["seed"] = 0
        began = time.perf_counter()
        ds = client.wrap(folder, batch_size=job["batch"], **options)
        figures["wrap_s"] = time.perf_counter() - began
        try:
            figures.update(_loop(ds, step, job))
            stats = ds.stats()
            figures["stats_offload"] = stats.pop("offload")
            figures["stats"] = stats
            figures["workers"] = len(ds.worker_pids())
            figures["rail"] = ds.kspeed_dataset.rail
            figures["changes_logged"] = changes.records
        finally:
            ds.close()
    finally:
        client.close()
    return figures


def _stepped(step, images) -> float:
    """Run the step on a batch; its CPU seconds (this thread's)."""
    began = time.thread_time()
    step(len(images))
    return time.thread_time() - began


def _timed(batches, waits: list[float], each: list[float] | None = None):
    """``batches``, adding the seconds each ``next()`` took to ``waits[0]`` (and each to ``each``)."""
    it = iter(batches)
    while True:
        began = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return
        waited = time.perf_counter() - began
        waits[0] += waited
        if each is not None:
            each.append(waited)
        yield batch


def _loop(ds, step, job: dict) -> dict:
    epoch, ratios = 0, []
    warm_until = time.monotonic() + job.get("warmup_s", 0.0)
    while epoch < job["warmup"] or time.monotonic() < warm_until:
        ds.set_epoch(epoch)
        for images, _labels in ds:
            step(len(images))
        ratios.append(ds.stats()["offload"]["ratio"])
        epoch += 1
    warm = time.monotonic()
    print(f"warm {warm:.6f} {ds.name}", flush=True)
    cpu0, step_cpu, samples, waits = tree_cpu_seconds(os.getpid()), 0.0, 0, [0.0]
    began = time.perf_counter()
    per_batch: list[list[float]] = []  # each timed epoch's waits, batch by batch
    if job["mode"] == "epochs":
        for _ in range(job["epochs"]):
            ds.set_epoch(epoch)
            per_batch.append([])
            for images, _labels in _timed(ds, waits, per_batch[-1]):
                assert images.shape[1:] == (3, 224, 224), images.shape
                step_cpu += _stepped(step, images)
                samples += len(images)
            ratios.append(ds.stats()["offload"]["ratio"])
            epoch += 1
        series = None
    else:
        series, poll_cpu = [], 0.0
        change_at, end_at = warm + job["before_s"], warm + job["before_s"] + job["after_s"]
        changed = False
        while time.monotonic() < end_at:
            ds.set_epoch(epoch)
            for images, _labels in _timed(ds, waits):
                now = time.monotonic()
                if not changed and now >= change_at and job.get("change_step_s") is not None:
                    step.per_sample, changed = job["change_step_s"], True
                step_cpu += _stepped(step, images)
                samples += len(images)
                polled = time.thread_time()
                ratio = ds.stats()["offload"]["ratio"]
                poll_cpu += time.thread_time() - polled
                series.append((time.monotonic(), len(images), ratio))
                if time.monotonic() >= end_at:
                    break
            epoch += 1
    elapsed = time.perf_counter() - began
    used = _cpu_between(cpu0, tree_cpu_seconds(os.getpid()))
    out = {
        "warm_at": warm,
        "samples": samples,
        "seconds": elapsed,
        "samples_per_s": samples / elapsed,
        "client_cpu_s": used,
        "step_cpu_s": step_cpu,
        "client_cpu_s_per_sample_beyond_step": max(used - step_cpu, 0.0) / samples,
        "client_core_busy": used / elapsed,
        "loop_wait_s": waits[0],
        "batch_waits_ms": [[round(w * 1e3, 2) for w in epoch_waits] for epoch_waits in per_batch],
        "ratio_per_epoch": ratios,
        "epochs_run": epoch,
    }
    if series is not None:
        out["series"] = series
        out["stats_poll_cpu_s"] = poll_cpu
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", required=True, help="the job, as JSON")
    parser.add_argument("--out", required=True, help="where the result's JSON goes")
    args = parser.parse_args()
    job = json.loads(args.job)
    os.sched_setaffinity(0, set(job["cores"]))  # before anything starts a thread or a process
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    try:
        result = {"ok": True, **run(job)}
        status = 0
    except BaseException as exc:  # recorded for the parent, which goes on with the next configuration
        traceback.print_exc()
        result, status = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, 1
    Path(args.out).write_text(json.dumps(result, default=str), encoding="utf-8")
    return status


if __name__ == "__main__":
    sys.exit(main())
