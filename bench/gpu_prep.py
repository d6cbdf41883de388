"""The ImageNet pipeline on a GPU against the same pipeline on one core and on every core.

    python bench/gpu_prep.py --json bench/results/gpu_prep.json [--png bench/results/gpu_prep.png]
                             [--quick] [--device cuda|cpu] [--images 512] [--batch-size 64] [--seconds 6]

The pipeline is decode JPEG, ``RandomResizedCrop(224)``, horizontal flip, cast to ``float32``,
normalize (ImageNet mean and std), over ImageNet-like photographs (``bench/_balanced_data.py``, 400-500
px on the short side) held in memory. Every arm gives a sample the same crop box (torchvision's
``RandomResizedCrop`` draw: scale (0.08, 1), ratio (3/4, 4/3)) and the same flip (its own generator),
all drawn up front from one seeded generator. The arms:

- **gpu**: batches of ``--batch-size``: ``torchvision.io.decode_jpeg`` on the batch's list (batched
  nvJPEG), ``resized_crop`` per image, stacked, then :mod:`kspeed.preprocess.gpu`'s ``flip``, ``cast``
  and ``normalize`` on the batch, and ``torch.cuda.synchronize()`` (a training step would consume the
  batch). Its CPU is this process's, every thread included, and so is CUDA's busy-waiting for the
  GPU (nvJPEG's decode and ``synchronize`` wait by spinning);
- **cpu-1**: the same ops on CPU tensors in one child process pinned to one core, one torch thread;
- **cpu-all**: the same in one such process per usable core, each over its share of the photographs;
  samples/s is their sum over the wall time, CPU per sample their CPU summed.

Each arm runs one untimed batch, then whole passes over its photographs until ``--seconds`` have
passed. The JSON holds each arm's samples/s and CPU seconds per sample, the ratios the targets are
stated in (the GPU at least 5x one core; the client's CPU per sample under 10% of one core's), and the
mean absolute difference between the gpu and cpu-1 outputs of the first 8 samples (nvJPEG's pixels
are close to libjpeg-turbo's, not equal; recorded, not checked). With ``--device cpu`` the gpu arm
runs its ops on the CPU: that checks the script, not a GPU, and the JSON says so.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from _balanced_data import write_imagenet_like
from _common import machine_info, pyplot, stop_on_sigterm, write_json

from kspeed.preprocess.image import resized_crop_params

if TYPE_CHECKING:
    import torch

# torch and torchvision are imported where they are used: parse_args() is imported on its own to check
# a command line, and that should not cost the seconds torch takes to import.

FULL = {"images": 512, "seconds": 6.0}
QUICK = {"images": 128, "seconds": 2.0}
SEED = 0
CROP = [224, 224]
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
AGREEMENT_SAMPLES = 8
TARGET_GPU_VS_ONE_CORE = 5.0
TARGET_CLIENT_CPU_SHARE = 0.10
POLL_S = 0.5  # how often a wait on the workers checks that none has died
WORKER_TIMEOUT_S = 300.0  # a worker imports torch, warms up and runs its passes within this
CLOSE_TIMEOUT_S = 5.0  # then workers still running are terminated
PIPELINE_MODULES = ("torchvision.io", "torchvision.transforms.v2.functional", "kspeed.preprocess.gpu")
NO_GPU_NOTE = "no GPU: the gpu arm ran on the CPU; its figures are not a GPU's"

# torchvision 0.29 deprecates its image codecs in favour of TorchCodec and says so in every process.
warnings.filterwarnings("ignore", message=".*TorchCodec", category=DeprecationWarning)


@dataclass(frozen=True)
class Samples:
    """Photographs and the random parameters every arm gives them.

    Attributes:
        jpegs: the encoded photographs.
        boxes: each one's crop box, ``(top, left, height, width)``.
        flip_seeds: the seed of each one's flip generator (a fresh generator per use, so every pass
            and every arm flips the same samples).
    """

    jpegs: list[bytes]
    boxes: list[tuple[int, int, int, int]]
    flip_seeds: list[int]

    def __len__(self) -> int:
        return len(self.jpegs)

    def part(self, start: int, stop: int) -> Samples:
        """Samples ``start`` to ``stop`` (excluded)."""
        return Samples(self.jpegs[start:stop], self.boxes[start:stop], self.flip_seeds[start:stop])


@dataclass(frozen=True)
class Timing:
    """The timed passes of one process: ``start`` and ``end`` on the system-wide monotonic clock."""

    samples: int
    start: float
    end: float
    cpu_s: float
    first: np.ndarray | None  # the outputs of the first AGREEMENT_SAMPLES samples, when asked for


def draw(jpegs: list[bytes], seed: int) -> Samples:
    """Every photograph's crop box (as ``RandomResizedCrop`` draws it) and flip seed, from one generator."""
    rng = np.random.default_rng(seed)
    boxes = []
    for data in jpegs:
        with Image.open(io.BytesIO(data)) as img:  # reads the header only
            width, height = img.size
        boxes.append(resized_crop_params(height, width, rng, SCALE, RATIO))
    return Samples(jpegs, boxes, rng.integers(0, 2**63, size=len(jpegs)).tolist())


def prepare(
    encoded: list[torch.Tensor],
    boxes: Sequence[tuple[int, int, int, int]],
    flip_seeds: Sequence[int],
    device: str,
) -> torch.Tensor:
    """One batch through the pipeline on ``device``: a normalized ``float32`` NCHW batch."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg  # type: ignore[import-untyped]
    from torchvision.transforms.v2.functional import resized_crop  # type: ignore[import-untyped]

    from kspeed.preprocess import gpu

    images = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
    crops = [resized_crop(img, top, left, h, w, CROP, antialias=True) for img, (top, left, h, w) in zip(images, boxes)]
    rngs = [np.random.default_rng(seed) for seed in flip_seeds]
    batch = gpu.apply_batch("flip", torch.stack(crops), rngs, {"layout": "chw"})
    return gpu.normalize(gpu.cast(batch, dtype="float32"), mean=MEAN, std=STD, layout="chw")


def run_passes(
    samples: Samples,
    batch_size: int,
    seconds: float,
    device: str,
    *,
    keep_first: bool = False,
    ready: Callable[[], Any] | None = None,
) -> Timing:
    """One untimed batch, then whole passes over ``samples`` until ``seconds`` have passed.

    Args:
        samples: the photographs and their parameters.
        batch_size: samples per batch.
        seconds: the least time the passes take.
        device: where the pipeline runs.
        keep_first: also return the outputs of the first samples (untimed), for the agreement check.
        ready: called between the warm-up and the clock's start (the workers' common barrier).
    """
    import torch

    encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in samples.jpegs]
    batches = [
        (encoded[i : i + batch_size], samples.boxes[i : i + batch_size], samples.flip_seeds[i : i + batch_size])
        for i in range(0, len(samples), batch_size)
    ]

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize(device)

    prepare(*batches[0], device)
    sync()
    first = None
    if keep_first:
        k = AGREEMENT_SAMPLES
        first = prepare(encoded[:k], samples.boxes[:k], samples.flip_seeds[:k], device).cpu().numpy()
    if ready is not None:
        ready()
    cpu0 = time.process_time()
    start = time.perf_counter()
    done = 0
    while True:
        for batch in batches:
            prepare(*batch, device)
            sync()
        done += len(samples)
        end = time.perf_counter()
        if end - start >= seconds:
            return Timing(done, start, end, time.process_time() - cpu0, first)


def _cpu_worker(core: int, started: Any, tasks: Any, barrier: Any, results: Any) -> None:
    """A cpu arm's process: pinned to ``core``, one torch thread, then one task (or ``None``: not needed).

    A task is ``(samples, batch_size, seconds, keep_first)``; the process puts its :class:`Timing`,
    or its error as text, on ``results``.
    """
    import torch

    try:
        os.sched_setaffinity(0, {core})
        torch.set_num_threads(1)
        for name in PIPELINE_MODULES:  # now, while the parent writes the photographs
            importlib.import_module(name)
        started.release()
        task = tasks.get()
        if task is None:
            return
        samples, batch_size, seconds, keep_first = task
        timing = run_passes(
            samples,
            batch_size,
            seconds,
            "cpu",
            keep_first=keep_first,
            ready=lambda: barrier.wait(WORKER_TIMEOUT_S),
        )
    except BaseException as exc:  # the parent records it; the other workers must not wait at the barrier
        barrier.abort()
        results.put(f"{type(exc).__name__}: {exc}")
    else:
        results.put(timing)


class CpuArm:
    """One cpu arm's processes, one per core, spawned early so that their imports overlap the writing.

    :meth:`run` gives each a contiguous share of the samples. Workers warm up, meet at a barrier and
    are timed from there, so the arm's wall time runs from their common start to the last one's end.
    """

    def __init__(self, cores: list[int]) -> None:
        ctx = mp.get_context("spawn")
        self._started = ctx.Semaphore(0)
        self._barrier = ctx.Barrier(len(cores))
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in cores]
        self._procs = [
            ctx.Process(
                target=_cpu_worker, args=(core, self._started, tasks, self._barrier, self._results), daemon=True
            )
            for core, tasks in zip(cores, self._tasks)
        ]
        for proc in self._procs:
            proc.start()

    @property
    def workers(self) -> int:
        return len(self._procs)

    def wait_started(self) -> None:
        """Wait (a while at most) until every worker has imported its modules and is waiting for its task."""
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        started = 0
        while started < self.workers and time.monotonic() < deadline:
            if self._started.acquire(timeout=POLL_S):
                started += 1
            elif self._exited():
                return  # a worker that failed to start is reported by run()

    def run(self, samples: Samples, batch_size: int, seconds: float, *, keep_first: bool = False) -> list[Timing]:
        """Time every worker over its share; with ``keep_first`` the first also returns the first outputs.

        Raises:
            RuntimeError: a worker failed (its error in the message) or gave no result in time.
        """
        bounds = np.linspace(0, len(samples), self.workers + 1).round().astype(int).tolist()
        for k, tasks in enumerate(self._tasks):
            tasks.put((samples.part(bounds[k], bounds[k + 1]), batch_size, seconds, keep_first and k == 0))
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        got: list[Timing | str] = []
        while len(got) < self.workers:
            try:
                got.append(self._results.get(timeout=POLL_S))
                continue
            except queue.Empty:
                pass
            exited = self._exited()
            if exited:
                raise RuntimeError(f"a cpu worker exited with code {exited[0]} before giving a result")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cpu workers gave no result within {WORKER_TIMEOUT_S:.0f} s")
        errors = sorted((g for g in got if isinstance(g, str)), key=lambda e: e.startswith("BrokenBarrierError"))
        if errors:
            raise RuntimeError(f"a cpu worker failed: {errors[0]}")
        return [g for g in got if isinstance(g, Timing)]

    def _exited(self) -> list[int]:
        """The exit codes of the workers that ended abnormally (a worker that reports exits with 0)."""
        return [proc.exitcode for proc in self._procs if proc.exitcode not in (None, 0)]

    def close(self) -> None:
        """Release workers that never got a task, and end any still running."""
        for tasks in self._tasks:
            tasks.cancel_join_thread()  # a worker that died unread must not hold this process's exit
            tasks.put(None)
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join()


def arm_row(timings: list[Timing]) -> dict:
    """Samples/s over the arm's wall time and CPU seconds per sample summed over its processes."""
    samples = sum(t.samples for t in timings)
    seconds = max(t.end for t in timings) - min(t.start for t in timings)
    return {
        "samples_per_s": round(samples / seconds, 1),
        "cpu_s_per_sample": round(sum(t.cpu_s for t in timings) / samples, 7),
        "samples": samples,
        "seconds": round(seconds, 3),
    }


def run_arm(name: str, body: Callable[[], list[Timing]]) -> tuple[dict, np.ndarray | None]:
    """Run one arm; its row (or its error: the other arms still run) and its first outputs."""
    print(f"[{name}] running ...", file=sys.stderr, flush=True)
    try:
        timings = body()
    except Exception as exc:
        print(f"[{name}] {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return {"error": f"{type(exc).__name__}: {exc}"}, None
    row = arm_row(timings)
    print(
        f"[{name}] {row['samples_per_s']:>9,.1f} samples/s  {row['cpu_s_per_sample'] * 1e3:.3f} ms CPU/sample",
        file=sys.stderr,
        flush=True,
    )
    return row, next((t.first for t in timings if t.first is not None), None)


def ratios(results: dict) -> dict:
    """The figures the targets are stated in (``None`` where an arm failed)."""

    def ratio(a: str, b: str, key: str) -> float | None:
        if key not in results[a] or key not in results[b] or not results[b][key]:
            return None
        return round(results[a][key] / results[b][key], 4)

    return {
        "gpu_vs_one_core": ratio("gpu", "cpu-1", "samples_per_s"),
        "gpu_vs_all_cores": ratio("gpu", "cpu-all", "samples_per_s"),
        "client_cpu_share": ratio("gpu", "cpu-1", "cpu_s_per_sample"),
    }


def targets(r: dict) -> dict:
    """Whether each target is met (``None`` where its ratio is missing)."""
    speedup, share = r["gpu_vs_one_core"], r["client_cpu_share"]
    return {
        "gpu_vs_one_core_at_least_5x": None if speedup is None else speedup >= TARGET_GPU_VS_ONE_CORE,
        "client_cpu_share_under_10pct": None if share is None else share < TARGET_CLIENT_CPU_SHARE,
    }


def agreement(gpu_first: np.ndarray | None, cpu_first: np.ndarray | None) -> dict:
    """Mean (and max) absolute difference of the first samples' normalized outputs, gpu against cpu-1."""
    if gpu_first is None or cpu_first is None:
        return {"mean_abs_diff": None, "error": "an arm failed"}
    diff = np.abs(gpu_first - cpu_first)
    return {"samples": len(diff), "mean_abs_diff": float(diff.mean()), "max_abs_diff": float(diff.max())}


def device_info(device: str) -> dict:
    """The device that ran the gpu arm, and the torch build."""
    import torch
    import torchvision  # type: ignore[import-untyped]

    return {
        "name": torch.cuda.get_device_name(device) if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cuda": torch.version.cuda,
    }


def load_photographs(root: Path, count: int) -> tuple[list[bytes], list[str]]:
    """Write ``count`` ImageNet-like JPEGs under ``root`` and read them back into memory."""
    _, sources = write_imagenet_like(root, count, SEED)
    return [path.read_bytes() for path in sorted(root.glob("*/*.jpg"))], sources


def chart(doc: dict, path: str) -> None:
    """Bar chart of samples/s per arm, each bar annotated with its CPU milliseconds per sample."""
    plt = pyplot()
    if plt is None:
        return
    rows = {name: row for name, row in doc["results"].items() if "samples_per_s" in row}
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(list(rows), [row["samples_per_s"] for row in rows.values()], color="tab:blue")
    for bar, row in zip(bars, rows.values()):
        label = f"{row['cpu_s_per_sample'] * 1e3:.3f} ms CPU/sample"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax.set_ylabel("samples/s")
    ax.margins(y=0.12)
    title = f"decode + RandomResizedCrop(224) + flip + normalize; gpu arm on {doc['device']['name']}"
    ax.set_title(title if "note" not in doc else f"{title} (no GPU)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; ``images`` and ``seconds`` filled in from the preset when not given."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--json", default=None, help="output path (stdout when omitted)")
    parser.add_argument("--png", default=None, help="bar chart of samples/s per arm (needs matplotlib)")
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK['images']} images, {QUICK['seconds']:g} s per arm"
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the gpu arm runs")
    parser.add_argument("--images", type=int, default=None, help=f"photographs (default {FULL['images']})")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per batch (default 64)")
    parser.add_argument(
        "--seconds", type=float, default=None, help=f"least timed seconds per arm ({FULL['seconds']:g})"
    )
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    args.images = args.images if args.images is not None else preset["images"]
    args.seconds = args.seconds if args.seconds is not None else preset["seconds"]
    for name in ("images", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.seconds <= 0:
        parser.error(f"--seconds must be positive, got {args.seconds}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(
            f"--device cuda: no usable CUDA device (torch {torch.__version__}, {build}; "
            "torch.cuda.is_available() is False); run on a GPU machine, or pass --device cpu to check the script",
            file=sys.stderr,
        )
        return 2
    stop_on_sigterm()
    started = time.perf_counter()
    cores = sorted(os.sched_getaffinity(0))
    root = Path(tempfile.mkdtemp(prefix="kspeed-gpu-prep-"))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        one_core = stack.enter_context(contextlib.closing(CpuArm(cores[:1])))
        all_cores = stack.enter_context(contextlib.closing(CpuArm(cores[: args.images])))
        print(f"writing {args.images} photographs ...", file=sys.stderr, flush=True)
        jpegs, sources = load_photographs(root, args.images)
        samples = draw(jpegs, SEED)
        one_core.wait_started()
        all_cores.wait_started()
        run = (args.batch_size, args.seconds)
        gpu_row, gpu_first = run_arm("gpu", lambda: [run_passes(samples, *run, args.device, keep_first=True)])
        one_row, one_first = run_arm("cpu-1", lambda: one_core.run(samples, *run, keep_first=True))
        all_row, _ = run_arm("cpu-all", lambda: all_cores.run(samples, *run))
    all_row["workers"] = all_cores.workers
    results = {"gpu": gpu_row, "cpu-1": one_row, "cpu-all": all_row}
    doc: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": machine_info(),
        "device": device_info(args.device),
    }
    if args.device != "cuda":
        doc["note"] = NO_GPU_NOTE
    summary = ratios(results)
    doc |= {
        "config": {
            "device": args.device,
            "quick": args.quick,
            "images": len(samples),
            "jpeg_bytes": sum(len(j) for j in jpegs),
            "photo_sources": sources,
            "batch_size": args.batch_size,
            "seconds": args.seconds,
            "seed": SEED,
            "crop": CROP,
            "scale": SCALE,
            "ratio": RATIO,
            "mean": MEAN,
            "std": STD,
        },
        "results": results,
        "agreement": agreement(gpu_first, one_first),
        "ratios": summary,
        "targets": targets(summary),
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    write_json(args.json, doc)
    if args.png:
        chart(doc, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
