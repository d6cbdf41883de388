"""The what-if model: samples/s one rank gets, from rates measured once, at any cluster shape.

DS-Analyzer's differential model (Mohan et al., VLDB 2021, §3-§4) over KSpeed's disaggregated
pipeline. A rank is fed at the slowest of:

- ``step``: G, the rate its training step ingests batches already in the ring;
- ``server_prep``: the servers' preprocessing, shared by the ranks, over the share ``r`` of each
  batch they preprocess (the offload ratio): ``P_s * servers/servers0 * cores/cores0 / (ranks * r)``;
- ``client_prep``: the rank's own workers, over the share ``1 - r`` they preprocess:
  ``P_c * client_cores/client_cores0 / (1 - r)``;
- ``client_cpu``: the rank's CPUs, which run its step, its workers and the receiving of every
  sample (FastFlow's ``cores / (step + Pcycle + common)``):
  ``cpus * client_cores/client_cores0 / (step_cpu + (1 - r) * local_cpu + r * remote_cpu)``, with
  the CPU seconds per sample measured with everything preprocessed here and everything there;
- ``memory``: the fetch from the servers' memory over the rail, C measured raw and scaled by the
  bytes a sample then carries (``r * out_bytes + (1 - r) * raw_bytes``) and the rail's bandwidth;
- ``backend``: the misses read from the backend: a share ``1 - f`` of the samples when a fraction
  ``f`` of the dataset stays in the servers' memory, at S (all servers' reads) scaled by the
  servers and shared by the ranks: ``S * servers/servers0 / (ranks * misses)``; a dataset held in
  part keeps raw copies only of what the client preprocesses, so there ``misses = 1 - f (1 - r)``.

As DS-Analyzer, fetch stall and prep stall are the time a sample takes beyond the step: the prep
stall is ``1/min(G, P) - 1/G`` (preprocessing alone, data already in memory) and the fetch stall
``1/min(G, P, F) - 1/min(G, P)`` (what fetching adds), both as shares of the time a sample takes.

Assumptions, stated where a reader of a prediction needs them: a rank's rail is its own (the
memory term does not shrink with more ranks); server cores scale the servers' preprocessing up to
the workers that use them; backend reads scale with the servers (each reads its own share's
misses) and the store itself is not the limit; a server's memory holds its share of ``f`` (a
caching policy, ``cache`` or ``minio``; ``stream`` reads every sample each epoch, ``f = 0``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from kspeed.errors import ConfigError

__all__ = ["CLEAR", "Measured", "Prediction", "Setup", "best_offload", "predict", "smallest_cluster", "sweep"]

#: A prediction within this share of the step's rate counts as no stall.
CLEAR = 0.97
#: Offload ratios tried when the split is left to the model (0, 1/STEPS, ..., 1).
OFFLOAD_STEPS = 20
#: Most servers :func:`smallest_cluster` considers.
MAX_SERVERS = 1024


@dataclass(frozen=True)
class Measured:
    """What the analyzer measured on the cluster it ran against (samples/s; per rank unless said).

    Attributes:
        step: G: samples/s the training step ingests with data already in the ring.
        memory_fetch: C: samples/s a rank receives raw from the servers' memory (no
            preprocessing, no step), with ``ranks`` ranks reading at once.
        backend_fetch: S: samples/s the ``servers`` together read from the backend.
        server_prep: P_s: samples/s the servers' preprocessing runs for this job, all servers
            (``None``: the pipeline has no server stages).
        client_prep: P_c: samples/s one rank's workers run the whole pipeline (``None``: no pipeline).
        raw_bytes: mean stored bytes of a sample.
        out_bytes: mean bytes of a sample preprocessed by the servers.
        servers: servers holding the dataset.
        server_cores: preprocessing workers per server.
        client_cores: preprocessing workers per rank.
        ranks: ranks measured at once.
        server_memory: bytes each server may pool (0: unknown).
        dataset_bytes: the dataset's stored bytes (0: unknown).
        step_cpu: CPU seconds the step takes per sample (0 for a step that waits on a GPU).
        local_cpu: the rank's CPU seconds per sample (its process and workers) with every sample
            preprocessed here (0: unknown; without a pipeline, unused).
        remote_cpu: the same with every sample preprocessed on the servers, or received raw
            without a pipeline (0: unknown).
        client_cpus: CPUs the rank may run on (0: unknown, no ``client_cpu`` limit).
        server_read_bytes_per_s: bytes/s a server reads from the backend (the fastest reader's
            rate while the backend was read for the job; 0: unknown, S is scaled instead).
    """

    step: float
    memory_fetch: float
    backend_fetch: float
    server_prep: float | None
    client_prep: float | None
    raw_bytes: float
    out_bytes: float
    servers: int
    server_cores: int
    client_cores: int
    ranks: int = 1
    server_memory: int = 0
    dataset_bytes: int = 0
    step_cpu: float = 0.0
    local_cpu: float = 0.0
    remote_cpu: float = 0.0
    client_cpus: int = 0
    server_read_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("step", "memory_fetch", "backend_fetch", "raw_bytes", "out_bytes"):
            value = getattr(self, name)
            if not (value > 0 and not math.isnan(value)):
                raise ConfigError(f"measured {name} must be a positive rate, got {value!r}", field=name)
        for name in ("server_prep", "client_prep"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"measured {name} must be a positive rate or None, got {value!r}", field=name)
        for name in ("servers", "server_cores", "client_cores", "ranks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"measured {name} must be at least 1, got {getattr(self, name)!r}", field=name)

    @property
    def rail_bytes_per_s(self) -> float:
        return self.memory_fetch * self.raw_bytes

    def cache_fraction(self, servers: int) -> float:
        """The share of the dataset ``servers`` servers hold in memory (1 where unknown)."""
        if self.server_memory <= 0 or self.dataset_bytes <= 0:
            return 1.0
        return min(1.0, servers * self.server_memory / self.dataset_bytes)

    def as_dict(self) -> dict:
        return {**asdict(self), "rail_bytes_per_s": self.rail_bytes_per_s}


@dataclass(frozen=True)
class Setup:
    """A cluster shape to predict.

    Attributes:
        servers: servers holding the dataset.
        server_cores: preprocessing workers per server.
        client_cores: preprocessing workers per rank.
        offload: share of each batch the servers preprocess (0..1; ignored without a pipeline).
        cache_fraction: share of the dataset in the servers' memory (0..1).
        rail_bytes_per_s: the rail's bandwidth to a rank.
        ranks: ranks fed at once.
        shares: per server, the dataset's bytes it holds and the bytes of them it keeps in memory
            (the allocation as it is; empty: ``servers`` equal shares keeping ``cache_fraction``).
    """

    servers: int
    server_cores: int
    client_cores: int
    offload: float
    cache_fraction: float
    rail_bytes_per_s: float
    ranks: int = 1
    shares: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 <= self.offload <= 1.0:
            raise ConfigError(f"offload must be within 0..1, got {self.offload!r}", field="offload")
        if not 0.0 <= self.cache_fraction <= 1.0:
            raise ConfigError(
                f"cache_fraction must be within 0..1, got {self.cache_fraction!r}", field="cache_fraction"
            )
        for name in ("servers", "server_cores", "client_cores", "ranks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)!r}", field=name)
        if not self.rail_bytes_per_s > 0:
            raise ConfigError(
                f"rail_bytes_per_s must be positive, got {self.rail_bytes_per_s!r}", field="rail_bytes_per_s"
            )

    @classmethod
    def measured(cls, m: Measured, offload: float, cache_fraction: float | None = None) -> Setup:
        """The shape the measurements were taken on."""
        return cls(
            servers=m.servers,
            server_cores=m.server_cores,
            client_cores=m.client_cores,
            offload=offload,
            cache_fraction=m.cache_fraction(m.servers) if cache_fraction is None else cache_fraction,
            rail_bytes_per_s=m.rail_bytes_per_s,
            ranks=m.ranks,
        )


@dataclass(frozen=True)
class Prediction:
    """Samples/s one rank gets at a setup, which term bounds it, and the stalls it leaves.

    Attributes:
        samples_per_s: the rate (the least of ``terms``).
        bound: the term that sets it (``step`` when nothing stalls the step).
        terms: every term's rate (``inf``: no limit from it).
        prep_stall: share of a sample's time spent waiting for preprocessing.
        fetch_stall: share of a sample's time spent waiting for the fetch (memory or backend).
    """

    samples_per_s: float
    bound: str
    terms: dict[str, float]
    prep_stall: float
    fetch_stall: float

    def as_dict(self) -> dict:
        return {
            "samples_per_s": self.samples_per_s,
            "bound": self.bound,
            "terms": {k: (v if math.isfinite(v) else None) for k, v in self.terms.items()},
            "prep_stall": self.prep_stall,
            "fetch_stall": self.fetch_stall,
        }


def _share(part: float, whole: float) -> float:
    return 0.0 if part <= 0 else (math.inf if whole <= 0 else part / whole)


def predict(m: Measured, s: Setup) -> Prediction:
    """The samples/s one rank gets at ``s`` (see the module docstring)."""
    pipeline = m.client_prep is not None or m.server_prep is not None
    r = s.offload if m.server_prep is not None else 0.0
    if m.client_prep is None and m.server_prep is not None:
        r = 1.0  # only the servers can preprocess (a pipeline without client stages is not a choice)
    terms: dict[str, float] = {"step": m.step}
    if m.server_prep is not None and r > 0:
        scale = (s.servers / m.servers) * (s.server_cores / m.server_cores)
        terms["server_prep"] = m.server_prep * scale / (s.ranks * r)
    else:
        terms["server_prep"] = math.inf
    if pipeline and m.client_prep is not None and r < 1:
        terms["client_prep"] = m.client_prep * (s.client_cores / m.client_cores) / (1.0 - r)
    else:
        terms["client_prep"] = math.inf
    terms["client_cpu"] = _client_cpu(m, s, r, pipeline)
    carried = r * m.out_bytes + (1.0 - r) * m.raw_bytes if pipeline else m.raw_bytes
    terms["memory"] = s.rail_bytes_per_s / carried
    # A dataset held in part keeps raw copies only of what the client preprocesses: a sample the
    # servers preprocess is read from the backend each epoch (docs/policies.md), cached or not.
    terms["backend"] = _backend(m, s, r if pipeline else 0.0)
    rate = min(terms.values())
    bound = min(terms, key=lambda k: (terms[k], k != "step"))
    prep = min(m.step, terms["server_prep"], terms["client_prep"], terms["client_cpu"])
    per_sample = 1.0 / rate
    return Prediction(
        samples_per_s=rate,
        bound=bound,
        terms=terms,
        prep_stall=_share(1.0 / prep - 1.0 / m.step, per_sample),
        fetch_stall=_share(per_sample - 1.0 / prep, per_sample),
    )


def _backend(m: Measured, s: Setup, r: float) -> float:
    """Samples/s the servers' backend reads feed a rank: each server reads its share's misses at
    the bytes/s a server reads (the share with most to read sets an epoch's pace); S scaled by the
    servers where that rate was not measured."""
    # A dataset held in part keeps raw copies only of what the client preprocesses: a sample the
    # servers preprocess is read from the backend each epoch (docs/policies.md), cached or not.
    if m.server_read_bytes_per_s <= 0 or m.dataset_bytes <= 0:
        misses = 0.0 if s.cache_fraction >= 1.0 else 1.0 - s.cache_fraction * (1.0 - r)
        return m.backend_fetch * (s.servers / m.servers) / (s.ranks * misses) if misses > 0 else math.inf
    shares = s.shares or tuple(
        (m.dataset_bytes / s.servers, s.cache_fraction * m.dataset_bytes / s.servers) for _ in range(s.servers)
    )
    most = max((held - kept * (1.0 - r) if kept < held else 0.0) for held, kept in shares)
    if most <= 0:
        return math.inf
    epoch_s = most / m.server_read_bytes_per_s
    return (m.dataset_bytes / m.raw_bytes) / (epoch_s * s.ranks)


def _client_cpu(m: Measured, s: Setup, r: float, pipeline: bool) -> float:
    """Samples/s the rank's CPUs run its step, preprocessing and receiving at split ``r``."""
    if m.client_cpus <= 0:
        return math.inf
    per_sample = m.step_cpu + ((1.0 - r) * m.local_cpu + r * m.remote_cpu if pipeline else m.remote_cpu)
    if per_sample <= 0:
        return math.inf
    return m.client_cpus * (s.client_cores / m.client_cores) / per_sample


def best_offload(m: Measured, s: Setup) -> float:
    """The offload ratio the model gives the most samples/s at (the least of the ties)."""
    if m.server_prep is None or m.client_prep is None:
        return s.offload
    ratios = [k / OFFLOAD_STEPS for k in range(OFFLOAD_STEPS + 1)]
    return max(ratios, key=lambda r: (predict(m, replace(s, offload=r)).samples_per_s, -r))


def sweep(m: Measured, base: Setup, field: str, values: list[float]) -> list[dict]:
    """Predictions with one field of ``base`` varied (a curve of the report)."""
    out = []
    for value in values:
        kind = int if field in ("servers", "server_cores", "client_cores", "ranks") else float
        changes: dict[str, Any] = {field: kind(value)}
        setup = replace(base, **changes)
        if field == "servers" and setup.servers != base.servers:  # another allocation: equal shares
            setup = replace(setup, shares=(), cache_fraction=m.cache_fraction(setup.servers))
        elif field == "cache_fraction":
            setup = replace(setup, shares=tuple((held, setup.cache_fraction * held) for held, _ in base.shares))
        point = {field: kind(value), **predict(m, setup).as_dict()}
        if field == "servers":
            point["cache_fraction"] = setup.cache_fraction
        out.append(point)
    return out


def smallest_cluster(m: Measured, base: Setup) -> dict:
    """The fewest servers (each as measured: its cores and memory, the split chosen for it) whose
    predicted rate reaches :data:`CLEAR` of the step's: the one-line answer to "what removes the
    stall", or what bounds the rate however many servers there are."""
    for servers in range(1, MAX_SERVERS + 1):
        setup = (
            base
            if servers == base.servers
            else replace(base, servers=servers, shares=(), cache_fraction=m.cache_fraction(servers))
        )
        setup = replace(setup, offload=best_offload(m, setup))
        prediction = predict(m, setup)
        if prediction.samples_per_s >= CLEAR * m.step:
            return {
                "servers": servers,
                "offload": setup.offload,
                "cache_fraction": setup.cache_fraction,
                "samples_per_s": prediction.samples_per_s,
                "removes_stall": True,
                "line": (
                    f"{servers} server(s) of {m.server_cores} worker(s) each remove the stall: "
                    f"{prediction.samples_per_s:,.0f} samples/s per rank against the step's {m.step:,.0f} "
                    f"(offload {setup.offload:.2f}, {setup.cache_fraction:.0%} of the dataset in memory)"
                ),
            }
    setup = replace(base, servers=MAX_SERVERS, shares=(), cache_fraction=m.cache_fraction(MAX_SERVERS))
    setup = replace(setup, offload=best_offload(m, setup))
    prediction = predict(m, setup)
    return {
        "servers": None,
        "offload": setup.offload,
        "cache_fraction": setup.cache_fraction,
        "samples_per_s": prediction.samples_per_s,
        "removes_stall": False,
        "line": (
            f"no number of servers removes the stall: the {prediction.bound.replace('_', ' ')} bounds a rank at "
            f"{prediction.samples_per_s:,.0f} samples/s against the step's {m.step:,.0f} "
            f"({_remedy(prediction.bound)})"
        ),
    }


def _remedy(bound: str) -> str:
    return {
        "client_prep": "more client cores, or a pipeline whose stages can run on the servers",
        "client_cpu": "more client cores, or less client work per sample (offload more, a cheaper step)",
        "memory": "a faster rail, or smaller samples on the wire (offload the stages that shrink them)",
        "backend": "a faster backend, or more memory per server",
        "server_prep": "more cores per server",
    }.get(bound, "a faster step")
