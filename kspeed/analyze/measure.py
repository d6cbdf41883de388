"""The analyzer's measurements against a live cluster: one phase per rate, differential as in DS-Analyzer.

Each phase runs ``ranks`` ranks at once (processes, as under torchrun; in this process when there
is one) for a few seconds after a warm-up, through the client as a training script uses it:

- ``step`` (G): one batch taken, then the step called on it again and again (no fetch, no prep);
- ``server`` (P_s): the dataset with every sample preprocessed on the servers (``offload=1``), no
  step; the servers' capacity is read from their preprocessing counters over the phase
  (:class:`~kspeed.client.tuning.meters.ServerMeter`, as ``offload="auto"`` reads it);
- ``client`` (P_c): every sample preprocessed by the rank's own workers (``offload=0``), no step;
- ``memory`` (C): the stored bytes with no pipeline from the servers' memory (a twin of the
  dataset, policy ``cache``, preloaded first), no step;
- ``backend`` (S): the same through a twin with policy ``stream`` (every sample read from the
  backend as it is needed, in a window of two regions per server), no step;
- ``as_is``: the dataset as the job runs it (its offload setting, the step): the measured point.

The twins are registered under the dataset's name with ``.analyze-raw`` / ``.analyze-stream``
appended and held only by the analyzer's leases, so the manager frees them when it is done.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing as mp
import queue
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kspeed.analyze.steps import resolve, samples_of
from kspeed.client.spec import DatasetSpec
from kspeed.config import ClientConfig, process_cpu_seconds, usable_cores
from kspeed.errors import ConfigError, KSpeedError, StateError
from kspeed.preprocess.pipeline import Pipeline

__all__ = ["PHASES", "Options", "Phase", "RankFigures", "Ranks", "spec_of", "twin"]

log = logging.getLogger(__name__)

PHASES = ("step", "server", "client", "memory", "backend", "as_is")
MAX_RANKS = 64
#: Regions per server the ``backend`` twin's window may take.
STREAM_REGIONS = 2
RANK_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Options:
    """How the analyzer measures.

    Attributes:
        step: the training step (:func:`kspeed.analyze.steps.resolve`): ``"pkg.mod:step"``,
            ``"sleep:<ms>"`` or ``"cpu:<ms>"``.
        batch_size: samples per batch.
        seconds: how long each phase is measured, after its warm-up.
        warmup_batches: batches each phase delivers before it is measured, at least.
        warmup_s: seconds each phase runs before it is measured, at least (workers starting,
            caches and windows filling: a phase measured from its first batches understates).
        ranks: ranks measured at once.
        offload: the job's own split (``None``: the client's default), for the ``as_is`` phase.
        num_workers: client preprocessing workers per rank (``None``: the client's default).
        rail: the rail (``None``: chosen as for any job).
        device: where batches go (``"cpu"`` or ``"cuda"``).
    """

    step: str
    batch_size: int
    seconds: float = 5.0
    warmup_batches: int = 3
    warmup_s: float = 2.0
    ranks: int = 1
    offload: float | str | None = None
    num_workers: int | None = None
    rail: str | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        resolve(self.step)  # a bad step fails here, before any phase runs
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1, got {self.batch_size}", field="batch_size")
        if not 0.5 <= self.seconds <= 3600:
            raise ConfigError(f"seconds per phase must be 0.5..3600, got {self.seconds:g}", field="seconds")
        if not 0 <= self.warmup_s <= 600:
            raise ConfigError(f"warmup_s must be 0..600 seconds, got {self.warmup_s:g}", field="warmup_s")
        if not 1 <= self.warmup_batches <= 10_000:
            raise ConfigError(f"warmup_batches must be 1..10000, got {self.warmup_batches}", field="warmup_batches")
        if not 1 <= self.ranks <= MAX_RANKS:
            raise ConfigError(f"ranks must be 1..{MAX_RANKS}, got {self.ranks}", field="ranks")


@dataclass(frozen=True)
class Phase:
    """One phase as the ranks run it: which dataset, the split, whether the step runs."""

    name: str
    spec: DatasetSpec | str
    pipeline: bool
    offload: float | str | None
    with_step: bool
    preload: bool = False
    read_servers: str = ""  # "prep" or "production": the servers' counters read over the phase (rank 0)


@dataclass
class RankFigures:
    """What one rank measured in one phase.

    Attributes:
        rank: the rank.
        samples: samples delivered (or stepped, in phase ``step``) while measured.
        seconds: wall seconds measured.
        wait_s: seconds inside ``next()`` while measured.
        bytes: bytes delivered while measured (0: not known).
        workers: the rank's preprocessing workers.
        server_capacity: the servers' preprocessing capacity for the job, samples/s (rank 0 of
            phase ``server`` only; ``None`` elsewhere or where the servers do not report it).
        server_workers: preprocessing workers per server (rank 0 of phase ``server``).
        backend_reads: per server, the samples/s and bytes/s its producers read from the backend
            for the phase's dataset (rank 0 of phase ``backend``).
        offload: the split in force at the phase's end (``None``: no pipeline).
        cpu_s: CPU seconds the rank's process and its preprocessing workers used while measured.
        cpus: CPUs the rank may run on.
        fed: samples the feed delivered while measured, whose are ``bytes``.
    """

    rank: int
    samples: int = 0
    seconds: float = 0.0
    wait_s: float = 0.0
    bytes: int = 0
    workers: int = 0
    server_capacity: float | None = None
    server_workers: int = 0
    backend_reads: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    offload: float | None = None
    cpu_s: float = 0.0
    cpus: int = 0
    fed: int = 0

    @property
    def rate(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def wait_share(self) -> float:
        return self.wait_s / self.seconds if self.seconds > 0 else 0.0


def spec_of(info: Any) -> DatasetSpec:
    """A registered dataset's definition (``DatasetInfo`` from the manager) as a :class:`DatasetSpec`."""
    message = info.spec
    return DatasetSpec(
        name=message.name,
        uri=message.uri,
        kind=message.kind or "auto",
        labels=message.labels,
        quota_bytes=message.quota_bytes,
        pipeline=Pipeline.from_proto(message.pipeline) if message.HasField("pipeline") else None,
        cache=message.cache,
        policy=message.policy or "auto",
    )


def twin(spec: DatasetSpec, suffix: str, *, policy: str, quota_bytes: int = 0) -> DatasetSpec:
    """The stored bytes of ``spec`` (no pipeline) under another name and policy."""
    name = f"{spec.name[: 128 - len(suffix) - 1]}.{suffix}"
    return dataclasses.replace(spec, name=name, pipeline=None, cache="", policy=policy, quota_bytes=quota_bytes)


def _open(client: Any, phase: Phase, options: Options, rank: int) -> Any:
    kwargs: dict[str, Any] = {
        "rank": rank,
        "world_size": options.ranks,
        "quiet": True,
        "rail": options.rail,
        "device": options.device,
    }
    if phase.pipeline:
        kwargs["offload"] = phase.offload
        kwargs["num_workers"] = options.num_workers
    return client.dataset(phase.spec, options.batch_size, **kwargs)


def _inner(ds: Any) -> Any:
    """The KSpeed dataset under a prepared one (its feed and servers)."""
    return getattr(ds, "kspeed_dataset", ds)


def _delivered(ds: Any) -> tuple[int, int]:
    stats = ds.stats()
    return int(stats.get("samples", 0)), int(stats.get("bytes", 0))


def _cpu(ds: Any) -> float:
    """CPU seconds of this process and of the dataset's preprocessing workers so far."""
    workers: list[int] = getattr(ds, "worker_pids", list)()
    return time.process_time() + sum(process_cpu_seconds(pid) for pid in workers)


def _measure_step(ds: Any, step: Callable[[Any], Any], options: Options, figures: RankFigures) -> None:
    batch = next(iter(ds))
    n = samples_of(batch)
    for _ in range(min(options.warmup_batches, 3)):
        step(batch)
    started, cpu = time.perf_counter(), time.thread_time()
    while True:
        step(batch)
        figures.samples += n
        figures.seconds = time.perf_counter() - started
        if figures.seconds >= options.seconds:
            break
    figures.cpu_s = time.thread_time() - cpu  # the step's own (the feed's threads idle meanwhile)
    del batch


def _measure_run(
    ds: Any,
    step: Callable[[Any], Any] | None,
    options: Options,
    figures: RankFigures,
    read: Callable[[], tuple[float, dict] | None],
    reads: str,
) -> None:
    epoch = 0
    batches = iter(ds)
    warm = options.warmup_batches
    warm_until = time.perf_counter() + options.warmup_s
    started = 0.0
    before_samples = before_bytes = 0
    before = None
    cpu = 0.0
    while True:
        asked = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            epoch += 1
            ds.set_epoch(epoch)
            batches = iter(ds)
            continue
        waited = time.perf_counter() - asked
        if warm > 0:
            warm -= 1 if warm > 1 or time.perf_counter() >= warm_until else 0
            if warm == 0:
                started = time.perf_counter()
                before_samples, before_bytes = _delivered(ds)
                before = read()
                cpu = _cpu(ds)
        else:
            figures.samples += samples_of(batch)
            figures.wait_s += waited
        if step is not None:
            step(batch)
        release = getattr(batch, "release", None)
        if release is not None:
            release()
        del batch
        if warm == 0 and time.perf_counter() - started >= options.seconds:
            break
    figures.seconds = time.perf_counter() - started
    figures.cpu_s = _cpu(ds) - cpu
    stats = ds.stats()
    figures.bytes = int(stats.get("bytes", 0)) - before_bytes
    # (the feed's own count: a prepared dataset's feed runs a few batches ahead of the hand-overs)
    figures.fed = int(stats.get("samples", 0)) - before_samples
    if "offload" in stats:
        figures.offload = float(stats["offload"].get("ratio", 0.0))
    after = read()
    if before is not None and after is not None:
        if reads == "prep":
            figures.server_capacity, figures.server_workers = _capacity(before, after)
        else:
            figures.backend_reads = _reads(before, after)


def _reads(before: tuple[float, dict], after: tuple[float, dict]) -> dict[str, tuple[float, float]]:
    """Each server's backend reads for the dataset, samples/s and bytes/s, between two readings of
    its production figures."""
    (t0, first), (t1, last) = before, after
    if t1 <= t0:
        return {}
    return {
        server: (
            (last[server].fetch_samples - figures.fetch_samples) / (t1 - t0),
            (last[server].fetch_bytes - figures.fetch_bytes) / (t1 - t0),
        )
        for server, figures in first.items()
        if server in last
    }


def _capacity(before: tuple[float, dict], after: tuple[float, dict]) -> tuple[float | None, int]:
    """The servers' preprocessing capacity from two readings of their counters (ServerMeter's rule)."""
    from kspeed.client.tuning.meters import Reading, ServerMeter

    meter = ServerMeter()
    t0, first = before
    t1, last = after
    workers = 0
    for server_id, figures in first.items():
        if server_id in last:
            meter.read(server_id, Reading.of(figures, counts_job=False), t0)
            meter.read(server_id, Reading.of(last[server_id], counts_job=False), t1)
            workers = max(workers, int(last[server_id].workers))
    capacities = meter.capacities()
    return (sum(capacities.values()) if capacities else None), workers


def rank_main(config: ClientConfig, phase: Phase, options: Options, rank: int) -> RankFigures:
    """One rank of one phase (in its own process when there are several ranks)."""
    from kspeed.client.client import KSpeedClient

    figures = RankFigures(rank, cpus=usable_cores())
    step = resolve(options.step)
    with KSpeedClient(config=config) as client:
        ds = _open(client, phase, options, rank)
        try:
            if phase.preload:
                ds.preload(quiet=True)
            figures.workers = int(ds.stats().get("workers", 0))
            if phase.name == "step":
                _measure_step(ds, step, options, figures)
            else:

                def read() -> tuple[float, dict] | None:
                    if not phase.read_servers or rank != 0:
                        return None
                    inner = _inner(ds)
                    ask = inner.server_prep_figures if phase.read_servers == "prep" else inner.server_production_figures
                    return time.monotonic(), ask()

                _measure_run(ds, step if phase.with_step else None, options, figures, read, phase.read_servers)
        finally:
            ds.close()
    return figures


def _rank_loop(config: ClientConfig, options: Options, rank: int, inbox: Any, out: Any) -> None:
    """A rank process: run each phase it is given until it is given ``None``."""
    while (phase := inbox.get()) is not None:
        try:
            out.put((rank, rank_main(config, phase, options, rank)))
        except BaseException as exc:  # reported to the analyzing process, which raises it
            out.put((rank, f"{type(exc).__name__}: {exc}"))


class Ranks:
    """The ranks that run the phases: this process for one rank, else one process per rank,
    started once and given each phase in turn (a rank's start, torch's import among it, costs
    seconds). Use as a context manager: the processes stop with it.
    """

    def __init__(self, config: ClientConfig, options: Options) -> None:
        self._config, self._options = config, options
        self._procs: list[Any] = []
        self._inboxes: list[Any] = []
        if options.ranks > 1:
            ctx = mp.get_context("spawn")
            self._out = ctx.Queue()
            for rank in range(options.ranks):
                inbox = ctx.Queue()
                proc = ctx.Process(target=_rank_loop, args=(config, options, rank, inbox, self._out))
                proc.start()
                self._inboxes.append(inbox)
                self._procs.append(proc)

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the rank processes (killed where one does not stop in time)."""
        for inbox in self._inboxes:
            inbox.put(None)
        for proc in self._procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs, self._inboxes = [], []

    def run(self, phase: Phase) -> list[RankFigures]:
        """Run ``phase`` on every rank at once; the ranks' figures, by rank.

        Raises:
            StateError: a rank failed (its error named) or did not finish in time.
        """
        options = self._options
        log.info("analyze: phase %s (%d rank(s), %.1fs)", phase.name, options.ranks, options.seconds)
        if not self._procs:
            try:
                return [rank_main(self._config, phase, options, 0)]
            except KSpeedError as exc:
                raise StateError(f"analyze: phase {phase.name!r} failed: {exc}") from exc
        for inbox in self._inboxes:
            inbox.put(phase)
        results: dict[int, RankFigures | str] = {}
        deadline = time.monotonic() + RANK_TIMEOUT_S + options.seconds
        while len(results) < len(self._procs):
            try:
                rank, value = self._out.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                missing = sorted(set(range(len(self._procs))) - set(results))
                raise StateError(f"analyze: phase {phase.name!r}: ranks {missing} did not finish in time") from None
            results[rank] = value
        failed = {r: v for r, v in results.items() if isinstance(v, str)}
        if failed:
            raise StateError(f"analyze: phase {phase.name!r} failed on rank(s) {failed}")
        return [v for _, v in sorted(results.items()) if isinstance(v, RankFigures)]


def summed(figures: list[RankFigures]) -> float:
    """The ranks' samples/s together."""
    return sum(f.rate for f in figures)


def mean_rate(figures: list[RankFigures]) -> float:
    """A rank's samples/s (the mean over ranks)."""
    rates = [f.rate for f in figures]
    return sum(rates) / len(rates) if rates else math.nan


def cpu_per_sample(figures: list[RankFigures]) -> float:
    """The ranks' CPU seconds per sample delivered (or stepped)."""
    samples = sum(f.samples for f in figures)
    return sum(f.cpu_s for f in figures) / samples if samples else 0.0


def bytes_per_sample(figures: list[RankFigures]) -> float:
    """Bytes per sample the ranks' feeds delivered."""
    samples = sum(f.fed for f in figures)
    return sum(f.bytes for f in figures) / samples if samples else 0.0


def as_dicts(figures: list[RankFigures]) -> list[Mapping[str, Any]]:
    return [{**dataclasses.asdict(f), "samples_per_s": f.rate, "wait_share": f.wait_share} for f in figures]
