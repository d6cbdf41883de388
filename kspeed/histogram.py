"""A latency histogram with fixed bucket bounds in seconds, cheap to observe from any thread.

Prometheus aggregates histograms across ranks and time (quantiles of gauges cannot be), so the
client exports its batch waits and sub-batch latencies this way (``kspeed.client.stats``), and a
server how long grants waited for production (``kspeed.server.metrics``).
"""

from __future__ import annotations

import bisect
import threading

__all__ = ["LATENCY_BOUNDS", "Histogram"]

#: Upper bounds in seconds: 50 µs to 20 s, about three per decade.
LATENCY_BOUNDS = (
    0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0
)  # fmt: skip


class Histogram:
    """Counts of observations per bucket (``value <= bound``), their sum and their count.

    Args:
        bounds: increasing upper bounds; a last ``+Inf`` bucket catches the rest.
    """

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BOUNDS) -> None:
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        """Count one observation."""
        index = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self._counts[index] += 1
            self.sum += value
            self.count += 1

    def as_dict(self) -> dict:
        """One consistent reading: ``buckets`` (cumulative counts per upper bound, Prometheus style,
        the last one ``+Inf``), ``sum`` and ``count``."""
        with self._lock:
            counts, total_sum, count = list(self._counts), self.sum, self.count
        buckets, total = [], 0
        for bound, n in zip((*(repr(b) for b in self.bounds), "+Inf"), counts, strict=True):
            total += n
            buckets.append((bound, total))
        return {"buckets": buckets, "sum": total_sum, "count": count}
