"""CPU a server spends per offloaded sample, against torchvision's ``ImageFolder`` on the same photographs.

The pipeline of ``bench/preprocess.py`` (decode, ``RandomResizedCrop(224)``, ``RandomHorizontalFlip``,
``PILToTensor``) as ``client.wrap`` offloads it, over the same kind of JPEG photographs, measured
in CPU seconds (thread CPU in this process, ``/proc`` for the others), never wall time: the
machine is shared, and a neighbour changes the wall clock far more than the work's CPU.

- **imagefolder**: ``ImageFolder.__getitem__`` in this process (open, PIL decode, the transforms);
- **runner**: KSpeed's :class:`~kspeed.preprocess.runner.Runner` in this process on the files'
  bytes, writing each result into an output buffer as a server worker does;
- **worker**: the server's preprocessing worker path end to end: a
  :class:`~kspeed.server.prep.workers.PrepWorkers` of one sandboxed worker given tasks of
  ``PREP_TASK_SAMPLES`` samples (inputs copied into its scratch, results copied out into slots),
  the worker process's CPU and the calling thread's;
- **cluster**: a real server producing for a client (``client.wrap(..., offload=1.0)``), the
  server pinned to one core and the client to the other; the CPU of the server's main process,
  its feeder and its preprocessing workers per sample delivered; then, loader-bound, the samples/s
  of two epochs back to back (the server's core the bound) beside ``DataLoader(num_workers=0)``'s
  on the client's core.

``--region-decode`` has the server run ``wrap(..., region_decode=True)`` (the decode and the crop
as one stage decoding only the crop's region), ``--workload imagenet2048`` takes the photographs of
``bench/balanced.py``'s workload, and ``--dali-python PY`` also times DALI's CPU pipeline on the
server's core (``bench/_dali_rate.py``, run by a Python that has ``nvidia-dali``).

The in-process figures are interleaved (``--rounds`` rounds of imagefolder, runner, worker, each
over every photograph) and reported as the median and the minimum over rounds; the cluster's
over ``--epochs`` epochs after a warm-up one, per sample the server preprocessed meanwhile (it
produces ahead of the client), with ImageFolder measured again between epochs (on the client's
core, the server's being busy), so that a ratio compares figures taken moments apart.

    python bench/server_prep_cost.py --json bench/results/server_prep_cost.json
    python bench/server_prep_cost.py --workload imagenet2048 --region-decode --dali-python /opt/dali/bin/python
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _balanced_data import WORKLOADS, ensure_data
from _common import machine_info, stop_on_sigterm, write_json
from preprocess import transform, write_photos

CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    """User plus system CPU seconds of a process so far (its exited threads included)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def thread_cpu(pid: int) -> float:
    """CPU seconds of a process's live threads, to the nanosecond (``/proc/<pid>/task/*/schedstat``)."""
    total = 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            total += int(Path(path).read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def children(pid: int) -> list[int]:
    """Every descendant of a process."""
    found: list[int] = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            kids = [int(k) for k in Path(path).read_text().split()]
        except OSError:
            continue
        for kid in kids:
            found += [kid, *children(kid)]
    return found


def role(pid: int) -> str:
    """What a server's process is, from its command line."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "gone"
    if "kspeed.server.prep.worker" in cmdline:
        return "workers"
    if "spawn_main" in cmdline:
        return "feeder"
    if "kspeed.server" in cmdline:
        return "server"
    return "other"


class Photos:
    """The photographs: their folder, their bytes, and the offloaded pipeline's server stages."""

    def __init__(self, root: Path, region_decode: bool = False) -> None:
        from torchvision.datasets import ImageFolder

        from kspeed.client.prep.offload import folder_pipeline
        from kspeed.client.prep.workers import pil_file_loader

        self.folder = ImageFolder(str(root), transform=transform())
        self.data = [Path(path).read_bytes() for path, _ in self.folder.samples]
        self.region_decode = region_decode
        pipeline, why = folder_pipeline(pil_file_loader, transform(), region_decode=region_decode)
        if pipeline is None:
            raise SystemExit(f"the pipeline is not offloaded: {why}")
        self.pipeline = pipeline
        self.stages = pipeline.server_stages
        self.message = pipeline.to_proto().SerializeToString()
        self.nbytes = pipeline.output(self.stages).nbytes

    def __len__(self) -> int:
        return len(self.data)


def imagefolder(photos: Photos, epoch: int) -> float:
    """CPU seconds per sample of ``ImageFolder.__getitem__`` over every photograph."""
    import torch

    torch.manual_seed(epoch)
    began = time.thread_time()
    for i in range(len(photos)):
        photos.folder[i]
    return (time.thread_time() - began) / len(photos)


def runner(photos: Photos, epoch: int, run=None) -> float:
    """CPU seconds per sample of the pipeline's server stages in this process, written as a worker writes them."""
    from kspeed.preprocess.runner import Runner

    run = run or Runner(photos.pipeline, stages=photos.stages)
    out = np.zeros(photos.nbytes, np.uint8)
    began = time.thread_time()
    for i, data in enumerate(photos.data):
        run.produce(data, out, seed=0, epoch=epoch, sample=i, stop=photos.stages)
    return (time.thread_time() - began) / len(photos)


class Worker:
    """One sandboxed preprocessing worker, given tasks as a server's producers give them."""

    def __init__(self, photos: Photos, task_samples: int) -> None:
        from kspeed.control.logs import LogSettings
        from kspeed.server.prep.workers import PrepWorkers

        self.photos = photos
        self.task_samples = task_samples
        self.pool = PrepWorkers(1, ("torchvision.transforms",), LogSettings())
        self.pool.check("photos", photos.message, photos.stages)
        self.pid = self.pool.all_pids()[0]
        # Inputs as a server holds them at home (views of pool memory), results into window slots.
        sizes = [len(d) for d in photos.data]
        self.home = np.frombuffer(b"".join(photos.data), dtype=np.uint8)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        self.inputs = [self.home[starts[k] : starts[k + 1]] for k in range(len(sizes))]
        self.window = np.zeros(photos.nbytes * task_samples, np.uint8)

    def __call__(self, epoch: int) -> tuple[float, float]:
        """CPU seconds per sample of the worker process and of the server's calling thread."""
        from kspeed.server.prep.workers import PrepTask

        photos, n = self.photos, self.task_samples
        slots = tuple(self.window[k * photos.nbytes : (k + 1) * photos.nbytes] for k in range(n))
        worker0, caller0 = thread_cpu(self.pid), time.thread_time()
        for lo in range(0, len(photos), n):
            ids = tuple(range(lo, min(lo + n, len(photos))))
            task = PrepTask(
                "photos",
                photos.message,
                photos.stages,
                0,
                epoch,
                ids,
                tuple(self.inputs[i] for i in ids),
                slots[: len(ids)],
            )
            results = self.pool.run(task)
            if not all(isinstance(r, int) for r in results):
                raise SystemExit(f"a sample failed: {results}")
        caller = time.thread_time() - caller0
        return (thread_cpu(self.pid) - worker0) / len(photos), caller / len(photos)

    def close(self) -> None:
        self.pool.close()


def cluster(photos: Photos, root: Path, work: Path, epochs: int, batch: int) -> dict:
    """A real server producing every sample of ``epochs`` epochs for a client: CPU per sample by process role."""
    import torch

    from kspeed import KSpeedClient
    from kspeed.cli.cluster import LocalCluster, wait_for
    from kspeed.config import ClientConfig, load_config

    cores = sorted(os.sched_getaffinity(0))
    client_core, server_core = {cores[0]}, {cores[-1]}
    # The daemons inherit the affinity of the process that spawns them.
    os.sched_setaffinity(0, server_core)
    local = LocalCluster(
        str(work / "cluster"),
        servers=1,
        server_args=[
            "--backend-allow",
            str(root),
            "--memory",
            "512MiB",
            "--region-size",
            "16MiB",
            "--production-window",
            "128MiB",
        ],
    )
    local.start()
    os.sched_setaffinity(0, client_core)
    torch.set_num_threads(1)
    try:
        config = load_config(ClientConfig, environ={}, overrides={"manager": local.address, "security.auth": "none"})
        client = KSpeedClient(config=config)
        wait_for(lambda: len(client.manager.servers()) == 1, 30, "the server to register")
        server = int(local.servers[0].ready["pid"])
        wrapped = client.wrap(
            photos.folder,
            batch_size=batch,
            seed=0,
            offload=1.0,
            num_workers=0,
            quiet=True,
            region_decode=photos.region_decode,
        )
        wrapped.set_epoch(0)
        for _ in wrapped:  # warm-up: the preload, the workers' imports
            pass
        http = local.servers[0].ready["http"]
        local_cost: list[float] = []
        samples, seconds = 0, 0.0
        # CPU over the whole span, per sample the server preprocessed in it (it produces ahead of
        # the client, also while ImageFolder is measured between epochs).
        pids = [server, *children(server)]
        before = {pid: process_cpu(pid) for pid in pids}
        produced = preprocessed(http)
        for epoch in range(1, epochs + 1):
            began = time.perf_counter()
            wrapped.set_epoch(epoch)
            for images, _ in wrapped:
                assert images.shape[1:] == (3, 224, 224)
                samples += len(images)
            seconds += time.perf_counter() - began
            # ImageFolder moments later, on the client's core: the server's is busy producing ahead.
            local_cost.append(imagefolder(photos, epoch))
        spent: dict[str, float] = {}
        for pid in pids:
            spent[role(pid)] = spent.get(role(pid), 0.0) + process_cpu(pid) - before[pid]
        produced = preprocessed(http) - produced
        # Loader-bound: epochs back to back, the client only receiving and collating, so that the
        # server's one core is the bound (the window full of the next epoch's samples is drained
        # first: its first seconds are not counted).
        wrapped.set_epoch(epochs + 1)
        for _ in wrapped:
            pass
        bound, began = 0, time.perf_counter()
        for epoch in range(epochs + 2, epochs + 4):
            wrapped.set_epoch(epoch)
            for images, _ in wrapped:
                bound += len(images)
        loader_bound = bound / (time.perf_counter() - began)
        wrapped.close()
        client.close()
    finally:
        local.stop()
    # The same, loader-bound, from one client core: DataLoader(num_workers=0) over ImageFolder.
    from torch.utils.data import DataLoader

    loader = DataLoader(photos.folder, batch_size=batch, shuffle=True, num_workers=0)
    began, count = time.perf_counter(), 0
    for images, _ in loader:
        count += len(images)
    dataloader = count / (time.perf_counter() - began)
    per_sample = {k: v / produced for k, v in sorted(spent.items()) if k != "other"}
    total = sum(per_sample.values())
    folder = statistics.median(local_cost)
    return {
        "samples": samples,
        "preprocessed": produced,
        "samples_per_s_wall": samples / seconds,
        "loader_bound_samples_per_s": loader_bound,
        "dataloader_one_core_samples_per_s": dataloader,
        "cpu_s_per_sample": per_sample,
        "total_cpu_s_per_sample": total,
        "imagefolder_cpu_s_per_sample": folder,
        "imagefolder_over_server": folder / total,
    }


def preprocessed(http: str) -> int:
    """The samples a server has preprocessed so far (its metric)."""
    from urllib.request import urlopen

    text = urlopen(f"http://{http}/metrics").read().decode()
    match = re.search(r"^kspeed_server_preprocessed_samples_total (\S+)$", text, flags=re.M)
    if match is None:
        raise SystemExit("the server exports no kspeed_server_preprocessed_samples_total")
    return int(float(match.group(1)))


def dali_rate(python: str, root: Path, core: int, rounds: int, batch: int) -> dict:
    """DALI's CPU pipeline over the photographs on ``core`` (``bench/_dali_rate.py`` run by ``python``)."""
    script = Path(__file__).resolve().parent / "_dali_rate.py"
    argv = [python, str(script), str(root), "--core", str(core), "--epochs", str(rounds), "--batch", str(batch)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"DALI's pipeline failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "rounds": values}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=600, help="JPEG photographs")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved in-process rounds")
    parser.add_argument("--epochs", type=int, default=4, help="timed cluster epochs (after a warm-up)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--no-cluster", action="store_true", help="in-process figures only")
    parser.add_argument(
        "--workload",
        choices=list(WORKLOADS),
        default=None,
        help="the photographs of a bench/balanced.py workload (kept under /var/tmp) instead of --images crops",
    )
    parser.add_argument(
        "--region-decode",
        action="store_true",
        help="the server runs wrap(..., region_decode=True): the decode and the crop as one stage",
    )
    parser.add_argument(
        "--dali-python",
        default=None,
        help="a Python with nvidia-dali: also time DALI's CPU pipeline on the server's core (bench/_dali_rate.py)",
    )
    parser.add_argument("--label", default="", help="a note stored with the results (e.g. the commit)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    stop_on_sigterm()  # a kill unwinds: the daemons stop, the work directory goes

    import torch

    from kspeed.server.production.core import PREP_TASK_SAMPLES

    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    work = Path(tempfile.mkdtemp(prefix="kspeed-bench-prepcost-"))
    try:
        if args.workload:
            root, record = ensure_data(WORKLOADS[args.workload])
            dataset_bytes, args.images = record["bytes"], record["images"]
        else:
            root = work / "photos"
            dataset_bytes = write_photos(root, args.images)
        photos = Photos(root, region_decode=args.region_decode)
        os.sched_setaffinity(0, {cores[-1]})  # every in-process figure on the core the server gets
        worker = Worker(photos, PREP_TASK_SAMPLES)
        from kspeed.preprocess.runner import Runner

        run = Runner(photos.pipeline, stages=photos.stages)
        imagefolder(photos, 0), runner(photos, 0, run), worker(0)  # warm-up
        figures: dict[str, list[float]] = {"imagefolder": [], "runner": [], "worker": [], "worker_caller": []}
        for epoch in range(1, args.rounds + 1):
            figures["imagefolder"].append(imagefolder(photos, epoch))
            figures["runner"].append(runner(photos, epoch, run))
            in_worker, caller = worker(epoch)
            figures["worker"].append(in_worker)
            figures["worker_caller"].append(caller)
            print(
                f"round {epoch}: ms of CPU per sample: imagefolder {figures['imagefolder'][-1] * 1e3:.3f}, "
                f"runner {figures['runner'][-1] * 1e3:.3f}, worker {in_worker * 1e3:.3f} + caller {caller * 1e3:.3f}"
            )
        worker.close()
        os.sched_setaffinity(0, set(cores))
        ratios = [f / (w + c) for f, w, c in zip(figures["imagefolder"], figures["worker"], figures["worker_caller"])]
        results: dict = {k: summary(v) for k, v in figures.items()}
        results["imagefolder_over_worker"] = summary(ratios)
        results["imagefolder_over_runner"] = summary(
            [f / r for f, r in zip(figures["imagefolder"], figures["runner"], strict=True)]
        )
        if args.dali_python:
            results["dali"] = dali_rate(args.dali_python, root, cores[-1], args.rounds, args.batch)
            print(
                f"DALI CPU pipeline on one core: {results['dali']['cpu_s_per_sample'] * 1e3:.3f} ms of CPU per sample, "
                f"{results['dali']['samples_per_s']:.0f} samples/s"
            )
        if not args.no_cluster and len(cores) >= 2:
            results["cluster"] = cluster(photos, root, work, args.epochs, args.batch)
            c = results["cluster"]
            print(
                f"cluster: {c['total_cpu_s_per_sample'] * 1e3:.3f} ms of server CPU per sample "
                f"({', '.join(f'{k} {v * 1e3:.3f}' for k, v in c['cpu_s_per_sample'].items())}); "
                f"ImageFolder {c['imagefolder_cpu_s_per_sample'] * 1e3:.3f} ms: "
                f"{c['imagefolder_over_server']:.3f} of a client core's samples per server core; loader-bound "
                f"{c['loader_bound_samples_per_s']:.0f} samples/s from the server's core, "
                f"{c['dataloader_one_core_samples_per_s']:.0f} from DataLoader(num_workers=0) on the client's"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {
        "benchmark": "server_prep_cost",
        "label": args.label,
        "machine": machine_info(),
        "setup": {
            "images": args.images,
            "dataset_bytes": dataset_bytes,
            "pipeline": "decode (PIL), RandomResizedCrop(224), RandomHorizontalFlip, PILToTensor",
            "workload": args.workload or f"{args.images} crops",
            "region_decode": args.region_decode,
            "server_stages": [stage.op for stage in photos.pipeline.stages[: photos.stages]],
            "task_samples": PREP_TASK_SAMPLES,
            "rounds": args.rounds,
            "cluster_epochs": args.epochs,
            "batch_size": args.batch,
            "unit": "CPU seconds per sample",
        },
        "results": results,
    }
    write_json(args.json, doc)
    for name in ("imagefolder", "runner", "worker", "worker_caller"):
        print(f"{name}: median {results[name]['median'] * 1e3:.3f} ms, min {results[name]['min'] * 1e3:.3f} ms")
    print(f"ImageFolder / (worker + caller): median {results['imagefolder_over_worker']['median']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
