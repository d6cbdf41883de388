"""``kspeed analyze``: measure a job's rates on a live cluster, then say where its stalls come from
and what removes them.

:func:`analyze` runs the phases of :mod:`kspeed.analyze.measure`, builds the model's inputs
(:class:`~kspeed.analyze.model.Measured`) from them, and returns an :class:`Analysis`: the rates,
the measured point, the stalls per rank, what-if curves over each dimension of the cluster, and the
smallest cluster that removes the stall (:mod:`kspeed.analyze.model`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

from kspeed.analyze import measure
from kspeed.analyze.measure import Options, Phase, RankFigures
from kspeed.analyze.model import Measured, Prediction, Setup, predict, smallest_cluster, sweep
from kspeed.client.spec import DatasetSpec
from kspeed.config import ClientConfig
from kspeed.errors import ConfigError, StateError

__all__ = ["Analysis", "analyze", "cache_fraction_of", "crowded_split_note", "curves", "shares_of"]

log = logging.getLogger(__name__)


@dataclass
class Analysis:
    """What :func:`analyze` found (see :meth:`as_dict` for the JSON the CLI writes).

    Attributes:
        dataset: the dataset analyzed.
        options: how it was measured.
        measured: the model's inputs.
        phases: per phase, each rank's figures.
        as_is: the setup the job ran at (its offload, cache fraction, cluster).
        observed: samples/s a rank got as the job runs (the mean over ranks).
        prediction: the model's rate at ``as_is``.
        ranks: per rank, the measured wait share and the model's prep and fetch stalls.
        curves: per dimension, the model's predictions as that dimension varies.
        smallest: the smallest cluster that removes the stall (:func:`smallest_cluster`).
        notes: what the reader should know about this run (phases skipped, and why).
    """

    dataset: str
    options: Options
    measured: Measured
    phases: dict[str, list[RankFigures]]
    as_is: Setup
    observed: float
    prediction: Prediction
    ranks: list[dict[str, Any]]
    curves: dict[str, list[dict]]
    smallest: dict
    notes: list[str] = field(default_factory=list)
    started_unix: float = 0.0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "started_unix": self.started_unix,
            "seconds": self.seconds,
            "options": dataclasses.asdict(self.options),
            "measured": self.measured.as_dict(),
            "phases": {name: measure.as_dicts(figures) for name, figures in self.phases.items()},
            "as_is": dataclasses.asdict(self.as_is),
            "observed_samples_per_s": self.observed,
            "prediction": self.prediction.as_dict(),
            "prediction_error": (self.prediction.samples_per_s - self.observed) / self.observed
            if self.observed > 0
            else None,
            "ranks": self.ranks,
            "curves": self.curves,
            "smallest_cluster": self.smallest,
            "notes": self.notes,
        }


def shares_of(info: Any) -> tuple[tuple[float, float], ...]:
    """Per server holding a registered dataset, the bytes of it it holds and the bytes of those
    it keeps in memory: all, held whole; none, streamed (``stream`` reads every sample each epoch)
    or served on demand; three quarters of the window, for a caching policy (``minio``, ``reuse``,
    ``lru``: a quarter of the window prefetches), at most the share."""
    held: dict[str, list[float]] = {}
    for share in info.shares:
        kept = 0.0
        if not share.on_demand and share.policy != "stream":
            kept = (
                float(share.bytes)
                if not share.policy
                else min(share.bytes, 0.75 * share.memory_regions * info.region_size)
            )
        row = held.setdefault(share.server_id, [0.0, 0.0])
        row[0] += share.bytes
        row[1] += kept
    return tuple((b, k) for b, k in held.values())


def cache_fraction_of(info: Any) -> float:
    """The share of a registered dataset its servers keep in memory (:func:`shares_of`; 1 for an empty one)."""
    shares = shares_of(info)
    total = sum(b for b, _ in shares)
    return min(1.0, sum(k for _, k in shares) / total) if total > 0 else 1.0


def _rank_rows(m: Measured, setup: Setup, phases: dict[str, list[RankFigures]]) -> list[dict[str, Any]]:
    """Each rank's measured wait share and the model's stalls at its own rates."""

    def rate(phase: str, k: int, default: float | None) -> float | None:
        figures = phases.get(phase)
        return figures[k].rate if figures and figures[k].rate > 0 else default

    rows = []
    for k, run in enumerate(phases["as_is"]):
        mine = replace(
            m,
            step=rate("step", k, m.step) or m.step,
            memory_fetch=rate("memory", k, m.memory_fetch) or m.memory_fetch,
            client_prep=rate("client", k, m.client_prep),
        )
        p = predict(mine, setup)
        rows.append(
            {
                "rank": run.rank,
                "observed_samples_per_s": run.rate,
                "observed_wait_share": run.wait_share,
                "predicted_samples_per_s": p.samples_per_s,
                "prep_stall": p.prep_stall,
                "fetch_stall": p.fetch_stall,
                "bound": p.bound,
            }
        )
    return rows


def curves(m: Measured, base: Setup, smallest: dict) -> dict[str, list[dict]]:
    """The model's predictions along each dimension of the cluster, around ``base``."""
    top = max(2 * m.servers, (smallest.get("servers") or 0) + 1, 4)
    return {
        "servers": sweep(m, base, "servers", list(range(1, top + 1))),
        "server_cores": sweep(m, base, "server_cores", list(range(1, 2 * m.server_cores + 3))),
        "client_cores": sweep(m, base, "client_cores", list(range(1, 2 * m.client_cores + 3))),
        "cache_fraction": sweep(m, base, "cache_fraction", [k / 10 for k in range(11)]),
        "offload": sweep(m, base, "offload", [k / 20 for k in range(21)]),
        "rail_bytes_per_s": sweep(m, base, "rail_bytes_per_s", [m.rail_bytes_per_s * f for f in (0.25, 0.5, 1, 2, 4)]),
    }


def analyze(config: ClientConfig, dataset: str, options: Options) -> Analysis:
    """Measure ``dataset`` (registered, as a job would attach it) on the cluster at ``config.manager``.

    Holds a lease on the dataset (and preloads it) for the whole run, so that its memory stays
    between the phases; the twins go with their phases.

    Raises:
        NotFoundError: the dataset is not registered.
        StateError: a phase failed (the phase, rank and error named).
        ConfigError: bad options.
    """
    from kspeed.client.client import KSpeedClient

    started, clock = time.time(), time.monotonic()
    notes: list[str] = []
    with KSpeedClient(config=config) as client:
        info = client.manager.dataset(dataset)
        spec = measure.spec_of(info)
        holder = client.dataset(dataset, options.batch_size, quiet=True)
        try:
            holder.preload(quiet=True)
            info = client.manager.dataset(dataset)
            status = client.manager.status()
            phases = _run_phases(config, spec, info, status, options, notes)
        finally:
            holder.close()
    m, as_is, observed = _model_inputs(spec, info, status, phases, options, notes)
    prediction = predict(m, as_is)
    smallest = smallest_cluster(m, as_is)
    return Analysis(
        dataset=dataset,
        options=options,
        measured=m,
        phases=phases,
        as_is=as_is,
        observed=observed,
        prediction=prediction,
        ranks=_rank_rows(m, as_is, phases),
        curves=curves(m, as_is, smallest),
        smallest=smallest,
        notes=notes,
        started_unix=started,
        seconds=time.monotonic() - clock,
    )


def _servers_of(info: Any) -> list[str]:
    return sorted({share.server_id for share in info.shares if share.server_id})


def _run_phases(
    config: ClientConfig, spec: DatasetSpec, info: Any, status: Any, options: Options, notes: list[str]
) -> dict[str, list[RankFigures]]:
    name, pipeline = spec.name, spec.pipeline is not None
    split = pipeline and spec.pipeline is not None and spec.pipeline.server_stages > 0
    cached = cache_fraction_of(info) >= 1.0
    servers = _servers_of(info)
    region = info.region_size or max((s.inventory.region_size for s in status.servers), default=0)
    plan = [Phase("step", name, pipeline, options.offload, with_step=True)]
    if split:
        plan.append(Phase("server", name, True, 1.0, with_step=False, read_servers="prep"))
        plan.append(Phase("client", name, True, 0.0, with_step=False))
    elif pipeline:
        plan.append(Phase("client", name, True, None, with_step=False))
        notes.append("the pipeline has no server stages: nothing to offload, P is the client's alone")
    if not pipeline and cached:
        plan.append(Phase("memory", name, False, None, with_step=False))
    else:
        raw = measure.twin(spec, "analyze-raw", policy="cache")
        plan.append(Phase("memory", raw, False, None, with_step=False, preload=True))
    stream = measure.twin(
        spec, "analyze-stream", policy="stream", quota_bytes=measure.STREAM_REGIONS * region * len(servers)
    )
    plan.append(Phase("backend", stream, False, None, with_step=False, read_servers="production"))
    plan.append(Phase("as_is", name, pipeline, options.offload, with_step=True))
    gpu = (
        [f"{k}:{stage.op}" for k, stage in enumerate(spec.pipeline.stages) if stage.place == "gpu"]
        if spec.pipeline
        else []
    )
    if gpu:
        notes.append(
            f"stages {', '.join(gpu)} are placed on the GPU: they run on the rank's device ({options.device}) in every "
            "phase that preprocesses on the client, so P_c includes them; there is no separate GPU rate"
            + (
                ""
                if options.device.startswith("cuda")
                else " (measured on the CPU here: the rates say nothing of a GPU)"
            )
        )
    if not cached:
        notes.append(
            "the dataset is not held whole in the servers' memory: phases 'server' and 'client' read "
            "part of it from the backend, so P may be understated where the backend is the slower"
        )
    with measure.Ranks(config, options) as ranks:
        return {phase.name: ranks.run(phase) for phase in plan}


def _model_inputs(
    spec: DatasetSpec,
    info: Any,
    status: Any,
    phases: dict[str, list[RankFigures]],
    options: Options,
    notes: list[str],
) -> tuple[Measured, Setup, float]:
    servers = _servers_of(info)
    records = {s.id: s for s in status.servers}
    memory = [records[s].inventory.memory_bytes for s in servers if s in records]
    workers = [records[s].inventory.preprocess_workers for s in servers if s in records]
    server_prep: float | None = None
    server_cores = max(workers, default=0)
    if "server" in phases:
        lead = phases["server"][0]
        server_prep = lead.server_capacity
        if lead.server_workers:
            server_cores = lead.server_workers
        if server_prep is None or not math.isfinite(server_prep) or server_prep <= 0:
            server_prep = measure.summed(phases["server"])
            notes.append("the servers do not report their preprocessing counters: P_s is the rate they delivered")
    client_prep = measure.mean_rate(phases["client"]) if "client" in phases else None
    raw_bytes = measure.bytes_per_sample(phases["memory"])
    out_bytes = measure.bytes_per_sample(phases["server"]) if "server" in phases else raw_bytes
    if raw_bytes <= 0:
        raise StateError(f"analyze: dataset {spec.name!r}: no bytes were delivered in phase 'memory'")
    client_cores = max((f.workers for f in phases.get("client", [])), default=0)
    try:
        m = Measured(
            step=measure.mean_rate(phases["step"]),
            memory_fetch=measure.mean_rate(phases["memory"]),
            backend_fetch=measure.summed(phases["backend"]),
            server_prep=server_prep,
            client_prep=client_prep,
            raw_bytes=raw_bytes,
            out_bytes=out_bytes or raw_bytes,
            servers=max(len(servers), 1),
            server_cores=max(server_cores, 1),
            client_cores=max(client_cores, 1),
            ranks=options.ranks,
            server_memory=min(memory, default=0),
            dataset_bytes=int(info.fingerprint.total_bytes),
            step_cpu=measure.cpu_per_sample(phases["step"]),
            local_cpu=measure.cpu_per_sample(phases["client"]) if "client" in phases else 0.0,
            remote_cpu=measure.cpu_per_sample(phases["server" if "server" in phases else "memory"]),
            client_cpus=min((f.cpus for f in phases["as_is"]), default=0),
            server_read_bytes_per_s=max((b for _, b in phases["backend"][0].backend_reads.values()), default=0.0),
        )
    except ConfigError as exc:
        raise StateError(f"analyze: dataset {spec.name!r}: a phase measured nothing usable: {exc}") from exc
    notes.extend(crowded_split_note(m))
    ratio = _ratio_in_force(phases["as_is"], options, spec)
    as_is = replace(Setup.measured(m, offload=ratio, cache_fraction=cache_fraction_of(info)), shares=shares_of(info))
    return m, as_is, measure.mean_rate(phases["as_is"])


def crowded_split_note(m: Measured) -> list[str]:
    """A warning where the model's splits are optimistic: a rank whose preprocessing workers have
    no CPU beside its training thread (``docs/analyze.md``: on such a rank a split measured at
    half the model's rate, the hand-offs between the thread and a worker on its core costing)."""
    if m.server_prep is None or m.client_prep is None or not 0 < m.client_cpus <= m.client_cores:
        return []
    return [
        f"the rank has {m.client_cpus} CPU(s) for its training thread and {m.client_cores} preprocessing "
        "worker(s): predictions that split preprocessing between the servers and this client are "
        "optimistic (on a one-CPU rank a split ran at half its predicted rate); give the rank a CPU "
        "beside its workers, or read the offload 0 and 1 predictions"
    ]


def _ratio_in_force(run: list[RankFigures], options: Options, spec: DatasetSpec) -> float:
    if spec.pipeline is None or spec.pipeline.server_stages == 0:
        return 0.0
    ratios = [f.offload for f in run if f.offload is not None]
    if ratios:
        return sum(ratios) / len(ratios)
    return float(options.offload) if isinstance(options.offload, (int, float)) else 1.0
