"""One configuration of ``bench/balanced.py``, run in a fresh process: ``python bench/_balanced_run.py SPEC OUT``.

``SPEC`` is a JSON file naming the configuration (``calibrate``, ``dataloader`` with its worker count,
or ``kspeed``, opted in to ``region_decode`` or not), the workload, its folder and the cores; the
figures go to ``OUT`` as JSON. The process pins itself (and so the DataLoader's or KSpeed client's
worker processes) to the training core; for ``kspeed`` it starts a fresh local cluster (one
manager, one server) pinned to the server core first, and stops it after.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _balanced_data import Workload
from preprocess import TrainStep, cpu_seconds, local_cost, transform

SERVER_ARGS = ["--memory", "1GiB", "--region-size", "16MiB", "--production-window", "128MiB"]
SHAPE = (3, 224, 224)


def descendants(pids: list[int]) -> list[int]:
    """``pids`` and every process below them (the server's preprocessing workers)."""
    parents: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            ppid = int(Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(parents.get(pid, ()))
    return found


def core_times(cores: list[int]) -> dict[int, tuple[int, int, int]]:
    """Per core, its busy, stolen and total clock ticks so far (``/proc/stat``)."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in fields[:8])
            out[int(name[3:])] = (
                user + nice + system + irq + softirq,
                steal,
                user + nice + system + idle + iowait + irq + softirq + steal,
            )
    return out


def core_use(before: dict, after: dict, core: int, ours_s: float, elapsed: float) -> dict:
    """A core's busy and stolen shares of the span, what our processes used of it and what the
    machine's other work did (busy less ours)."""
    busy, steal, total = (a - b for a, b in zip(after[core], before[core], strict=True))
    share = (busy / total) if total else float("nan")
    ours = ours_s / elapsed
    return {
        "busy": share,
        "steal": steal / total if total else float("nan"),
        "ours": ours,
        "others": max(share - ours, 0.0),
    }


def sampler_of(folder, workload: Workload):
    """The workload's sampler over ``folder`` (the same kind for every configuration)."""
    import torch
    from torch.utils.data import RandomSampler

    if workload.seeded_sampler:
        return RandomSampler(folder, generator=torch.Generator().manual_seed(0))
    return RandomSampler(folder)


def run_timed(batches, workload: Workload, step: TrainStep, pids, cores: dict, set_epoch=None, probe=None) -> dict:
    """``warmup_epochs`` untimed epochs, ``timed_epochs`` timed ones, one untimed trailing epoch (as
    ``bench/preprocess.py``'s ``run_epochs``), a training step per batch; ``probe()`` is read at both
    ends of the timed span. The loop's wait is the time spent in ``next()``; the cores' use over the
    timed span shows how much of them the machine's other work took."""
    epoch = 0
    waited = 0.0

    def one_epoch() -> int:
        nonlocal epoch, waited
        if set_epoch is not None:
            set_epoch(epoch)
        epoch += 1
        samples = 0
        batch_iter = iter(batches())
        while True:
            began = time.perf_counter()
            try:
                images, _ = next(batch_iter)
            except StopIteration:
                return samples
            waited += time.perf_counter() - began
            if tuple(images.shape[1:]) != SHAPE:
                raise ValueError(f"batch of shape {tuple(images.shape)}, expected (N, {SHAPE})")
            step(len(images))
            samples += len(images)

    for _ in range(workload.warmup_epochs):
        one_epoch()
    before = probe() if probe is not None else {}
    waited = 0.0
    watched = [*cores["training"], *cores["server"]]
    cpu0, ticks0, began = cpu_seconds(pids()), core_times(watched), time.perf_counter()
    samples = sum(one_epoch() for _ in range(workload.timed_epochs))
    elapsed = time.perf_counter() - began
    used, ticks = cpu_seconds(pids()) - cpu0, core_times(watched)
    loop_wait = waited
    after = probe() if probe is not None else {}
    one_epoch()
    return {
        "samples": samples,
        "seconds": elapsed,
        "samples_per_s": samples / elapsed,
        "client_cpu_s_per_sample": max(used - step.per_sample * samples, 0.0) / samples,
        "loop_wait_s": loop_wait,
        "loop_wait_share": loop_wait / elapsed,
        "training_core": core_use(ticks0, ticks, *cores["training"], used, elapsed),
        "server_core": core_use(ticks0, ticks, *cores["server"], 0.0, elapsed),
        "probe_before": before,
        "probe_after": after,
    }


def calibrate(root: Path) -> dict:
    """CPU seconds to load and transform one sample here, before anything else runs."""
    return {"local_cost_s_per_sample": local_cost(root)}


def dataloader(root: Path, workload: Workload, workers: int, step: TrainStep, cores: dict) -> dict:
    import torch
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder

    folder = ImageFolder(str(root), transform=transform())
    loader = DataLoader(
        folder,
        batch_size=workload.batch_size,
        sampler=sampler_of(folder, workload),
        num_workers=workers,
        persistent_workers=workers > 0,
    )
    pids: list[int] = []

    def loader_pids() -> list[int]:
        if workers and not pids:
            pids.extend(p.pid for p in torch.multiprocessing.active_children() if p.pid is not None)
        return [os.getpid(), *pids]

    return run_timed(lambda: loader, workload, step, loader_pids, cores)


def kspeed(
    root: Path, workload: Workload, step: TrainStep, cores: dict, log_dir: Path, region_decode: bool = False
) -> dict:
    """A user's ``client.wrap(folder, batch_size, sampler)`` served by a fresh local cluster on the server core
    (with ``region_decode``, the opt-in ``wrap(..., region_decode=True)``)."""
    import torch
    from torchvision.datasets import ImageFolder

    from kspeed import KSpeedClient
    from kspeed.cli.cluster import LocalCluster, wait_for

    state = Path(tempfile.mkdtemp(prefix="kspeed-bench-balanced-"))
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    pools = tempfile.mkdtemp(prefix="kspeed-bench-balanced-pool-", dir=shm)
    server_args = ["--backend-allow", str(root), *SERVER_ARGS, "--keep-pool-on-exit", "false"]
    # The daemons inherit the affinity of the process that spawns them: start them on the server core.
    os.sched_setaffinity(0, cores["server"])
    cluster = LocalCluster(str(state), servers=1, pool_root=pools, server_args=server_args)
    try:
        cluster.start()
        os.sched_setaffinity(0, cores["training"])
        torch.set_num_threads(1)
        daemons = [cluster.manager.process.pid, *(s.process.pid for s in cluster.servers)]
        with KSpeedClient(config=cluster.client_config()) as client:
            wait_for(lambda: len(client.manager.servers()) == 1, 30, "the server to register")
            folder = ImageFolder(str(root), transform=transform())
            began = time.perf_counter()
            opt_in = {"region_decode": True} if region_decode else {}
            ds = client.wrap(folder, batch_size=workload.batch_size, sampler=sampler_of(folder, workload), **opt_in)
            wrap_s = time.perf_counter() - began
            ratios: list[float] = []

            def set_epoch(epoch: int) -> None:
                ratios.append(ds.stats()["offload"].get("ratio"))
                ds.set_epoch(epoch)

            def probe() -> dict:
                stats = ds.stats()
                return {"wait_total_s": stats.get("wait_total_s"), "server_cpu_s": cpu_seconds(descendants(daemons))}

            try:
                figures = run_timed(
                    lambda: ds, workload, step, lambda: [os.getpid(), *ds.worker_pids()], cores, set_epoch, probe
                )
                stats = ds.stats()
            finally:
                ds.close()
        before, after = figures.pop("probe_before"), figures.pop("probe_after")
        timed_batches = -(-figures["samples"] // workload.batch_size)
        data_wait = after["wait_total_s"] - before["wait_total_s"]
        server_cpu = after["server_cpu_s"] - before["server_cpu_s"]
        server_core = figures["server_core"]
        server_core["ours"] = server_cpu / figures["seconds"]
        server_core["others"] = max(server_core["busy"] - server_core["ours"], 0.0)
        figures.update(
            wrap_s=wrap_s,
            offload=stats["offload"],
            offload_ratio_per_epoch=ratios,
            data_wait_s=data_wait,
            data_wait_ms_per_batch=data_wait * 1e3 / timed_batches,
            data_wait_p50_ms=stats.get("wait_p50_ms"),
            data_wait_p99_ms=stats.get("wait_p99_ms"),
            server_cpu_s_per_sample=server_cpu / figures["samples"],
            client_workers=stats.get("workers"),
            rail=stats.get("rail"),
            client_stage_seconds=stats.get("client_stage_seconds"),
            server_stage_seconds=stats.get("server_stage_seconds"),
        )
        return figures
    finally:
        cluster.stop()
        log_dir.mkdir(parents=True, exist_ok=True)
        for log in (state / "logs").glob("*.log"):
            shutil.copy(log, log_dir / log.name)
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(pools, ignore_errors=True)


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    workload = Workload(**spec["workload"])
    root = Path(spec["root"])
    cores = {k: set(v) for k, v in spec["cores"].items()}
    os.sched_setaffinity(0, cores["training"])
    load = os.getloadavg()
    import torch

    torch.set_num_threads(1)
    if spec["mode"] == "calibrate":
        figures = calibrate(root)
    else:
        step = TrainStep(spec["step_s_per_sample"])
        if spec["mode"] == "dataloader":
            figures = dataloader(root, workload, spec["workers"], step, cores)
        else:
            figures = kspeed(root, workload, step, cores, Path(spec["log_dir"]), spec.get("region_decode", False))
        figures["train_step_op_ms"] = step.op_seconds * 1e3
    figures["load_average_at_start"] = list(load)
    Path(sys.argv[2]).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
