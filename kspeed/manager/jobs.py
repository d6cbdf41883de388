"""Per-rank statistics of running jobs: the stragglers of a job, and where their waits go.

Every rank of a training job reports its data wait, throughput and per-server contribution every
few seconds (``ReportStats``), with its wait split by cause (docs/analyze.md, Attribution while a
job runs); the manager keeps the latest report per (job, rank, dataset) as soft state, forgets
ranks that stopped reporting, and answers with the spread across ranks and the job's wait summed
by cause and server (``GetJobStats``, ``kspeed status --job``).

It also keeps each rank's last :data:`HISTORY` reports' cumulative figures, per cause summed over
servers, for ``kspeed status --job J --plot``: a fixed array of ``HISTORY x (3 + causes)`` floats
per (job, rank, dataset), about 23 KB, forgotten with the rank.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import numpy as np

from kspeed import names
from kspeed.causes import CAUSES
from kspeed.errors import NotFoundError, ProtocolError
from kspeed.proto import kspeed_pb2

MAX_RANKS = 1 << 16
MAX_SERVERS_PER_REPORT = 4096
MAX_BLOCKED_ROWS = 1024  # (cause, server, stage) rows in one report
MAX_STAGE = 64  # characters of a stage's name
HISTORY = 240  # reports kept per rank for plots: 20 minutes at the default 5 s interval
REPORT_TTL = 120.0  # a rank silent this long is forgotten
#: The real-valued figures of a report (each a finite, non-negative number).
_FIGURES = ("elapsed_s", "wait_total_s", "wait_mean_ms", "wait_p50_ms", "wait_p99_ms", "wait_max_ms", "step_s")
_CAUSE = {cause: k for k, cause in enumerate(CAUSES)}
_COLUMNS = 3 + len(CAUSES)  # report time, wait total, step, then seconds per cause


class _History:
    """The last :data:`HISTORY` reports of one rank, as rows of cumulative figures (a ring)."""

    def __init__(self) -> None:
        self.rows = np.zeros((HISTORY, _COLUMNS), dtype=np.float64)
        self.count = 0

    def add(self, stats: kspeed_pb2.RankStats) -> None:
        row = self.rows[self.count % HISTORY]
        row[:] = 0.0
        row[0], row[1], row[2] = stats.report_unix, stats.wait_total_s, stats.step_s
        for b in stats.blocked:
            row[3 + _CAUSE[b.cause]] += b.seconds
        self.count += 1

    def message(self, rank: int, dataset: str) -> kspeed_pb2.RankHistory:
        n = min(self.count, HISTORY)
        order = [(self.count - n + k) % HISTORY for k in range(n)]
        samples = []
        for row in self.rows[order].tolist():
            blocked = [
                kspeed_pb2.BlockedSeconds(cause=cause, seconds=row[3 + k])
                for k, cause in enumerate(CAUSES)
                if row[3 + k]
            ]
            samples.append(
                kspeed_pb2.RankSample(report_unix=row[0], wait_total_s=row[1], step_s=row[2], blocked=blocked)
            )
        return kspeed_pb2.RankHistory(rank=rank, dataset=dataset, samples=samples)


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
        self._history: dict[tuple[str, int, str], _History] = {}
        self._lock = threading.RLock()  # reports arrive on the event loop, /metrics is read from threads

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
        _check_blocked(stats)
        with self._lock:
            kept = kspeed_pb2.RankStats()
            kept.CopyFrom(stats)
            kept.report_unix = self._wall()
            key = (stats.job, stats.rank, stats.dataset)
            self._reports.pop(key, None)  # to the end: the dict stays in the order of the reports' arrival
            self._reports[key] = kept
            history = self._history.get(key)
            if history is None:
                history = self._history[key] = _History()
            history.add(kept)
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
            self._history.pop(key, None)

    def jobs(self) -> list[str]:
        """Names of the jobs that reported recently."""
        with self._lock:
            self._expire()
            return sorted({job for job, _, _ in self._reports})

    def job(self, name: str, history: bool = False) -> kspeed_pb2.JobStats:
        """Every rank of ``name``, the spread of their figures and their waits summed by cause and
        server; with ``history``, each rank's recent reports too.

        Raises:
            NotFoundError: no rank of that job reported recently (the known jobs are listed).
        """
        with self._lock:
            self._expire()
            ranks = [v for (job, _, _), v in sorted(self._reports.items()) if job == name]
            if not ranks:
                raise NotFoundError(
                    f"no recent statistics for job {name!r} (jobs reporting: "
                    f"{', '.join(self.jobs()) or 'none'}); ranks report every few seconds while "
                    "they iterate, under the name set by KSPEED_JOB"
                )
            rate = np.array([r.samples / r.elapsed_s if r.elapsed_s > 0 else 0.0 for r in ranks])
            out = kspeed_pb2.JobStats(
                job=name,
                ranks=ranks,
                wait_mean_ms=_spread(np.array([r.wait_mean_ms for r in ranks])),
                wait_p99_ms=_spread(np.array([r.wait_p99_ms for r in ranks])),
                samples_per_s=_spread(rate),
                blocked=[
                    kspeed_pb2.JobBlocked(cause=cause, server=server, seconds=seconds)
                    for (cause, server), seconds in sorted(blocked_by_cause(ranks).items())
                ],
            )
            if history:
                out.history.extend(
                    h.message(rank, dataset) for (job, rank, dataset), h in sorted(self._history.items()) if job == name
                )
            return out

    def steps(self) -> dict[str, float]:
        """Every job's step seconds summed over its ranks."""
        with self._lock:
            self._expire()
            out: dict[str, float] = {}
            for (job, _, _), report in self._reports.items():
                out[job] = out.get(job, 0.0) + report.step_s
            return out

    def blocked(self) -> dict[tuple[str, str, str], float]:
        """Every job's wait summed over its ranks, per (job, cause, server) (the manager's metrics)."""
        with self._lock:
            self._expire()
            out: dict[tuple[str, str, str], float] = {}
            for (job, _, _), report in self._reports.items():
                for b in report.blocked:
                    key = (job, b.cause, b.server)
                    out[key] = out.get(key, 0.0) + b.seconds
            return out


def blocked_by_cause(ranks: list[kspeed_pb2.RankStats]) -> dict[tuple[str, str], float]:
    """The ranks' waits summed per (cause, server)."""
    out: dict[tuple[str, str], float] = {}
    for r in ranks:
        for b in r.blocked:
            out[(b.cause, b.server)] = out.get((b.cause, b.server), 0.0) + b.seconds
    return out


def _check_blocked(stats: kspeed_pb2.RankStats) -> None:
    """Refuse a report whose wait by cause is malformed: too many rows, an unknown cause, a server
    or stage that is no name, seconds that are not a finite non-negative number."""
    where = f"job {stats.job!r}: report of rank {stats.rank}"
    if len(stats.blocked) > MAX_BLOCKED_ROWS:
        raise ProtocolError(f"{where} has {len(stats.blocked)} blocked rows (at most {MAX_BLOCKED_ROWS})")
    for b in stats.blocked:
        if b.cause not in _CAUSE:
            raise ProtocolError(f"{where} names an unknown cause {b.cause[:40]!r} (known: {', '.join(CAUSES)})")
        if b.server:
            names.SERVER_ID.check(b.server)
        if len(b.stage) > MAX_STAGE or not b.stage.isprintable():
            raise ProtocolError(f"{where} names a stage that is no printable name of at most {MAX_STAGE} characters")
        if not (math.isfinite(b.seconds) and b.seconds >= 0):
            raise ProtocolError(f"{where} has {b.cause} seconds that are not a finite non-negative number")
