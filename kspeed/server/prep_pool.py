"""Preprocessing worker processes: a server's CPUs running the server stages of pipelines.

Producers (:mod:`kspeed.server.production`) hand a :class:`PrepTask` to a free worker and wait for
its answer: for each sample, the stored bytes (from its home region, mapped by the worker, or read
from the backend by the producer and sent along) go through the pipeline's leading stages and the
result is written straight into the sample's production-window slot, which the worker maps too. A
dataset cached preprocessed (:mod:`kspeed.server.cached_source`) has its deterministic leading
stages run once at preload, the results sent back over the pipe; its stored bytes are then those
stages' declared output, and per-epoch tasks start after them.
Workers are spawned (never forked: the server's gRPC threads and mappings must not be inherited),
run one task at a time single-threaded (torchvision's transforms seed torch's global generator per
sample), and resolve each pipeline once against the operator's module allow-list. They are the only
processes of a server that import a pipeline's modules (:meth:`PrepPool.check`): an import holds
its interpreter for seconds (torchvision's), which in the server's own process would leave health
probes and heartbeats unanswered. The first pipeline a server is asked to check starts them and
has each resolve it in the background, so the seconds torchvision takes to import pass while the
dataset registers and preloads, not before its first batch. A worker that dies is replaced and its
task done again once by the new one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kspeed.control.daemon import die_with_parent
from kspeed.control.logs import LogSettings
from kspeed.errors import ConfigError, KSpeedError, StateError
from kspeed.preprocess.pipeline import STATUS, Pipeline, write_status
from kspeed.preprocess.runner import Runner
from kspeed.proto import kspeed_pb2

__all__ = ["PrepPool", "PrepTask"]

log = logging.getLogger(__name__)

JOIN_TIMEOUT = 5.0
MAX_STAGE_NAMES = 64  # stages of one dataset with their own time figure (a bounded metric label set)
TASK_TIMEOUT = 300.0  # a task that takes longer is a hung user function: its worker is replaced


@dataclasses.dataclass(frozen=True)
class PrepTask:
    """Samples to run through a pipeline's first ``stages`` stages into window slots.

    Attributes:
        dataset: the dataset's name (for messages).
        pipeline: the pipeline (a serialized ``kspeed.v1.Pipeline``).
        stages: run the stages before this one.
        seed: the job's seed.
        epoch: the epoch (random stages draw from ``(seed, epoch, sample, stage)``).
        samples: the sample IDs.
        inputs: per sample, its stored bytes, or ``(region file, offset, length)`` of its home.
        outputs: per sample, ``(window region file, offset, capacity)``; ``None``: each result
            comes back as the bytes of the declared output.
        skip: each output starts with a status word; a failed sample's slot gets its failure
            record (the reason is still returned).
        start: the first stage to run; the inputs are stage ``start - 1``'s declared output
            (0: the backend's bytes).
    """

    dataset: str
    pipeline: bytes
    stages: int
    seed: int
    epoch: int
    samples: tuple[int, ...]
    inputs: tuple[bytes | tuple[str, int, int], ...]
    outputs: tuple[tuple[str, int, int], ...] | None
    skip: bool = False
    start: int = 0


@dataclasses.dataclass(frozen=True)
class _Resolve:
    """Ask a worker to resolve a pipeline's first ``stages`` stages (importing what they need); it
    answers ``None``, or the :class:`~kspeed.errors.KSpeedError` that resolving raised."""

    dataset: str
    pipeline: bytes
    stages: int


class _Maps:
    """Region files mapped by a worker, remapped when a path names a new file."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[int, np.ndarray]] = {}

    def get(self, path: str, writable: bool) -> np.ndarray:
        from kspeed.server.pool import map_region

        inode = os.stat(path).st_ino
        entry = self._maps.get(path)
        if entry is None or entry[0] != inode:
            array = np.frombuffer(map_region(path, writable=writable), dtype=np.uint8)
            entry = self._maps[path] = (inode, array)
        return entry[1]


def _work(conn: Connection, allow: tuple[str, ...], logs: LogSettings, parent: int = 0) -> None:
    """Entry point of a worker process: run tasks until the pipe closes, or die with the server."""
    die_with_parent(parent, signal.SIGKILL)
    logs.apply("prep", helper=True)
    with contextlib.suppress(ImportError):
        import torch

        torch.set_num_threads(1)
    runners: dict[tuple[bytes, int], Runner | KSpeedError] = {}
    inputs, outputs = _Maps(), _Maps()
    while True:
        try:
            task: PrepTask | _Resolve = conn.recv()
        except (EOFError, OSError):
            return
        runner = _runner(runners, task.dataset, task.pipeline, task.stages, allow)
        if isinstance(task, _Resolve):
            conn.send(runner if isinstance(runner, KSpeedError) else None)
            continue
        results: list[int | str | bytes] = []
        seconds: dict[str, float] = {}
        places = task.outputs if task.outputs is not None else [None] * len(task.samples)
        for sample, source, place in zip(task.samples, task.inputs, places, strict=True):
            try:
                out = _output(runner, task, place, outputs)
            except OSError as exc:
                results.append(f"dataset {task.dataset!r} sample {sample}: cannot map its window slot: {exc}")
                continue
            if isinstance(runner, KSpeedError):
                result: int | str = str(runner)
            else:
                result = _run_one(runner, task, sample, source, inputs, out[STATUS:] if task.skip else out, seconds)
            if task.skip:  # the slot says how it went; a failure travels to the client as its record
                write_status(out, result if isinstance(result, str) else "")
                if not isinstance(result, str):
                    result += STATUS
            results.append(out[:result].tobytes() if place is None and isinstance(result, int) else result)
        conn.send((results, seconds))


def _runner(
    runners: dict[tuple[bytes, int], Runner | KSpeedError],
    dataset: str,
    pipeline: bytes,
    stages: int,
    allow: tuple[str, ...],
) -> Runner | KSpeedError:
    """A worker's runner of a pipeline's first ``stages`` stages, resolved on first use (or why it
    cannot be), kept for the next tasks."""
    key = (pipeline, stages)
    runner = runners.get(key)
    if runner is None:
        try:
            message = kspeed_pb2.Pipeline.FromString(pipeline)
            runner = Runner(Pipeline.from_proto(message, stages), allow=allow, dataset=dataset, stages=stages)
        except KSpeedError as exc:
            runner = exc
        if len(runners) > 16:
            runners.clear()
        runners[key] = runner
    return runner


def _output(
    runner: Runner | KSpeedError, task: PrepTask, place: tuple[str, int, int] | None, maps: _Maps
) -> np.ndarray:
    """Where a sample's result goes: its window slot, or a buffer sent back (``place`` None)."""
    if place is not None:
        path, offset, capacity = place
        return maps.get(path, True)[offset : offset + capacity]
    size = runner.pipeline.output(task.stages).nbytes if isinstance(runner, Runner) else 0
    return np.empty(size + (STATUS if task.skip else 0), dtype=np.uint8)


def _run_one(
    runner: Runner,
    task: PrepTask,
    sample: int,
    source: bytes | tuple[str, int, int],
    inputs: _Maps,
    out: np.ndarray,
    seconds: dict[str, float],
) -> int | str:
    """Run one sample's server stages into ``out``; the bytes written, or why it failed."""
    try:
        if isinstance(source, bytes):
            data: Any = source if not task.start else np.frombuffer(source, dtype=np.uint8)
        else:
            home, at, length = source
            data = inputs.get(home, False)[at : at + length]
        if task.start:
            data = runner.receive(data, task.start, sample=sample)
        for k in range(task.start, task.stages):
            begun = time.perf_counter()
            data = runner.run(data, seed=task.seed, epoch=task.epoch, sample=sample, start=k, stop=k + 1)
            name = runner.stage_name(k)
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - begun
        return runner.write(data, out, task.stages, sample=sample)
    except KSpeedError as exc:
        return str(exc)
    except OSError as exc:
        return f"dataset {task.dataset!r} sample {sample}: cannot map its bytes: {exc}"


class _Worker:
    def __init__(self, ctx: Any, allow: tuple[str, ...], logs: LogSettings, number: int) -> None:
        ours, theirs = ctx.Pipe()
        self.conn = ours
        self.process = ctx.Process(
            target=_work, args=(theirs, allow, logs, os.getpid()), name=f"kspeed-prep-{number}", daemon=True
        )
        self.process.start()
        theirs.close()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.close()
        self.process.join(JOIN_TIMEOUT)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(JOIN_TIMEOUT)


class PrepPool:
    """``workers`` preprocessing processes; :meth:`run` hands a task to a free one.

    Args:
        workers: number of processes (started at once).
        allow: modules user functions (and ``torchvision.transforms``) may come from.
        logs: how the workers log.
    """

    def __init__(self, workers: int, allow: tuple[str, ...], logs: LogSettings) -> None:
        self.allow = tuple(allow)
        self._logs = logs
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._closed = False
        self._count = 0
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self.workers = max(int(workers), 1)
        self.restarts = 0
        self.busy_seconds = 0.0
        self.samples = 0
        #: per dataset, seconds per "<index>:<op>" stage, summed over workers (until :meth:`forget`)
        self.stage_seconds: dict[str, dict[str, float]] = {}
        self._started = False
        self._warming = False  # warm() was called
        self._warm_failed = False  # warming found the pipeline cannot be resolved (and said so)
        self._warm: set[_Worker] = set()  # workers resolving a pipeline for warm()
        self._helpers: ThreadPoolExecutor | None = None  # threads of run_all, made on its first call

    def _start(self) -> None:
        """Spawn the workers on the first task or :meth:`warm` (a server without pipelines never starts them)."""
        with self._lock:
            if self._started or self._closed:
                return
            self._started = True
            for _ in range(self.workers):
                self._idle.put(self._spawn())

    def warm(self, dataset: str, pipeline: bytes, stages: int) -> None:
        """Start the workers and have each resolve ``pipeline`` now, in the background, so that the
        first tasks do not wait for the imports it needs (torchvision takes seconds); once per pool.
        A worker still warming when the pool closes is killed: it holds no task."""
        with self._lock:
            if self._warming or self._closed:
                return
            self._warming = True
        self._start()
        task = _Resolve(dataset, pipeline, stages)
        for _ in range(self.workers):
            threading.Thread(target=self._warm_one, args=(task,), name="kspeed-prep-warm", daemon=True).start()

    def _warm_one(self, task: _Resolve) -> None:
        try:
            worker = self._take()
        except StateError:
            return
        with self._lock:
            warming = not self._closed
            if warming:
                self._warm.add(worker)
        if warming:
            try:
                worker.conn.send(task)
                hung = not worker.conn.poll(TASK_TIMEOUT)
                failure = None if hung else worker.conn.recv()
            except (EOFError, OSError):
                hung, failure = False, None  # a worker lost here is replaced by its next task
            if failure is not None:  # every worker finds the same: said once
                with self._lock:
                    said, self._warm_failed = self._warm_failed, True
                if not said:
                    log.error("dataset %s: its pipeline cannot run on this server's workers: %s", task.dataset, failure)
            with self._lock:
                self._warm.discard(worker)
            if hung:  # its late answer would be taken for the next task's
                log.warning(
                    "preprocessing worker %d: no answer within %gs; replacing it", worker.process.pid, TASK_TIMEOUT
                )
                with contextlib.suppress(OSError):
                    worker.process.kill()
                worker.stop()
                with self._lock:
                    if not self._closed:  # (closing, the stopped one goes back to be stopped again)
                        self.restarts += 1
                        worker = self._spawn()
        self._idle.put(worker)

    def _spawn(self) -> _Worker:
        self._count += 1
        return _Worker(self._ctx, self.allow, self._logs, self._count)

    def _replace(self, worker: _Worker) -> None:
        """Stop a worker that was lost (or hung) and put a new one in the pool.

        Raises:
            StateError: the pool is closed.
        """
        worker.stop()
        with self._lock:
            self.restarts += 1
            if self._closed:
                raise StateError("the preprocessing pool is closed")
            replacement = self._spawn()
        self._idle.put(replacement)

    def check(self, dataset: str, pipeline: bytes, stages: int) -> None:
        """Resolve ``pipeline``'s first ``stages`` stages on a worker, importing their modules there
        (never in this process), and wait for the outcome. A worker that dies doing so is replaced
        and the new one asked once more.

        Raises:
            AccessDeniedError: a stage's module is not on the allow-list.
            ConfigError: a stage cannot be resolved (a module that does not import, bad parameters),
                or resolving it killed two workers.
            StateError: the pool is closed.
        """
        self._start()
        lost = ""
        for _ in range(2):
            worker = self._take()
            try:
                worker.conn.send(_Resolve(dataset, pipeline, stages))
                if not worker.conn.poll(TASK_TIMEOUT):
                    raise TimeoutError(f"no answer within {TASK_TIMEOUT:g}s")
                failure = worker.conn.recv()
            except (EOFError, OSError, TimeoutError) as exc:
                lost = f"{exc}, exit code {worker.process.exitcode}"
                log.warning(
                    "dataset %s: preprocessing worker %d lost resolving the pipeline (%s); replacing it",
                    dataset,
                    worker.process.pid,
                    lost,
                )
                self._replace(worker)
                continue
            self._idle.put(worker)
            if failure is not None:
                raise failure
            return
        raise ConfigError(
            f"dataset {dataset!r}: resolving its pipeline's server stages killed two preprocessing workers "
            f"({lost}); check the stages' modules on this server",
            field="pipeline",
        )

    def run(self, task: PrepTask) -> list[int | str | bytes]:
        """Run ``task`` on a free worker; per sample, the bytes written (or, without outputs, the
        bytes themselves) or why it failed.

        A worker that dies during the task is replaced and the task run once more on the new one.

        Raises:
            StateError: the pool is closed.
        """
        self._start()
        results: list[int | str | bytes] = []
        for _ in range(2):  # a worker that dies is replaced and the task run once more
            worker = self._take()
            started = time.monotonic()
            try:
                worker.conn.send(task)
                if not worker.conn.poll(TASK_TIMEOUT):
                    raise TimeoutError(f"no answer within {TASK_TIMEOUT:g}s")
                results, seconds = worker.conn.recv()
            except (EOFError, OSError, TimeoutError) as exc:
                code = worker.process.exitcode
                log.warning(
                    "dataset %s: preprocessing worker %d lost during %d sample(s) (%s, exit code %s); replacing it",
                    task.dataset,
                    worker.process.pid,
                    len(task.samples),
                    exc,
                    code,
                )
                self._replace(worker)
                why = f"the preprocessing worker died twice on these samples (exit code {code})"
                results = [f"dataset {task.dataset!r} sample {s}: {why}" for s in task.samples]
                continue
            with self._lock:
                self.busy_seconds += time.monotonic() - started
                self.samples += len(task.samples)
                spent = self.stage_seconds.setdefault(task.dataset, {})
                for name, value in seconds.items():
                    if name in spent or len(spent) < MAX_STAGE_NAMES:
                        spent[name] = spent.get(name, 0.0) + value
            self._idle.put(worker)
            break
        return results

    def run_all(self, tasks: list[PrepTask]) -> list[list[int | str | bytes]]:
        """Run several tasks at once on free workers (as :meth:`run` each); their results in order.

        Raises:
            StateError: the pool is closed.
        """
        if len(tasks) <= 1:
            return [self.run(task) for task in tasks]
        with self._lock:
            if self._closed:
                raise StateError("the preprocessing pool is closed")
            if self._helpers is None:
                self._helpers = ThreadPoolExecutor(self.workers, thread_name_prefix="kspeed-prep-call")
            helpers = self._helpers
        return list(helpers.map(self.run, tasks))

    def _take(self) -> _Worker:
        while True:
            if self._closed:
                raise StateError("the preprocessing pool is closed")
            try:
                return self._idle.get(timeout=0.5)
            except queue.Empty:
                continue

    def forget(self, dataset: str) -> None:
        """Drop a dataset's stage times (it is no longer hosted here)."""
        with self._lock:
            self.stage_seconds.pop(dataset, None)

    def seconds_of(self, dataset: str) -> dict[str, float]:
        """A copy of one dataset's stage times."""
        with self._lock:
            return dict(self.stage_seconds.get(dataset, {}))

    def all_seconds(self) -> dict[str, dict[str, float]]:
        """A copy of every dataset's stage times."""
        with self._lock:
            return {dataset: dict(spent) for dataset, spent in self.stage_seconds.items()}

    def pids(self) -> list[int]:
        """Process IDs of the idle workers (all of them when nothing runs)."""
        return sorted(w.process.pid for w in list(self._idle.queue) if w.process.pid is not None)

    def close(self) -> None:
        """Stop every worker (waiting for those running a task a moment, then killing them); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            started = self._started
            helpers, self._helpers = self._helpers, None
            warming = list(self._warm)
        for worker in warming:  # back in the idle queue at once, to be stopped below
            with contextlib.suppress(OSError):
                worker.process.kill()
        if helpers is not None:
            helpers.shutdown(wait=False, cancel_futures=True)
        if not started:
            return
        deadline = time.monotonic() + JOIN_TIMEOUT
        stopped = 0
        while stopped < self.workers and time.monotonic() < deadline:
            try:
                self._idle.get(timeout=0.1).stop()
                stopped += 1
            except queue.Empty:
                continue
        for process in mp.active_children():
            if process.name.startswith("kspeed-prep-"):
                process.kill()
                process.join(JOIN_TIMEOUT)
