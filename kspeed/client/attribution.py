"""Where a rank's data wait goes: each batch's wait split over causes and servers while the job runs.

The time the training loop spends inside ``next()`` is the rank's wait. Each batch's is split:

- ``failover``: from the call's start to the end of a recovery from a lost server (that server);
- ``pacing``: until the batch's last grant was sent (the ring was full, or the pacing window held it);
- the time the feed then waited for the batch's completions, split over its servers as the Shapley
  value of a wait that ends with the slowest path (the airport game): each interval between two
  completions is shared equally by the paths still owed. A lone slow server gets nearly all of it,
  equal servers split it evenly, and a server that had finished before the wait began gets nothing;
- ``client_prep``: waiting for the client's own preprocessing workers (a prepared dataset);
- ``client``: the rest of ``next()`` (delivery, copies, collation, this bookkeeping).

A server's seconds are split when figures are folded (:meth:`Attribution.snapshot`, a few times a
minute): ``production`` (its grants waited for their samples to be produced) against ``link`` (the
rest: the feeder's queue and the transfer), in the proportion of the seconds the server said its
grants of this feed waited for production (its ``HELD`` messages) to this client's own
grant-to-completion seconds on that path over the same period, clamped to [0, 1]. Production is
split further, where the server reports :class:`~kspeed.proto.kspeed_pb2.ProductionFigures`,
between ``fetch`` (its producers reading samples) and ``prep`` per stage, in the proportion of
those seconds over the last interval the reporter read them. A path with no completions in the
period stays ``server``, as does the production of a server that reports no figures
(``production`` then, unsplit).

The per-batch work is a few float operations per server owed, under one uncontended lock; its own
time is counted (``overhead_s``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kspeed.causes import CLIENT_CAUSES
from kspeed.client.tuning.meters import LoopMeter
from kspeed.errors import KSpeedError
from kspeed.proto import kspeed_pb2

__all__ = ["Attribution", "ProductionSplit", "blocked_messages", "shapley_split"]

log = logging.getLogger(__name__)

Key = tuple[str, str, str]  # cause, server, stage


def shapley_split(start: float, end: float, finished: Sequence[float]) -> list[float]:
    """Share ``[start, end]`` among paths that finished at ``finished`` (clamped into the interval):
    each interval between consecutive finishes goes equally to the paths not finished yet.

    This is the Shapley value of ``max`` over the paths' times (the airport game): a path's share
    is what it adds over the faster ones, shared with those as slow as it.
    """
    n = len(finished)
    shares = [0.0] * n
    if n == 0 or end <= start:
        return shares
    order = sorted(range(n), key=lambda i: finished[i])
    last = start
    running = 0.0  # share of each path still owed, accumulated over the intervals so far
    for k, i in enumerate(order):
        at = min(max(finished[i], start), end)
        if at > last:
            running += (at - last) / (n - k)
            last = at
        shares[i] = running
    return shares  # (time after the last completion is no path's: the caller's own)


@dataclass
class ProductionSplit:
    """How a server's production seconds divide, from two readings of its figures.

    Attributes:
        fetch: share of production spent reading samples.
        stages: share per preprocessing stage (``"<index>:<op>"``); with ``fetch``, sums to 1.
    """

    fetch: float = 0.0
    stages: dict[str, float] = field(default_factory=dict)

    @classmethod
    def between(
        cls, before: kspeed_pb2.ProductionFigures | None, after: kspeed_pb2.ProductionFigures
    ) -> ProductionSplit | None:
        """The split over the interval between two readings (``None``: nothing was produced in it)."""
        fetch = after.fetch_seconds - (before.fetch_seconds if before is not None else 0.0)
        old = dict(before.stage_seconds) if before is not None else {}
        stages = {k: v - old.get(k, 0.0) for k, v in after.stage_seconds.items()}
        stages = {k: v for k, v in stages.items() if v > 0 and math.isfinite(v)}
        fetch = fetch if fetch > 0 and math.isfinite(fetch) else 0.0
        total = fetch + sum(stages.values())
        if total <= 0:
            return None
        return cls(fetch / total, {k: v / total for k, v in stages.items()})


class Attribution:
    """One rank's wait for one dataset, by cause and server.

    The training thread calls :meth:`enter` and :meth:`leave` around ``next()`` (nested calls, a
    prepared dataset's around its inner dataset's, count once) and the pump :meth:`batch` for each
    batch; a reporter thread calls :meth:`refresh` and anyone :meth:`snapshot`.

    Args:
        servers: the server id of each path, in path order (:meth:`rename` when one changes).
        loop: the meter of the loop's step (shared with the offload tuner: measured once).
    """

    def __init__(self, servers: Sequence[str], loop: LoopMeter | None = None) -> None:
        n = len(servers)
        self.loop = loop if loop is not None else LoopMeter()
        self._servers = list(servers)
        self._lock = threading.Lock()
        self._depth = 0
        self._entered = 0.0
        self._accounted = 0.0  # seconds of the current next() given to a cause so far
        self._client: dict[str, float] = dict.fromkeys(CLIENT_CAUSES, 0.0)
        self._failover: dict[str, float] = {}  # lost server -> seconds
        self._path_s = [0.0] * n  # seconds of waits given to each path, not folded yet
        self._folded: dict[Key, float] = {}  # server seconds already split
        self._marks: list[tuple[float, float]] = [(0.0, 0.0)] * n  # (held, latency) at the last fold
        self._readings: dict[str, kspeed_pb2.ProductionFigures] = {}
        self._splits: dict[str, ProductionSplit] = {}
        self.blocked_s = 0.0
        self.overhead_s = 0.0

    # -- the training thread ---------------------------------------------------------------------

    def enter(self) -> None:
        """``next()`` was entered."""
        self._depth += 1
        if self._depth == 1:
            self.loop.asked()
            self._entered = time.monotonic()
            self._accounted = 0.0

    def leave(self, samples: int) -> None:
        """``next()`` returns (a batch of ``samples``, or 0 at the end of an epoch or on an error)."""
        self._depth -= 1
        if self._depth > 0:
            return
        self._depth = 0
        t = time.perf_counter()
        spent = time.monotonic() - self._entered
        with self._lock:
            self._client["client"] += max(spent - self._accounted, 0.0)
            self.blocked_s += spent
        self.loop.handed(samples)
        self.overhead_s += time.perf_counter() - t

    def forget_step(self) -> None:
        """The time until the next ``next()`` is no training step (an epoch ended)."""
        self.loop.forget_step()

    def client_prep(self, seconds: float) -> None:
        """Seconds ``next()`` waited for the client's preprocessing workers."""
        if self._depth > 0:
            with self._lock:
                self._client["client_prep"] += seconds
            self._accounted += seconds

    def batch(
        self,
        started: float,
        waited_from: float,
        sent_at: float,
        finished: Mapping[int, float],
        ended: float,
        recovered: tuple[float, str] | None = None,
    ) -> None:
        """One batch's wait in the pump (monotonic times).

        Args:
            started: the pump was asked for the batch.
            waited_from: the feed began waiting for its completions (the last time, after a recovery).
            sent_at: its last grant went to a server.
            finished: per path index it was owed by, when that path's last completion for it came.
            ended: it was complete.
            recovered: the end of a recovery from a lost server during the call, and that server.
        """
        t = time.perf_counter()
        begin = started
        with self._lock:
            if recovered is not None:
                until, server = recovered
                seconds = max(min(until, ended) - started, 0.0)
                self._failover[server] = self._failover.get(server, 0.0) + seconds
                self._accounted += seconds
                begin = max(begin, until)
            pacing = max(min(sent_at, ended) - begin, 0.0)
            self._client["pacing"] += pacing
            self._accounted += pacing
            start = max(begin, sent_at, waited_from)
            if finished and ended > start:
                paths = list(finished)
                shares = shapley_split(start, ended, [finished[i] for i in paths])
                for i, share in zip(paths, shares, strict=True):
                    if i < len(self._path_s):
                        self._path_s[i] += share
                        self._accounted += share
        self.overhead_s += time.perf_counter() - t

    # -- servers' figures (the reporter's thread) ------------------------------------------------

    def rename(self, servers: Sequence[str]) -> None:
        """The paths' servers now (a share moved); seconds not folded yet go to the new ones."""
        with self._lock:
            self._servers = list(servers)

    def refresh(self, read: Callable[[str], kspeed_pb2.ProductionFigures | None]) -> None:
        """Read every server's production figures (``read(server)``; ``None`` or an error: keep
        the last split) and update the split of their production seconds."""
        with self._lock:
            servers = list(dict.fromkeys(self._servers))
        for server in servers:
            try:
                figures = read(server)
            except (KSpeedError, ValueError) as exc:  # unreachable, or its channel closed by a failover
                log.debug("no production figures from %s: %s", server, exc)
                continue
            if figures is None:
                continue
            split = ProductionSplit.between(self._readings.get(server), figures)
            with self._lock:
                self._readings[server] = figures
                if split is not None:
                    self._splits[server] = split

    # -- reading ---------------------------------------------------------------------------------

    def snapshot(self, held: Sequence[float], latency: Sequence[float]) -> dict[Key, float]:
        """Seconds per (cause, server, stage) since the start, splitting the server seconds given
        since the last call with ``held`` and ``latency``, the feed's cumulative per-path seconds
        of grants held for production and of grant-to-completion."""
        t = time.perf_counter()
        with self._lock:
            for i, seconds in enumerate(self._path_s):
                if i >= len(self._servers) or i >= len(held) or i >= len(latency):
                    continue
                server = self._servers[i]
                h0, l0 = self._marks[i]
                dh, dl = held[i] - h0, latency[i] - l0
                self._path_s[i] = 0.0
                if dl > 0:
                    self._marks[i] = (held[i], latency[i])
                if seconds <= 0:
                    continue
                if dl <= 0:  # no completion timed since the last fold: not split
                    self._add(("server", server, ""), seconds)
                    continue
                produced = seconds * min(max(dh / dl, 0.0), 1.0)
                self._add(("link", server, ""), seconds - produced)
                split = self._splits.get(server)
                if split is None:
                    self._add(("production", server, ""), produced)
                    continue
                self._add(("fetch", server, ""), produced * split.fetch)
                for stage, share in split.stages.items():
                    self._add(("prep", server, stage[:64]), produced * share)
            out = dict(self._folded)
            for cause, seconds in self._client.items():
                out[(cause, "", "")] = seconds
            for server, seconds in self._failover.items():
                out[("failover", server, "")] = seconds
        self.overhead_s += time.perf_counter() - t
        return out

    def _add(self, key: Key, seconds: float) -> None:
        if seconds > 0:
            self._folded[key] = self._folded.get(key, 0.0) + seconds

    @property
    def step_s(self) -> float:
        """Seconds the loop spent outside ``next()``, the training step (the loop meter's)."""
        return self.loop.step_total_s

    def figures(self, held: Sequence[float], latency: Sequence[float]) -> dict[str, Any]:
        """``ds.stats()["attribution"]``: seconds by cause, by server and cause, every row, the
        wait and step totals and the bookkeeping's own seconds."""
        rows = self.snapshot(held, latency)
        causes: dict[str, float] = {}
        by_server: dict[str, dict[str, float]] = {}
        for (cause, server, _), seconds in rows.items():
            causes[cause] = causes.get(cause, 0.0) + seconds
            if server:
                mine = by_server.setdefault(server, {})
                mine[cause] = mine.get(cause, 0.0) + seconds
        return {
            "blocked_s": self.blocked_s,
            "step_s": self.step_s,
            "causes": causes,
            "by_server": by_server,
            "rows": [{"cause": c, "server": s, "stage": st, "seconds": v} for (c, s, st), v in sorted(rows.items())],
            "overhead_s": self.overhead_s,
        }


def blocked_messages(figures: Mapping[str, Any]) -> list[kspeed_pb2.BlockedSeconds]:
    """The rows of :meth:`Attribution.figures` as report fields."""
    return [
        kspeed_pb2.BlockedSeconds(cause=r["cause"], server=r["server"], stage=r["stage"], seconds=r["seconds"])
        for r in figures.get("rows", ())
    ]
