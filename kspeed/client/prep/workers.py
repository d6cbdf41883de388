"""Pools that turn delivered sample bytes into collated training batches, as ``DataLoader`` workers do.

A wrapped folder dataset's own loader and transforms run on the client: in worker processes
(:class:`TransformWorkers`), forked from a forkserver that has imported torch and the stages'
libraries, or spawned where the platform has none (:mod:`kspeed.client.prep.start_method`; the
client's gRPC channels and receive ring do not survive a ``fork`` of the training process), or in
the training process itself with ``num_workers=0`` (:class:`InlineWorkers`). A task is one batch:
its bytes as one buffer with sample offsets, its targets and its file names; the pool returns the
batch collated as a ``DataLoader`` worker would, so tensors come back through torch's shared-memory
reductions rather than the pipe. A loader that opens a path is given a scratch file of the
sample's bytes under the sample's own name (:class:`ScratchFiles`). The checks of the stages
(picklable, how the loader takes a sample) run in the caller, before any worker starts.

A sample comes out the same whatever the number of workers and whichever runs it: a pipeline's
stages are seeded per sample and stage (:mod:`kspeed.preprocess.rng`), and a user's own loader and
transforms run with torch's, Python's and numpy's global generators seeded from ``(seed, epoch,
sample)`` (:func:`~kspeed.preprocess.rng.user_seed`), put back after each batch (so in the training
process, ``num_workers=0``, the loop's own random streams are not touched).
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import io
import logging
import os
import pickle
import shutil
import tempfile
import threading
import time
import traceback
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, fields
from multiprocessing import util
from typing import Any

import numpy as np
import torch.multiprocessing
from torch.utils.data import default_collate

from kspeed.client.main_guard import check_main_guarded
from kspeed.client.prep.start_method import FORKSERVER, modules_of, worker_context
from kspeed.control.daemon import exit_with, process_running
from kspeed.errors import ConfigError, PreprocessError, StateError
from kspeed.preprocess import rng
from kspeed.preprocess.pipeline import STATUS, Pipeline, read_status
from kspeed.preprocess.runner import Runner

__all__ = [
    "Delivered",
    "Draw",
    "InlineWorkers",
    "SampleFailure",
    "ScratchFiles",
    "Stages",
    "StartFailure",
    "TransformWorkers",
    "check_loader",
    "check_picklable",
    "pil_file_loader",
    "preload_of",
    "resolve_loader",
    "run_batch",
    "run_samples",
    "sample_bytes",
    "sweep_shared_memory",
]

log = logging.getLogger(__name__)

#: Where torch's multiprocessing and the stages files put shared memory.
SHM_DIR = "/dev/shm"

#: Seconds a worker gets to finish its batch at close before it is terminated.
JOIN_TIMEOUT = 10.0
#: Seconds a started worker waits for the pool's others before it counts as ready on its own.
READY_TIMEOUT = 120.0
_TORCHVISION_LOADERS = ("pil_loader", "default_loader")

# Set once per worker process: the pool's barrier by _init, the stages by the first batch (_load).
_READY: Any = None
_STAGES: Stages | None = None
_SCRATCH: ScratchFiles | None = None
_RUNNER: Runner | None = None
#: Scratch directories are named ``<prefix><pid>-<random>``.
SCRATCH_PREFIX = "kspeed-loader-"
STAGES_PREFIX = "kspeed-stages-"


class SampleFailure(Exception):
    """Raised in a worker: the sample at ``position`` of the task (``None``: collation) failed.

    Carries the original error as text, since user exceptions need not be picklable.
    """

    def __init__(self, position: int | None, text: str) -> None:
        super().__init__(position, text)
        self.position = position
        self.text = text

    def __str__(self) -> str:
        return self.text


class StartFailure(Exception):
    """A worker cannot run the stages at all, whatever the batch: it could not start, or the stages
    cannot be unpickled in it. Carries the cause as text."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def pil_file_loader(file: io.BytesIO) -> Any:
    """torchvision's ``pil_loader`` for a file object: the image converted to RGB."""
    from PIL import Image

    image = Image.open(file)
    return image.convert("RGB")


def sample_bytes(file: io.BytesIO) -> np.ndarray:
    """The loader of a dataset without a pipeline: a sample's bytes as a uint8 array."""
    return np.frombuffer(file.getvalue(), dtype=np.uint8)


def resolve_loader(loader: Any) -> Callable[..., Any]:
    """The loader to call on a file object: torchvision's path-only PIL loaders become :func:`pil_file_loader`.

    Raises:
        ConfigError: ``loader`` is not callable.
    """
    if not callable(loader):
        raise ConfigError(
            f"the wrapped dataset's loader must be callable, got {loader!r}", field="loader", value=loader
        )
    if (
        getattr(loader, "__module__", "") == "torchvision.datasets.folder"
        and getattr(loader, "__name__", "") in _TORCHVISION_LOADERS
    ):
        return pil_file_loader
    return loader


def check_loader(loader: Callable[..., Any], path: str) -> str:
    """How ``loader`` takes a sample: ``"file"`` (a binary file object) or ``"path"`` (a file name).

    A file object is tried first (no file is written per sample then); a loader that fails on one
    but reads ``path`` by name is given a path. When the client cannot read ``path``, or the
    loader fails on both (a bad file), it is given file objects: iterating names that sample if it
    fails.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        log.debug("loader check skipped: cannot read %s here: %s", path, exc)
        return "file"
    try:
        loader(io.BytesIO(data))
        return "file"
    except Exception as exc:
        on_file = exc
    try:
        loader(path)
    except Exception:
        return "file"
    name = getattr(loader, "__qualname__", repr(loader))
    log.debug(
        "loader %s fails on a file object (%s: %s) but reads a path: it is given a scratch file of each "
        "sample's bytes under the sample's own file name",
        name,
        type(on_file).__name__,
        on_file,
    )
    return "path"


@dataclass(frozen=True)
class Stages:
    """What turns one sample's bytes into training input, as a ``DataLoader`` over the dataset would.

    Attributes:
        loader: binary file object (or path) -> sample (e.g. a decoded image).
        transform: applied to each loaded sample, or ``None``.
        target_transform: applied to each target, or ``None``.
        collate_fn: list of ``(sample, target)`` pairs -> batch.
        loader_takes: ``"file"``: the loader gets an ``io.BytesIO`` of the sample's bytes;
            ``"path"``: a scratch file of them named like the sample's file (:class:`ScratchFiles`).
        pipeline: instead of ``loader`` and ``transform``: the dataset's pipeline, whose stages
            before ``client_stop`` run here (from ``server_stages`` on for samples the servers
            preprocessed), seeded per sample from ``seed``.
        seed: the job's seed.
        server_stages: the stages the servers run for their share of each batch.
        cached: the stages every sample has been through when it arrives (a dataset cached
            preprocessed; its other samples arrive as stage ``cached - 1`` declares them).
        client_stop: the first stage not run on the client CPU (the GPU's).
        dataset: the dataset's name, for messages.
        skip: a sample whose preparation fails is left out of its batch (reported in
            :attr:`Delivered.skipped`); the servers' samples then start with a status word.
    """

    loader: Callable[..., Any] | None
    transform: Callable[..., Any] | None = None
    target_transform: Callable[..., Any] | None = None
    collate_fn: Callable[..., Any] = default_collate
    loader_takes: str = "file"
    pipeline: Pipeline | None = None
    seed: int = 0
    server_stages: int = 0
    cached: int = 0
    client_stop: int | None = None
    skip: bool = False
    dataset: str = ""

    def named(self) -> dict[str, Any]:
        """Each callable stage by its name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in _CALLABLES}


_CALLABLES = ("loader", "transform", "target_transform", "collate_fn")


@dataclass(frozen=True)
class Draw:
    """What a batch's pipeline stages need to know about it: the epoch, the IDs, which the servers preprocessed."""

    epoch: int
    ids: tuple[int, ...]
    remote: tuple[bool, ...]


@dataclass(frozen=True)
class Delivered:
    """A collated batch and the seconds each client-side stage took on it (by stage name), and the
    CPU and wall seconds the whole batch took (the offload decision's measure of the client's cost)."""

    value: Any
    seconds: dict[str, float]
    skipped: tuple[tuple[int, str], ...] = ()  # (position in the batch, why) of samples left out
    cpu_s: float = 0.0
    wall_s: float = 0.0


def check_picklable(stages: Stages | Mapping[str, Any]) -> None:
    """Refuse a stage that cannot reach a worker process, at wrap time rather than at the first batch.

    Raises:
        ConfigError: a stage (named) cannot be pickled.
    """
    for what, stage in (stages.named() if isinstance(stages, Stages) else stages).items():
        try:
            pickle.dumps(stage)
        except Exception as exc:
            raise ConfigError(
                f"the wrapped dataset's {what} {stage!r} cannot be pickled ({exc}); it runs in worker "
                "processes: use a module-level function or a picklable object",
                field=what,
                value=repr(stage),
            ) from exc


class ScratchFiles:
    """Files holding samples' bytes under their own file names, for loaders that open a path.

    Loaders choose decoders by a file's extension, so each sample is written as
    ``<dir>/<position>/<its file name>``: never the original file (that would read the local disk the
    servers are there to spare) and never a name without its suffix. The directory lives in
    ``/dev/shm`` when there is one, is named after this process, and is removed by :meth:`close` (or
    at exit); one left by a killed process is removed by the next one that starts.
    """

    def __init__(self) -> None:
        root = SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir()
        _remove_orphans(root, SCRATCH_PREFIX)
        self.dir = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=root)
        self._made: set[int] = set()
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.dir, True)

    def path(self, position: int, name: str, data: memoryview) -> str:
        """Write ``data`` as ``name`` in the slot of batch position ``position`` and return its path."""
        folder = os.path.join(self.dir, str(position))
        if position not in self._made:
            os.makedirs(folder, exist_ok=True)
            self._made.add(position)
        path = os.path.join(folder, os.path.basename(name) or "sample")
        with open(path, "wb") as f:
            f.write(data)
        return path

    def close(self) -> None:
        """Remove the directory."""
        self._finalizer()


def _remove_orphans(root: str, prefix: str) -> None:
    """Remove the files and directories ``<prefix><pid>-...`` in ``root`` of processes that no
    longer exist (a training process killed outright leaves them)."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not process_running(int(pid)):
            path = os.path.join(root, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)


def preload_of(stages: Stages) -> list[str]:
    """The modules a worker imports to run ``stages``: torch and this module, those of the stages'
    classes and functions (:func:`~kspeed.client.prep.start_method.modules_of`), those its
    pipeline's stages name, and PIL for torchvision's loader."""
    names = ["torch", __name__, *sorted(modules_of(stages.named().values()))]
    if stages.pipeline is not None:
        names += ["kspeed.preprocess.runner", *sorted({s.module for s in stages.pipeline.stages if s.module})]
    if stages.loader is pil_file_loader:
        names.append("PIL.Image")
    return list(dict.fromkeys(names))


def _init(modules: Sequence[str], ready: Any, owner: int) -> None:
    """A worker's start: it ends with ``owner`` (the training process, however that ends), one
    thread for torch, ``modules`` imported (a forkserver's worker has them already), and the pool's
    barrier kept for :func:`_warm`."""
    global _READY
    exit_with(owner, before=_close_scratch)
    torch.set_num_threads(1)  # as DataLoader workers: one thread each, the pool gives the parallelism
    _READY = ready
    for name in modules:
        # Only a head start: loading the stages imports what they need, and says what fails.
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def _close_scratch() -> None:
    if _SCRATCH is not None:
        _SCRATCH.close()


def _warm(timeout: float) -> int:
    """Wait until every worker of the pool has run :func:`_init` (each takes one such task); the pid."""
    with contextlib.suppress(threading.BrokenBarrierError):  # closing, or another is late: this one is ready
        _READY.wait(timeout)
    return os.getpid()


def _load(stages_file: str) -> Stages:
    """The stages, read from their file and unpickled on this worker's first batch."""
    global _STAGES, _SCRATCH
    if _STAGES is None:
        try:
            with open(stages_file, "rb") as fh:
                stages = pickle.load(fh)
        except Exception as exc:
            raise StartFailure(
                f"the loader, transforms or collate_fn cannot be unpickled in a worker process: {_describe(exc)}"
            ) from None
        if stages.loader_takes == "path":
            _SCRATCH = ScratchFiles()
            # multiprocessing runs this at the worker's exit; atexit does not run in a forked worker.
            util.Finalize(None, _SCRATCH.close, exitpriority=0)
        _STAGES = stages
    return _STAGES


def _describe(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def _runner(stages: Stages) -> Runner:
    """The resolved pipeline of ``stages`` (once per process)."""
    global _RUNNER
    if _RUNNER is None or _RUNNER.pipeline is not stages.pipeline:
        if stages.pipeline is None:
            raise StateError("no pipeline to run")
        _RUNNER = Runner(stages.pipeline, dataset=stages.dataset)
    return _RUNNER


def _prepare(stages: Stages, data: memoryview, draw: Draw, i: int, seconds: dict[str, float]) -> Any:
    """Run one sample through the pipeline's client-side stages (timing each)."""
    runner = _runner(stages)
    sample = draw.ids[i]
    start = 0
    value: Any = data
    if draw.remote[i]:
        begun = time.perf_counter()
        received = np.frombuffer(data, dtype=np.uint8)
        if stages.skip:
            failure = read_status(received)
            if failure:
                raise PreprocessError(f"on a server: {failure}", sample=sample)
            received = received[STATUS:]
        value = runner.receive(received, stages.server_stages, sample=sample)
        start = stages.server_stages
        seconds["receive"] = seconds.get("receive", 0.0) + time.perf_counter() - begun
    elif stages.cached:
        begun = time.perf_counter()
        value = runner.receive(np.frombuffer(data, dtype=np.uint8), stages.cached, sample=sample)
        start = stages.cached
        seconds["receive"] = seconds.get("receive", 0.0) + time.perf_counter() - begun
    stop = len(runner) if stages.client_stop is None else stages.client_stop
    for k in range(start, stop):
        begun = time.perf_counter()
        value = runner.run(value, seed=stages.seed, epoch=draw.epoch, sample=sample, start=k, stop=k + 1)
        if k + 1 == stages.server_stages:  # the servers' part, done here: held to its declaration too
            runner.check(value, k + 1, sample=sample)
        name = f"{k}:{stages.pipeline.stages[k].op}" if stages.pipeline is not None else str(k)
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - begun
    if isinstance(value, np.ndarray) and not value.flags.writeable:
        value = value.copy()  # torch wants writable arrays; a view of the batch's buffer is not
    return value


def run_batch(
    stages: Stages,
    scratch: ScratchFiles | None,
    buffer: bytes | bytearray,
    offsets: Sequence[int],
    targets: Sequence[Any],
    names: Sequence[str],
    draw: Draw | None = None,
) -> Delivered:
    """Load, transform and collate one batch (``offsets`` has one more entry than samples).

    With a pipeline (``stages.pipeline``), ``draw`` says the batch's epoch, IDs and which samples
    the servers preprocessed.

    Raises:
        SampleFailure: a sample (by position) or the collation failed.
    """
    view = memoryview(buffer)
    return run_samples(
        stages, scratch, [view[offsets[i] : offsets[i + 1]] for i in range(len(targets))], targets, names, draw
    )


def run_samples(
    stages: Stages,
    scratch: ScratchFiles | None,
    samples: Sequence[memoryview],
    targets: Sequence[Any],
    names: Sequence[str],
    draw: Draw | None = None,
) -> Delivered:
    """:func:`run_batch` over one buffer per sample. With every sample left out (``stages.skip``),
    the batch's value is ``None``.

    Raises:
        SampleFailure: a sample (by position) or the collation failed.
    """
    items = []
    seconds: dict[str, float] = {}
    skipped: list[tuple[int, str]] = []
    began_cpu, began_wall = time.thread_time(), time.perf_counter()
    with rng.global_generators_kept():
        for i, target in enumerate(targets):
            data = samples[i]
            try:
                if stages.pipeline is not None and draw is not None:
                    item = _prepare(stages, data, draw, i, seconds)
                else:
                    if draw is not None:  # the user's stages draw from the global generators
                        rng.seed_global_generators(rng.user_seed(stages.seed, draw.epoch, draw.ids[i]))
                    item = _user_stages(stages, scratch, data, names, i, seconds)
                if stages.target_transform is not None:
                    target = stages.target_transform(target)
            except Exception as exc:
                if not stages.skip:
                    raise SampleFailure(i, _describe(exc)) from None
                skipped.append((i, _describe(exc)))
                continue
            items.append((item, target) if target is not None else item)
    if not items and skipped:  # nothing left to collate: the caller says so
        cpu_s, wall_s = time.thread_time() - began_cpu, time.perf_counter() - began_wall
        return Delivered(None, seconds, tuple(skipped), cpu_s, wall_s)
    try:
        begun = time.perf_counter()
        value = stages.collate_fn(items)
        seconds["collate"] = time.perf_counter() - begun
        cpu_s, wall_s = time.thread_time() - began_cpu, time.perf_counter() - began_wall
        return Delivered(value, seconds, tuple(skipped), cpu_s, wall_s)
    except Exception as exc:
        raise SampleFailure(None, _describe(exc)) from None


def _user_stages(
    stages: Stages,
    scratch: ScratchFiles | None,
    data: memoryview,
    names: Sequence[str],
    i: int,
    seconds: dict[str, float],
) -> Any:
    """Sample ``i`` of a batch through the user's loader and transform (timed)."""
    if stages.loader is None:
        raise StateError("a batch without a loader or a pipeline")
    begun = time.perf_counter()
    source = io.BytesIO(data) if scratch is None else scratch.path(i, names[i], data)
    item = stages.loader(source)
    if stages.transform is not None:
        item = stages.transform(item)
    seconds["transform"] = seconds.get("transform", 0.0) + time.perf_counter() - begun
    return item


#: One batch's work: its bytes, each sample's offset, target and name, and the random draws.
BatchTask = tuple[bytes | bytearray, Sequence[int], Sequence[Any], Sequence[str], Draw | None]


def _run(stages_file: str, task: BatchTask) -> Delivered:
    """One batch in a worker process."""
    return run_batch(_load(stages_file), _SCRATCH, *task)


class _Workers(ABC):
    """What :class:`InlineWorkers` and :class:`TransformWorkers` share: batches submitted until closed."""

    workers: int

    @property
    @abstractmethod
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""

    def submit(
        self,
        buffer: bytes | bytearray,
        offsets: Sequence[int],
        targets: Sequence[Any],
        names: Sequence[str],
        draw: Draw | None = None,
    ) -> Future:
        """Run or queue one batch; the future holds the :class:`Delivered` batch or raises :class:`SampleFailure`.

        Raises:
            StateError: the workers are closed.
        """
        if self.closed:
            raise StateError("the transform workers are closed; iterate the dataset again to start new ones")
        return self._submit((buffer, offsets, targets, names, draw))

    @abstractmethod
    def _submit(self, task: BatchTask) -> Future: ...


class InlineWorkers(_Workers):
    """The stages run in the calling process, one batch at a time (``num_workers=0``, as ``DataLoader``).

    Args:
        stages: the loader, transforms and collation.
    """

    workers = 0

    def __init__(self, stages: Stages) -> None:
        self._stages = stages
        self._scratch = ScratchFiles() if stages.loader_takes == "path" else None
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    def _submit(self, task: BatchTask) -> Future:
        future: Future = Future()  # run now: the future is done when it is returned
        try:
            future.set_result(run_batch(self._stages, self._scratch, *task))
        except SampleFailure as exc:
            future.set_exception(exc)
        return future

    def pids(self) -> list[int]:
        """No worker processes."""
        return []

    def close(self) -> None:
        """Remove the scratch files, if any."""
        self._closed = True
        if self._scratch is not None:
            self._scratch.close()


class TransformWorkers(_Workers):
    """``workers`` processes running ``loader``, the transforms and ``collate_fn`` per batch.

    The processes start at once, from a background thread: forked from the forkserver (which first
    imports ``preload`` if it is not running yet) or spawned
    (:func:`~kspeed.client.prep.start_method.worker_context`), so that they get ready while the
    caller goes on, e.g. registers the dataset. :meth:`wait_ready` waits until each has run its
    initializer. The stages are pickled once, by :meth:`install`, into a file only this user may
    read (removed at :meth:`close`), whose name travels with each batch; each worker unpickles it once
    (at its first batch), so the pool can start before they are known, and a large stage is not sent
    with every batch. :meth:`close` joins the processes.

    Args:
        workers: number of processes.
        stages: the loader, transforms and collation each worker runs (``None``: :meth:`install` later).
        preload: the modules the workers import before their first batch (default: :func:`preload_of`
            of ``stages``).

    Raises:
        StateError: the pool is made from a top-level statement of the main script outside
            ``if __name__ == "__main__":``, which each worker would run again.
        ConfigError: ``stages`` cannot be pickled (named).
    """

    def __init__(self, workers: int, stages: Stages | None = None, *, preload: Sequence[str] | None = None) -> None:
        check_main_guarded("the transform workers")
        self._stages_file = _stages_file(stages) if stages is not None else None
        if preload is None:
            preload = preload_of(stages) if stages is not None else ["torch", __name__]
        modules = tuple(preload)
        context = worker_context(modules)
        self.workers = workers
        self.start_method = context.get_start_method()
        self._ready = context.Barrier(workers)
        self._executor: ProcessPoolExecutor | None = ProcessPoolExecutor(
            workers, mp_context=context, initializer=_init, initargs=(modules, self._ready, os.getpid())
        )
        self._warm: list[Future] = []
        self._start_error: BaseException | None = None
        self._ready_pids: list[int] | None = None
        self._began = time.perf_counter()
        self._starter = threading.Thread(
            target=self._start, args=(self._executor,), name="kspeed-pool-start", daemon=True
        )
        self._starter.start()

    def _start(self, executor: ProcessPoolExecutor) -> None:
        """Start each process: the pool starts one per task while none is idle, and a worker that
        has run its initializer waits in :func:`_warm` for the others (a forkserver start returns
        once the server has forked the process; a spawn, once it has run the interpreter)."""
        try:
            for _ in range(self.workers):
                self._warm.append(executor.submit(_warm, READY_TIMEOUT))
        except BaseException as exc:  # the forkserver could not start, or close() came first
            self._start_error = exc

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._executor is None

    def install(self, stages: Stages) -> None:
        """Give the workers the stages they run (once, before the first batch).

        Raises:
            StateError: they have their stages already.
            ConfigError: a stage cannot be pickled (named).
        """
        if self._stages_file is not None:
            raise StateError("the transform workers have their stages already")
        self._stages_file = _stages_file(stages)

    def wait_ready(self) -> list[int]:
        """Wait until each worker process has started and run its initializer (at once after the first
        time); the process IDs of those that did (all, unless one was over :data:`READY_TIMEOUT` late).

        Raises:
            StateError: the workers are closed.
            StartFailure: a worker could not start (why, as far as this process can tell).
        """
        if self._ready_pids is not None:
            return self._ready_pids
        if self.closed:
            raise StateError("the transform workers are closed; iterate the dataset again to start new ones")
        self._starter.join()
        if self._start_error is not None:
            why = _describe(self._start_error)
            if self.start_method == FORKSERVER and isinstance(self._start_error, (EOFError, OSError)):
                why = (
                    f"the forkserver ended before forking them ({why}): if it printed an error on stderr, "
                    "importing a module of its preload list failed in it"
                )
            raise StartFailure(f"the transform workers could not start ({self.start_method}): {why}") from (
                self._start_error
            )
        pids = set()
        for future in self._warm:
            try:
                pids.add(future.result())
            except BrokenProcessPool as exc:
                raise StartFailure(
                    "a transform worker process ended while starting: it was killed, or importing the main "
                    'script again (as each worker does, up to `if __name__ == "__main__":`) failed in it; an error '
                    "it printed is on stderr"
                ) from exc
        self._ready_pids = sorted(pids)
        log.debug(
            "%d transform workers (%s) ready %.2f s after they were started",
            self.workers,
            self.start_method,
            time.perf_counter() - self._began,
        )
        return self._ready_pids

    def _submit(self, task: BatchTask) -> Future:
        assert self._executor is not None  # (submit checked closed)
        if self._stages_file is None:
            raise StateError("the transform workers were given no stages to run")
        try:
            return self._executor.submit(_run, self._stages_file, task)
        except BrokenProcessPool as exc:  # a worker died since the last batch: this one fails as theirs do
            failed: Future = Future()
            failed.set_exception(exc)
            return failed

    def pids(self) -> list[int]:
        """Process IDs of the running workers."""
        executor = self._executor
        processes = getattr(executor, "_processes", None) or {}
        return sorted(processes)

    def close(self) -> None:
        """Cancel queued tasks and join every worker process, waiting for those still starting."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        self._starter.join()  # a process being started cannot be stopped halfway
        self._ready.abort()  # workers waiting in _warm for the others stop waiting
        processes = list((getattr(executor, "_processes", None) or {}).values())
        # The executor's own thread joins the workers; a worker stuck in a user transform must not
        # hang close(), so it is terminated after JOIN_TIMEOUT.
        stopper = threading.Thread(
            target=executor.shutdown,
            kwargs={"wait": True, "cancel_futures": True},
            name="kspeed-pool-stop",
            daemon=True,
        )
        stopper.start()
        stopper.join(JOIN_TIMEOUT)
        if stopper.is_alive():
            for process in processes:
                if process.exitcode is None:
                    log.warning(
                        "transform worker %d did not stop within %.0f s; terminating it", process.pid, JOIN_TIMEOUT
                    )
                    process.terminate()
            stopper.join()
        if self._stages_file is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._stages_file)
        sweep_shared_memory({p.pid for p in processes if p.pid is not None} | set(self._ready_pids or ()))
        log.debug("%d transform workers closed", self.workers)


def sweep_shared_memory(pids: set[int], directory: str = SHM_DIR) -> list[str]:
    """Remove the files torch's multiprocessing left in ``directory`` for processes ``pids``, which
    have exited: a worker sending a batch names each tensor's file ``torch_<its pid>_...`` and
    unlinks it once the file is open, so one killed in between left the file for good. Returns the
    paths removed."""
    removed = []
    for pid in sorted(pids):
        if process_running(pid):
            continue
        for path in glob.glob(os.path.join(directory, f"torch_{pid}_*")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
    if removed:
        log.debug("removed %d shared-memory file(s) of transform workers that died", len(removed))
    return removed


def _stages_file(stages: Stages) -> str:
    """The stages pickled into a new file that only this user can read, named after this process
    (the files of processes gone are removed first); its path.

    Raises:
        ConfigError: a stage cannot be pickled (named).
    """
    data = _pickled(stages)
    _remove_orphans(tempfile.gettempdir(), STAGES_PREFIX)
    fd, path = tempfile.mkstemp(prefix=f"{STAGES_PREFIX}{os.getpid()}-", suffix=".pickle")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    return path


def _pickled(stages: Stages) -> bytes:
    """The stages as the workers receive them.

    Raises:
        ConfigError: a stage cannot be pickled (named).
    """
    try:
        return pickle.dumps(stages, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        check_picklable(stages)  # names the stage
        raise ConfigError(
            f"the stages of dataset {stages.dataset!r} cannot be pickled for the worker processes: {exc}",
            field="stages",
        ) from exc
