"""The client's latency histogram: cumulative buckets Prometheus can aggregate."""

from __future__ import annotations

import threading

from kspeed.histogram import Histogram


def test_buckets_are_cumulative_with_inclusive_upper_bounds():
    h = Histogram((0.001, 0.01, 0.1))
    for value in (0.0005, 0.001, 0.005, 0.5, 2.0):
        h.observe(value)
    figures = h.as_dict()
    assert figures["buckets"] == [("0.001", 2), ("0.01", 3), ("0.1", 3), ("+Inf", 5)]
    assert figures["count"] == 5 and abs(figures["sum"] - 2.5065) < 1e-12


def test_observations_from_many_threads_are_all_counted():
    h = Histogram()
    threads = [threading.Thread(target=lambda: [h.observe(0.003) for _ in range(2000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    figures = h.as_dict()
    assert figures["count"] == 8000 and figures["buckets"][-1] == ("+Inf", 8000)
    assert dict(figures["buckets"])["0.005"] == 8000 and dict(figures["buckets"])["0.002"] == 0
