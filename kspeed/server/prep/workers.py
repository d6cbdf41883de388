"""Preprocessing worker processes: a server's CPUs running the server stages of pipelines.

Producers (:mod:`kspeed.server.production.core`) hand a :class:`PrepTask` to a free worker and wait for
its answer: for each sample, the stored bytes (from its home region, or read from the backend by
the producer) go through the pipeline's leading stages and the result is copied by the server into
the sample's production-window slot. A dataset cached preprocessed
(:mod:`kspeed.server.hosting.cached_source`) has its deterministic leading stages run once at preload, the
results returned as bytes; its stored bytes are then those stages' declared output, and per-epoch
tasks start after them.

Workers run operator-allowed user code, so they are sandboxed (:mod:`kspeed.server.prep.sandbox`): each
is a fresh interpreter with a clean environment that confines itself before it imports anything of
a pipeline, and that maps nothing of the pool; the server copies inputs into its scratch segment
and results out of it (:mod:`kspeed.server.prep.link`). The first worker's report of its
confinement is logged. Workers run one task at a time single-threaded (torchvision's transforms
seed torch's global generator per sample), and resolve each pipeline once against the operator's
module allow-list. They are the only processes of a server that import a pipeline's modules
(:meth:`PrepWorkers.check`): an import holds its interpreter for seconds (torchvision's), which in the
server's own process would leave health probes and heartbeats unanswered. The first pipeline a
server is asked to check starts them and has each resolve it in the background, so the seconds
torchvision takes to import pass while the dataset registers and preloads, not before its first
batch. A worker that dies (or sends what a worker never sends) is replaced and its task done again
once by the new one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from kspeed.config import ServerConfig, preprocess_environment
from kspeed.control.logs import LogSettings
from kspeed.errors import ConfigError, StateError
from kspeed.server.prep.link import PrepTask, WorkerLink, WorkerLost, sweep_temporary
from kspeed.server.prep.sandbox import SandboxPolicy, check_policy
from kspeed.server.prep.share import PRELOAD, PrepScheduler
from kspeed.server.prep.worker import Resolve, Setup

__all__ = ["PrepTask", "PrepWorkers", "sandbox_policy"]

log = logging.getLogger(__name__)

JOIN_TIMEOUT = 5.0
MAX_STAGE_NAMES = 64  # stages of one dataset with their own time figure (a bounded metric label set)
TASK_TIMEOUT = 300.0  # a task that takes longer is a hung user function: its worker is replaced


def sandbox_policy(config: ServerConfig, *, state_dir: str, pool_dir: str, region_file: str = "") -> SandboxPolicy:
    """The workers' sandbox as ``config`` sets it, protecting this server's secrets and memory: its
    token file, state directory, pool directory and (``region_file``) a region in it."""
    protected = (config.security.token_file, state_dir, pool_dir, region_file)
    return SandboxPolicy(
        mode=config.preprocess_sandbox,
        user=config.preprocess_user,
        network=config.preprocess_network,
        read=config.preprocess_read_paths,
        write=config.preprocess_write_paths,
        protected=tuple(os.path.abspath(p) for p in protected if p),
        server_pid=os.getpid(),
        manager=config.manager,
    )


class PrepWorkers:
    """``workers`` preprocessing processes; :meth:`run` hands a task to a free one.

    Args:
        workers: number of processes (started at once).
        allow: modules user functions (and ``torchvision.transforms``) may come from.
        logs: how the workers log.
        sandbox: how the workers are confined (default: required, as ``nobody`` when root, no network).
        environment: names of the server's environment variables the workers get (``server.preprocess_env``),
            read as each worker starts.
        weights: per job name, its weight in the workers' fair share (``server.preprocess_weights``).

    Raises:
        ConfigError: the sandbox policy cannot be used (an unknown mode, a preprocessing user that
            does not exist or is root).
    """

    def __init__(
        self,
        workers: int,
        allow: tuple[str, ...],
        logs: LogSettings,
        *,
        sandbox: SandboxPolicy | None = None,
        environment: tuple[str, ...] = (),
        weights: Mapping[str, float] | None = None,
    ) -> None:
        self.allow = tuple(allow)
        self.sandbox = sandbox or SandboxPolicy()
        check_policy(self.sandbox)
        self._setup = Setup(self.sandbox, self.allow, logs)
        self._environment = tuple(environment)
        self._lock = threading.Lock()
        self._closed = False
        self._count = 0
        self._links: set[WorkerLink] = set()  # every live worker (idle or busy), to stop at close
        self._idle: queue.Queue[WorkerLink] = queue.Queue()
        self.workers = max(int(workers), 1)
        self.scheduler = PrepScheduler(self.workers, weights)
        self.restarts = 0
        self.busy_seconds = 0.0
        self.cpu_seconds = 0.0
        self.samples = 0
        #: per dataset, seconds per "<index>:<op>" stage, summed over workers (until :meth:`forget`)
        self.stage_seconds: dict[str, dict[str, float]] = {}
        self._started = False
        self._reported = False  # the first confinement report was logged
        self._warming = False  # warm() was called
        self._warm_failed = False  # warming found the pipeline cannot be resolved (and said so)
        self._warm: set[WorkerLink] = set()  # workers resolving a pipeline for warm()
        self._helpers: ThreadPoolExecutor | None = None  # threads of run_all, made on its first call

    def _start(self) -> None:
        """Spawn the workers on the first task or :meth:`warm` (a server without pipelines never starts them)."""
        with self._lock:
            if self._started or self._closed:
                return
            self._started = True
            sweep_temporary()
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
        request = Resolve(dataset, pipeline, stages)
        for _ in range(self.workers):
            threading.Thread(target=self._warm_one, args=(request,), name="kspeed-prep-warm", daemon=True).start()

    def _warm_one(self, request: Resolve) -> None:
        try:
            worker = self._take()
        except StateError:
            return
        with self._lock:
            warming = not self._closed
            if warming:
                self._warm.add(worker)
        if warming:
            lost = None
            try:
                self._confinement(worker)
                failure = worker.resolve(request, TASK_TIMEOUT)
            except WorkerLost as exc:
                lost, failure = exc, None
            if failure is not None:  # every worker finds the same: said once
                with self._lock:
                    said, self._warm_failed = self._warm_failed, True
                if not said:
                    log.error(
                        "dataset %s: its pipeline cannot run on this server's workers: %s", request.dataset, failure
                    )
            with self._lock:
                self._warm.discard(worker)
            if lost is not None and not self._closed:  # (a late answer would be taken for the next task's)
                log.warning(
                    "preprocessing worker %d lost while resolving a pipeline (%s); replacing it", worker.pid, lost
                )
                with contextlib.suppress(StateError):  # (closed meanwhile: nothing replaces it)
                    self._replace(worker)
                return
        self._idle.put(worker)

    def _spawn(self) -> WorkerLink:
        self._count += 1
        link = WorkerLink(self._setup, preprocess_environment(self._environment), self._count)
        self._links.add(link)
        return link

    def _confinement(self, worker: WorkerLink) -> None:
        """Read a worker's confinement report before its first request; the first one is logged.

        Raises:
            WorkerLost: it sent no report.
        """
        if worker.confinement is not None:
            return
        report = worker.report(TASK_TIMEOUT)
        with self._lock:
            said, self._reported = self._reported, True
        if said:
            return
        log.info("preprocessing sandbox: %s", ", ".join(report.mechanisms) or "none")
        for missing in report.missing:
            log.warning("preprocessing sandbox: %s", missing)
        if report.reachable:
            refusal = report.verdict(self.sandbox.mode)
            log.error("preprocessing sandbox: %s", refusal or f"a worker could {', '.join(report.reachable)}")

    def _replace(self, worker: WorkerLink) -> None:
        """Stop a worker that was lost (or hung) and put a new one in the pool.

        Raises:
            StateError: the pool is closed.
        """
        worker.kill()
        worker.stop()
        with self._lock:
            self._links.discard(worker)
            self.restarts += 1
            if self._closed:
                raise StateError("the preprocessing workers are closed")
            replacement = self._spawn()
        self._idle.put(replacement)

    def check(self, dataset: str, pipeline: bytes, stages: int) -> None:
        """Resolve ``pipeline``'s first ``stages`` stages on a worker, importing their modules there
        (never in this process), and wait for the outcome. A worker that dies doing so is replaced
        and the new one asked once more.

        Raises:
            AccessDeniedError: a stage's module is not on the allow-list.
            ConfigError: a stage cannot be resolved (a module that does not import, bad parameters),
                resolving it killed two workers, or the workers' sandbox is incomplete and required.
            StateError: the pool is closed.
        """
        self._start()
        lost = ""
        for _ in range(2):
            worker = self._take()
            try:
                self._confinement(worker)
                failure = worker.resolve(Resolve(dataset, pipeline, stages), TASK_TIMEOUT)
            except WorkerLost as exc:
                lost = f"{exc}, exit code {worker.exitcode}"
                log.warning(
                    "dataset %s: preprocessing worker %d lost resolving the pipeline (%s); replacing it",
                    dataset,
                    worker.pid,
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

    def run(self, task: PrepTask, job: str = PRELOAD) -> list[int | str | bytes]:
        """Run ``task`` on a free worker once ``job`` may have one (:mod:`kspeed.server.prep.share`:
        at most the active-worker limit busy, handed out by job and weight); per sample, the bytes
        written (or, without outputs, the bytes themselves) or why it failed.

        A worker that dies during the task (or answers what a worker never answers) is replaced
        and the task run once more on the new one.

        Raises:
            StateError: the pool is closed.
        """
        self._start()
        while not self.scheduler.acquire(job, timeout=0.5):
            if self._closed:
                raise StateError("the preprocessing workers are closed")
        began = time.monotonic()
        try:
            return self._run(task)
        finally:
            self.scheduler.release(job, time.monotonic() - began, len(task.samples))

    @property
    def active(self) -> int:
        """Workers that may run at once (the fewest that reached the peak throughput)."""
        return self.scheduler.sizer.limit

    def _run(self, task: PrepTask) -> list[int | str | bytes]:
        results: list[int | str | bytes] = []
        for _ in range(2):  # a worker that dies is replaced and the task run once more
            worker = self._take()
            started = time.monotonic()
            try:
                self._confinement(worker)
                results, seconds, cpu = worker.run(task, TASK_TIMEOUT)
            except WorkerLost as exc:
                code = worker.exitcode
                log.warning(
                    "dataset %s: preprocessing worker %d lost during %d sample(s) (%s, exit code %s); replacing it",
                    task.dataset,
                    worker.pid,
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
                self.cpu_seconds += cpu
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
                raise StateError("the preprocessing workers are closed")
            if self._helpers is None:
                self._helpers = ThreadPoolExecutor(self.workers, thread_name_prefix="kspeed-prep-call")
            helpers = self._helpers
        return list(helpers.map(self.run, tasks))

    def _take(self) -> WorkerLink:
        while True:
            if self._closed:
                raise StateError("the preprocessing workers are closed")
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
        return sorted(w.pid for w in list(self._idle.queue))

    def all_pids(self) -> list[int]:
        """Process IDs of every live worker, idle or busy."""
        with self._lock:
            return sorted(w.pid for w in self._links)

    def close(self) -> None:
        """Stop every worker (waiting for those running a task a moment, then killing them); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            helpers, self._helpers = self._helpers, None
            warming = list(self._warm)
            links = list(self._links)
        for worker in warming:  # it holds no task
            worker.kill()
        if helpers is not None:
            helpers.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + JOIN_TIMEOUT
        stopped: set[WorkerLink] = set()
        while time.monotonic() < deadline:  # busy ones come back when done (lost ones are stopped already)
            with self._lock:
                if not [w for w in links if w in self._links and w not in stopped]:
                    break
            try:
                worker = self._idle.get(timeout=0.1)
            except queue.Empty:
                continue
            worker.stop()
            stopped.add(worker)
        for worker in links:
            if worker not in stopped:
                worker.kill()
                worker.stop()
