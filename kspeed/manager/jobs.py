"""Per-rank statistics of running jobs: the stragglers of a job, made visible in one place.

Every rank of a training job reports its data wait, throughput and per-server contribution every
few seconds (``ReportStats``); the manager keeps the latest report per (job, rank, dataset) as soft
state, forgets ranks that stopped reporting, and answers with the spread across ranks
(``GetJobStats``, ``kspeed status --job``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from kspeed import names
from kspeed.errors import NotFoundError, ProtocolError
from kspeed.proto import kspeed_pb2

MAX_RANKS = 1 << 16
MAX_SERVERS_PER_REPORT = 4096
REPORT_TTL = 120.0  # a rank silent this long is forgotten
#: The real-valued figures of a report (each a finite, non-negative number).
_FIGURES = ("elapsed_s", "wait_total_s", "wait_mean_ms", "wait_p50_ms", "wait_p99_ms", "wait_max_ms")


def _spread(values: np.ndarray) -> kspeed_pb2.Spread:
    if not len(values):
        return kspeed_pb2.Spread()
    return kspeed_pb2.Spread(
        min=float(values.min()),
        max=float(values.max()),
        p50=float(np.percentile(values, 50)),
        p99=float(np.percentile(values, 99)),
    )


class JobBoard:
    """The latest report of every rank of every job."""

    def __init__(self, wall: Callable[[], float] = time.time, ttl: float = REPORT_TTL) -> None:
        self._wall = wall
        self._ttl = ttl
        self._reports: dict[tuple[str, int, str], kspeed_pb2.RankStats] = {}

    def report(self, stats: kspeed_pb2.RankStats) -> None:
        """Keep a rank's report.

        Raises:
            ProtocolError: a malformed report (job or dataset name, rank, sizes, a figure that is
                negative, infinite or NaN).
        """
        names.JOB.check(stats.job)
        if stats.world_size > MAX_RANKS or stats.rank >= max(stats.world_size, 1):
            raise ProtocolError(f"job {stats.job!r}: rank {stats.rank} of world size {stats.world_size} is invalid")
        if len(stats.server_bytes) > MAX_SERVERS_PER_REPORT or len(stats.dataset) > 128 or len(stats.host) > 256:
            raise ProtocolError(f"job {stats.job!r}: report of rank {stats.rank} is too large")
        if stats.dataset:
            names.DATASET.check(stats.dataset)
        for server in stats.server_bytes:
            names.SERVER_ID.check(server)
        if not stats.host.isprintable():
            raise ProtocolError(f"job {stats.job!r}: rank {stats.rank} names its host with control characters")
        bad = [f for f in _FIGURES if not (math.isfinite(getattr(stats, f)) and getattr(stats, f) >= 0)]
        if bad:
            raise ProtocolError(
                f"job {stats.job!r}: report of rank {stats.rank} has {', '.join(bad)} that is not a finite "
                "non-negative number"
            )
        kept = kspeed_pb2.RankStats()
        kept.CopyFrom(stats)
        kept.report_unix = self._wall()
        key = (stats.job, stats.rank, stats.dataset)
        self._reports.pop(key, None)  # to the end: the dict stays in the order of the reports' arrival
        self._reports[key] = kept
        self._expire()

    def _expire(self) -> None:
        """Forget the reports older than the TTL: the oldest are first, so this looks only at the
        expired ones and one more (scanning every report on every report was quadratic in ranks)."""
        cutoff = self._wall() - self._ttl
        while self._reports:
            key, oldest = next(iter(self._reports.items()))
            if oldest.report_unix >= cutoff:
                return
            del self._reports[key]

    def jobs(self) -> list[str]:
        """Names of the jobs that reported recently."""
        self._expire()
        return sorted({job for job, _, _ in self._reports})

    def job(self, name: str) -> kspeed_pb2.JobStats:
        """Every rank of ``name`` and the spread of their figures.

        Raises:
            NotFoundError: no rank of that job reported recently (the known jobs are listed).
        """
        self._expire()
        ranks = [v for (job, _, _), v in sorted(self._reports.items()) if job == name]
        if not ranks:
            raise NotFoundError(
                f"no recent statistics for job {name!r} (jobs reporting: "
                f"{', '.join(self.jobs()) or 'none'}); ranks report every few seconds while "
                "they iterate, under the name set by KSPEED_JOB"
            )
        rate = np.array([r.samples / r.elapsed_s if r.elapsed_s > 0 else 0.0 for r in ranks])
        return kspeed_pb2.JobStats(
            job=name,
            ranks=ranks,
            wait_mean_ms=_spread(np.array([r.wait_mean_ms for r in ranks])),
            wait_p99_ms=_spread(np.array([r.wait_p99_ms for r in ranks])),
            samples_per_s=_spread(rate),
        )
