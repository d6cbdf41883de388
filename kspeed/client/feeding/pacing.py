"""Pacing: how many bytes may be on their way into the ring, and which server may send them.

Many servers answering one client at once overrun the last link (or the PCIe path) towards it:
the switch queue fills, packets drop, and the batch the training loop waits for is stuck behind
bytes of batches it needs much later (incast). The client therefore grants in **sub-batches** and
keeps the bytes granted but not yet completed within a **window** (docs/feeding.md, Pacing):

- A **latency table** per server and size class (32 KiB, 256 KiB, 1 MiB, 4 MiB) holds how long a
  grant of that size takes from sending it to its completion. It is measured at connect by probe
  grants and refreshed from live completions: a sub-batch sent while nothing else was in flight
  is a clean sample and moves the entry (a moving average), and a faster sample moves it down
  too. Slower samples taken behind other grants are left out: they would feed the window's own
  queueing back into it.
- The **drain rate** is the delivery rate of the ring (bytes completed per second), estimated
  much as BBR does: each completion yields a sample (the bytes completed over the last
  :data:`RATE_SPAN`), and the estimate is the largest sample of the last :data:`RATE_WINDOW`
  seconds, so it follows a slower link within about that long. Samples taken while the client
  had nothing more to send (app-limited) can only raise it. Before the first samples it is the
  probed rate divided by the loading processes of the node, which share the link.
- A **sub-batch** is the share of one server in one slice of a batch, sized so one round over the
  servers drains in :attr:`Pacer.round_s` at the drain rate (never less than one sample).
- The **window** is Little's law with headroom: to deliver at the drain rate, each server needs its
  share of the rate times its latency in flight; the window is :data:`GAIN` times the sum (and at
  least one round). It shrinks and grows with the drain rate.
- A grant that waited at its server for its samples to be produced (read from the backend) is
  named by the server with the wait (``HELD``, :mod:`kspeed.grants`); only the rest of its latency
  is the path's.
- **Credit** splits the window between servers. ``adaptive`` gives each server its share of the
  demand times its latency, so a slower server is granted further ahead and one slow server does
  not make its ranks stragglers (the push-model form of Lobster's load balancing); ``equal``
  gives every server the same bytes.

A grant goes while the bytes in flight are below the window and its server's credit, so a window
smaller than one sample still lets one through and a window of a few samples is not left unused
for want of exact fit; grants are sent in the order they were made across servers, so nothing
starves. The pacer does no I/O:
:class:`kspeed.client.feeding.feed.Feed` asks it what to send and tells it what completed.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass

import numpy as np

from kspeed.grants import Grant
from kspeed.histogram import Histogram

__all__ = ["GAIN", "SIZE_CLASSES", "DrainRate", "LatencyTable", "Pacer", "SubGrant"]

SIZE_CLASSES = (32 << 10, 256 << 10, 1 << 20, 4 << 20)
GAIN = 2.0  # bytes in flight per byte the latency needs, so jitter does not idle the link
RATE_WINDOW = 1.0  # seconds of delivery-rate samples the drain rate is the maximum of
RATE_SPAN = 0.1  # seconds each delivery-rate sample averages over; also one phase of the gain cycle
STARTUP_GAIN = 2.89  # 2/ln 2: doubles what is delivered per round trip until the rate stops growing (BBR)
CYCLE = (1.25, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)  # the probing cycle's phases, multiplying GAIN
CLEAN_WEIGHT = 0.25  # weight of a clean live sample in its latency-table entry
RECENT = 4096  # sub-batch latencies kept for percentiles
SUSPECT = 2.0  # a completion slower than this times its estimate may have waited for production
HELD_GRACE = 0.05  # seconds a suspect completion waits for the HELD that names its wait


class LatencyTable:
    """Seconds from sending a grant to its completion, per size class, for one server's path."""

    def __init__(self) -> None:
        self.seconds = np.full(len(SIZE_CLASSES), np.nan)

    @staticmethod
    def size_class(nbytes: int) -> int:
        """Index of the class nearest ``nbytes`` on a log scale."""
        logs = np.log2(np.asarray(SIZE_CLASSES, dtype=np.float64))
        return int(np.argmin(np.abs(logs - math.log2(max(nbytes, 1)))))

    def set(self, index: int, seconds: float) -> None:
        """A probed entry."""
        self.seconds[index] = seconds

    def observe(self, nbytes: int, seconds: float, clean: bool) -> None:
        """A live sample moves its class's entry by :data:`CLEAN_WEIGHT` if it was clean or is faster.

        An average, not a minimum: the window must cover the typical latency of an idle path
        (which on a busy host includes waiting for a core), or a window sized from a lucky minimum
        delivers less than the rate it was sized from and the rate estimate spirals down.
        """
        index = self.size_class(nbytes)
        current = self.seconds[index]
        if math.isnan(current):
            self.seconds[index] = seconds
        elif clean or seconds < current:
            self.seconds[index] = current + CLEAN_WEIGHT * (seconds - current)

    def estimate(self, nbytes: int) -> float:
        """Latency of a grant of ``nbytes``: linear between known classes, extended along the end segments.

        Returns NaN while nothing is known.
        """
        known = ~np.isnan(self.seconds)
        if not known.any():
            return math.nan
        sizes = np.asarray(SIZE_CLASSES, dtype=np.float64)[known]
        secs = self.seconds[known]
        if len(sizes) == 1:
            return float(secs[0])
        if nbytes <= sizes[0]:
            return float(secs[0])
        if nbytes >= sizes[-1]:
            slope = max((secs[-1] - secs[-2]) / (sizes[-1] - sizes[-2]), 0.0)
            return float(secs[-1] + slope * (nbytes - sizes[-1]))
        return float(np.interp(nbytes, sizes, secs))

    def as_dict(self) -> dict[str, float | None]:
        return {_label(size): (None if math.isnan(s) else float(s)) for size, s in zip(SIZE_CLASSES, self.seconds)}


def _label(size: int) -> str:
    return f"{size >> 20}MiB" if size >= 1 << 20 else f"{size >> 10}KiB"


class DrainRate:
    """The ring's delivery rate: the largest rate sample of the last ``window`` seconds.

    A sample is the bytes completed over about the last ``span`` seconds (completions arrive in
    bursts, so a shorter interval would measure the bursts). It only counts once the client has been
    sending for a whole span, and a sample taken while the client had nothing more to send
    (app-limited) may raise the estimate but never lower it.

    Args:
        window: seconds a sample counts.
        span: seconds each sample averages over.
        initial: the estimate before any sample (bytes/s).
    """

    def __init__(self, window: float = RATE_WINDOW, span: float = RATE_SPAN, initial: float = 0.0) -> None:
        self.window = window
        self.span = span
        self._done: collections.deque[tuple[float, int]] = collections.deque()  # (time, bytes) of recent completions
        self._in_span = 0
        self._busy_since: float | None = None
        self._samples: collections.deque[tuple[float, float]] = collections.deque()  # (time, rate), decreasing
        self._last = initial

    def on_send(self, idle: bool, now: float) -> None:
        """A grant is sent; ``idle``: nothing was in flight, so a new busy period starts now."""
        if idle or self._busy_since is None:
            self._busy_since = now
            self._done.clear()
            self._in_span = 0

    def on_complete(self, nbytes: int, app_limited: bool, now: float) -> None:
        """A grant of ``nbytes`` completed at ``now``."""
        self._done.append((now, nbytes))
        self._in_span += nbytes
        while self._done[0][0] < now - self.span:
            self._in_span -= self._done.popleft()[1]
        first_at, first_bytes = self._done[0]
        if self._busy_since is None or now - self._busy_since < self.span or now - first_at < self.span / 2:
            return
        rate = (self._in_span - first_bytes) / (now - first_at)  # what arrived after the first, over the time since
        if app_limited and rate < self.value(now):
            return
        while self._samples and self._samples[-1][1] <= rate:
            self._samples.pop()
        self._samples.append((now, rate))

    def value(self, now: float | None = None) -> float:
        """Bytes per second (the last estimate is kept while no sample is recent)."""
        now = time.monotonic() if now is None else now
        while len(self._samples) > 1 and self._samples[0][0] < now - self.window:
            self._samples.popleft()
        if self._samples:
            self._last = self._samples[0][1]
        return self._last


@dataclass(eq=False)
class SubGrant:
    """One grant waiting for the window, or on its way.

    Attributes:
        path: the index of the server it is for.
        order: when it was made, across servers (grants are released in this order).
        grant: the grant itself.
        nbytes: the bytes that server writes for it.
    """

    path: int
    order: int
    grant: Grant
    nbytes: int
    sent_at: float = 0.0
    clean: bool = False
    app_limited: bool = False


class Pacer:
    """The window, the sub-batch size, the per-server credit and the queues of unsent grants.

    Args:
        paths: number of servers (path indices ``0..paths-1``).
        credit: ``"adaptive"`` (latency-weighted) or ``"equal"``.
        node_loaders: processes on this node loading data at once (they share its link).
        round_s: seconds one round of sub-batches over all servers should take at the drain rate.
    """

    def __init__(self, paths: int, *, credit: str = "adaptive", node_loaders: int = 1, round_s: float = 0.003) -> None:
        self.tables = [LatencyTable() for _ in range(paths)]
        self.credit = credit
        self.node_loaders = max(1, node_loaders)
        self.round_s = round_s
        self.rate = DrainRate()
        self.pending: list[collections.deque[SubGrant]] = [collections.deque() for _ in range(paths)]
        self.pending_bytes = [0] * paths
        self.in_flight_bytes = [0] * paths
        self.in_flight = 0
        self.window = 0
        self.sub_batch = 0
        self._credits = [0.0] * paths
        self.mode = "startup"
        self._phase = 0
        self._phase_started = time.monotonic()
        self._plateau = 0.0
        self._flat = 0
        self._limited = False
        self._latencies: collections.deque[float] = collections.deque(maxlen=RECENT)
        self.latency_histogram = Histogram()
        self.sent = 0
        self.completed = 0
        self._held: collections.OrderedDict[int, float] = collections.OrderedDict()  # tag -> production wait
        # slow completions waiting for their HELD: tag -> (grant, raw latency, completed at)
        self._unsettled: collections.OrderedDict[int, tuple[SubGrant, float, float]] = collections.OrderedDict()
        self.held_s = 0.0  # seconds grants waited at servers for production (left out of latencies)

    # -- the model -------------------------------------------------------------------------------

    def seed(self, probed_rate: float) -> None:
        """Start from the rate the probes measured, shared by the node's loading processes."""
        self.rate = DrainRate(initial=max(probed_rate, 0.0) / self.node_loaders)
        self.update()

    def _latency(self, path: int, nbytes: int) -> float:
        value = self.tables[path].estimate(nbytes)
        if math.isnan(value):
            known = [t.estimate(nbytes) for t in self.tables]
            known = [k for k in known if not math.isnan(k)]
            value = float(np.median(known)) if known else self.round_s
        return value

    def update(self, now: float | None = None) -> None:
        """Recompute the sub-batch size, the window and the credits from the current estimates."""
        now = time.monotonic() if now is None else now
        rate = self.rate.value(now)
        gain = self._gain(now, rate)
        demand = [p + f for p, f in zip(self.pending_bytes, self.in_flight_bytes)]
        total = sum(demand)
        active = [i for i, d in enumerate(demand) if d] or list(range(len(self.tables)))
        share = {i: (demand[i] / total if total else 1.0 / len(active)) for i in active}
        self.sub_batch = max(1, int(rate * self.round_s / len(active)))
        need = {i: rate * share[i] * self._latency(i, self.sub_batch) for i in active}
        self.window = max(1, int(gain * max(sum(need.values()), rate * self.round_s)))
        credits = [0.0] * len(self.tables)
        if self.credit == "equal":
            credits = [self.window / len(self.tables)] * len(self.tables)
        else:
            weight = sum(need.values())
            for i in active:
                credits[i] = max(1.0, self.window * (need[i] / weight if weight > 0 else share[i]))
        self._credits = credits

    def _gain(self, now: float, rate: float) -> float:
        """The window's gain: :data:`STARTUP_GAIN` until the drain rate stops growing, then a probing cycle.

        As in BBR, a window sized from the measured rate can only measure what it lets through, so
        one phase of each cycle lets 25% more through (a faster path shows as a higher rate, which
        the maximum keeps) and the next drains what that queued. Phases are :data:`RATE_SPAN` long;
        only phases in which grants waited for the window count towards leaving start-up.
        """
        if now - self._phase_started >= RATE_SPAN:
            self._phase_started = now
            if self.mode == "startup":
                if rate >= self._plateau * 1.25:
                    self._plateau, self._flat = rate, 0
                elif self._limited:
                    self._flat += 1
                    if self._flat >= 3:
                        self.mode = "probe"
            else:
                self._phase = (self._phase + 1) % len(CYCLE)
            self._limited = False
        return STARTUP_GAIN if self.mode == "startup" else GAIN * CYCLE[self._phase]

    # -- sub-batches -----------------------------------------------------------------------------

    def split(self, offsets: np.ndarray, lengths: np.ndarray, owners: int) -> list[int]:
        """Cut points (positions within a batch) into slices of about ``sub_batch`` bytes per server.

        ``offsets``/``lengths`` are the batch's samples; ``owners`` how many servers write in it.
        """
        if not len(lengths):
            return [0, 0]
        ends = offsets + lengths
        total = int(ends[-1])
        target = max(self.sub_batch, 1) * max(owners, 1)
        pieces = min(len(lengths), -(-total // target))
        if pieces <= 1:
            return [0, len(lengths)]
        marks = np.searchsorted(ends, np.arange(1, pieces) * (total / pieces), side="left") + 1
        return [0, *sorted(set(int(m) for m in marks if 0 < m < len(lengths))), len(lengths)]

    def queue(self, grant: SubGrant) -> None:
        self.pending[grant.path].append(grant)
        self.pending_bytes[grant.path] += grant.nbytes

    def drop(self, path: int) -> list[SubGrant]:
        """Forget a fenced path's unsent grants (returned) and its bytes in flight."""
        dropped = list(self.pending[path])
        self.pending[path].clear()
        self.pending_bytes[path] = 0
        self.in_flight -= self.in_flight_bytes[path]
        self.in_flight_bytes[path] = 0
        return dropped

    def release(self, now: float | None = None) -> list[SubGrant]:
        """The grants to send now, in grant order across servers, within the window and each server's credit."""
        now = time.monotonic() if now is None else now
        self.update(now)
        out: list[SubGrant] = []
        heads = [i for i, q in enumerate(self.pending) if q]
        while heads:
            path = min(heads, key=lambda i: self.pending[i][0].order)
            grant = self.pending[path][0]
            # Like a congestion window counted in packets: a grant goes while the bytes in flight are
            # below the window (and the server's credit), so they exceed it by less than one grant.
            if self.in_flight >= self.window or self.in_flight_bytes[path] >= self._credits[path]:
                self._limited = True
                heads.remove(path)
                continue
            self.pending[path].popleft()
            self.pending_bytes[path] -= grant.nbytes
            grant.clean = self.in_flight == 0  # sent into an idle pipe: its latency has no queueing in it
            self.rate.on_send(self.in_flight == 0, now)
            grant.sent_at = now
            self.in_flight_bytes[path] += grant.nbytes
            self.in_flight += grant.nbytes
            out.append(grant)
            if not self.pending[path]:
                heads.remove(path)
        for grant in out:  # app-limited: the window had room the client could not fill
            grant.app_limited = not any(self.pending) and self.in_flight < self.window
        self.sent += len(out)
        return out

    def complete(self, grant: SubGrant, now: float | None = None) -> None:
        """A sent grant's completion (or error) arrived.

        Its latency is the path's once the server's HELD wait (if any) is taken out. A HELD travels
        on the message path and may come just after the completion: a completion slower than
        :data:`SUSPECT` times its path's estimate, with no HELD yet, is observed only once its HELD
        comes or :data:`HELD_GRACE` seconds pass.
        """
        now = time.monotonic() if now is None else now
        self.in_flight_bytes[grant.path] -= grant.nbytes
        self.in_flight -= grant.nbytes
        self.rate.on_complete(grant.nbytes, grant.app_limited, now)
        self.completed += 1
        raw = now - grant.sent_at
        tag = grant.grant.tag if isinstance(grant.grant, Grant) else None
        if tag is not None and tag in self._held:
            self._observe(grant, raw - self._held.pop(tag))
        elif tag is not None and not raw <= SUSPECT * self._latency(grant.path, grant.nbytes):
            self._unsettled[tag] = (grant, raw, now)
        else:
            self._observe(grant, raw)
        self._settle(now)

    def _observe(self, grant: SubGrant, latency: float) -> None:
        latency = max(latency, 0.0)  # the path's part: a backend wait is not latency
        self.tables[grant.path].observe(grant.nbytes, latency, grant.clean)
        self._latencies.append(latency)
        self.latency_histogram.observe(latency)

    def _settle(self, now: float) -> None:
        """Observe the slow completions whose HELD did not come within :data:`HELD_GRACE`."""
        while self._unsettled:
            tag, (grant, raw, at) = next(iter(self._unsettled.items()))
            if now - at < HELD_GRACE:
                break
            del self._unsettled[tag]
            self._observe(grant, raw)

    def held(self, tags: np.ndarray, seconds: np.ndarray, now: float | None = None) -> None:
        """Servers' word that these grants (by tag) waited for production this long: their
        completions count only the rest as latency (a server reading from a slow backend is not a
        slow path, and adaptive credit must not grant it further ahead for that)."""
        for tag, wait in zip(tags.tolist(), seconds.tolist(), strict=True):
            self.held_s += float(wait)
            waiting = self._unsettled.pop(int(tag), None)
            if waiting is not None:  # its completion came first
                self._observe(waiting[0], waiting[1] - float(wait))
            else:
                self._held[int(tag)] = float(wait)
        while len(self._held) > RECENT:  # tags whose completion never came (a fenced path)
            self._held.popitem(last=False)
        self._settle(time.monotonic() if now is None else now)

    @property
    def backlog(self) -> bool:
        """True while grants wait for the window or are in flight."""
        return self.in_flight > 0 or any(self.pending)

    def stats(self) -> dict:
        """Window, sub-batch size, bytes in flight, drain rate, latency tables and recent sub-batch latencies."""
        lat = np.asarray(self._latencies, dtype=np.float64) * 1e3
        tables = [t.as_dict() for t in self.tables]
        merged = {}
        for label in tables[0] if tables else ():
            values = [v for t in tables if (v := t[label]) is not None]
            merged[label] = float(np.median(values)) if values else None
        return {
            "window_bytes": self.window,
            "sub_batch_bytes": self.sub_batch,
            "in_flight_bytes": self.in_flight,
            "drain_rate": self.rate.value(),
            "mode": self.mode,
            "credit": self.credit,
            "node_loaders": self.node_loaders,
            "credits": [int(c) for c in self._credits],
            "latency": merged,
            "latency_by_server": tables,
            "sub_batches_sent": self.sent,
            "sub_batches_completed": self.completed,
            "held_by_production_s": self.held_s,
            "sub_batch_latency_p50_ms": float(np.percentile(lat, 50)) if len(lat) else 0.0,
            "sub_batch_latency_p99_ms": float(np.percentile(lat, 99)) if len(lat) else 0.0,
            "sub_batch_latency_seconds": self.latency_histogram.as_dict(),
        }
