"""Per-rank statistics of a dataset's delivery: data wait per batch, throughput, server contribution.

Each batch's wait (the time ``next()`` spent before the batch was complete), its samples and bytes,
and the bytes each server wrote are recorded with a little numpy per batch. ``KSpeedDataset.stats()``
returns the local figures; a reporter thread sends them to the manager every few seconds, where
``kspeed status --job`` shows the spread across ranks (the stragglers of a job); and
:class:`PrometheusCollector` exports them from the training process.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from kspeed.client.attribution import blocked_messages
from kspeed.control.manager_client import ManagerClient
from kspeed.errors import KSpeedError
from kspeed.histogram import Histogram
from kspeed.proto import kspeed_pb2

__all__ = ["PrometheusCollector", "RankStats", "StatsReporter"]

log = logging.getLogger(__name__)

WINDOW = 4096  # recent batch waits kept for percentiles


class RankStats:
    """What one rank received from one dataset.

    Args:
        servers: the dataset's server ids, in the order of the plans' ``owner`` indices (the
            servers that hold the shares now: they change when a share moves).
    """

    def __init__(self, servers: Sequence[str]) -> None:
        self.servers = list(servers)
        self.server_bytes: dict[str, int] = dict.fromkeys(self.servers, 0)
        self.batches = 0
        self.samples = 0
        self.bytes = 0
        self.wait_total_s = 0.0
        self._waits: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.wait_histogram = Histogram()
        self._started: float | None = None
        self._lock = threading.Lock()

    def record(
        self, wait_s: float, owner: np.ndarray, lengths: np.ndarray, servers: Sequence[str] | None = None
    ) -> None:
        """One delivered batch: its wait, and per position its owner index and length; ``servers``
        says which server each owner index is now (a share moved), when it changed."""
        per_server = np.bincount(owner, weights=lengths, minlength=len(self.servers)).astype(np.int64)
        with self._lock:
            if self._started is None:
                self._started = time.monotonic() - wait_s
            self.batches += 1
            self.samples += len(lengths)
            self.bytes += int(lengths.sum())
            self.wait_total_s += wait_s
            if servers is not None:
                self.servers = list(servers)
            for server, nbytes in zip(self.servers, per_server.tolist()):
                self.server_bytes[server] = self.server_bytes.get(server, 0) + nbytes
            self._waits.append(wait_s)
        self.wait_histogram.observe(wait_s)

    def summary(self) -> dict:
        """The local figures: waits in milliseconds over the recent window, and every wait as a histogram."""
        with self._lock:
            waits = np.asarray(self._waits, dtype=np.float64) * 1e3
            elapsed = time.monotonic() - self._started if self._started is not None else 0.0
            out = {
                "batches": self.batches,
                "samples": self.samples,
                "bytes": self.bytes,
                "elapsed_s": elapsed,
                "samples_per_s": self.samples / elapsed if elapsed > 0 else 0.0,
                "bytes_per_s": self.bytes / elapsed if elapsed > 0 else 0.0,
                "wait_total_s": self.wait_total_s,
                "server_bytes": dict(self.server_bytes),
            }
        out["wait_seconds"] = self.wait_histogram.as_dict()
        if len(waits):
            out.update(
                wait_mean_ms=float(waits.mean()),
                wait_p50_ms=float(np.percentile(waits, 50)),
                wait_p99_ms=float(np.percentile(waits, 99)),
                wait_max_ms=float(waits.max()),
            )
        else:
            out.update(wait_mean_ms=0.0, wait_p50_ms=0.0, wait_p99_ms=0.0, wait_max_ms=0.0)
        return out


def default_job() -> str:
    """``user@host``: a job name when none is configured (one process per job, or set KSPEED_JOB)."""
    try:
        user = os.getlogin()
    except OSError:
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


class StatsReporter:
    """Sends one rank's statistics to the manager every ``interval`` seconds until :meth:`close`.

    A manager that is down is tolerated (reports resume when it is back); the data plane never waits
    on this thread.
    """

    def __init__(
        self,
        manager: ManagerClient,
        *,
        job: str,
        rank: int,
        world_size: int,
        dataset: str,
        collect: Callable[[], dict],
        interval: float,
        refresh: Callable[[], None] | None = None,
    ) -> None:
        self._manager = manager
        self._base = kspeed_pb2.RankStats(
            job=job, rank=rank, world_size=world_size, dataset=dataset, host=socket.gethostname(), pid=os.getpid()
        )
        self._collect = collect
        self._refresh = refresh
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kspeed-stats-{dataset}", daemon=True)
        self._thread.start()
        self.sent = 0

    def set_rank(self, rank: int, world_size: int) -> None:
        """Report as ``rank`` of ``world_size`` from now on (a rank known once the process group exists)."""
        self._base.rank, self._base.world_size = rank, world_size

    def message(self) -> kspeed_pb2.RankStats:
        """The report as it would be sent now."""
        s = self._collect()
        report = kspeed_pb2.RankStats()
        report.CopyFrom(self._base)
        report.MergeFrom(
            kspeed_pb2.RankStats(
                batches=s["batches"],
                samples=s["samples"],
                bytes=s["bytes"],
                elapsed_s=s["elapsed_s"],
                wait_total_s=s["wait_total_s"],
                wait_mean_ms=s["wait_mean_ms"],
                wait_p50_ms=s["wait_p50_ms"],
                wait_p99_ms=s["wait_p99_ms"],
                wait_max_ms=s["wait_max_ms"],
                server_bytes=s["server_bytes"],
                stale_completions=s.get("stale_completions", 0),
            )
        )
        attribution = s.get("attribution")
        if attribution:
            report.blocked.extend(blocked_messages(attribution))
            report.step_s = attribution["step_s"]
        offload = s.get("offload")
        if offload:
            report.offload_ratio = float(offload.get("ratio", 0.0))
            report.offload_reason = str(offload.get("reason", ""))[:500]
        return report

    def send(self) -> None:
        """Send one report now (errors are logged, not raised)."""
        try:
            self._manager.call("ReportStats", self.message())
            self.sent += 1
        except KSpeedError as exc:
            log.debug("statistics report failed (will retry): %s", exc)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            if self._refresh is not None:  # the servers' figures, one small call each, off the data path
                try:
                    self._refresh()
                except KSpeedError as exc:
                    log.debug("reading the servers' figures failed (will retry): %s", exc)
            self.send()

    def close(self) -> None:
        """Send a last report and stop."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self.send()


class PrometheusCollector:
    """Exports a dataset's :meth:`stats` from the training process::

    from prometheus_client import REGISTRY, start_http_server
    REGISTRY.register(PrometheusCollector(ds)); start_http_server(9100)
    """

    def __init__(self, dataset) -> None:
        self._dataset = dataset

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily

        s = self._dataset.stats()
        labels = ["dataset"]
        name = [self._dataset.name]
        for metric, value, doc in (
            ("batches", s["batches"], "Batches delivered"),
            ("samples", s["samples"], "Samples delivered"),
            ("bytes", s["bytes"], "Bytes delivered"),
            ("data_wait_seconds", s["wait_total_s"], "Time the loop waited for data"),
        ):
            family = CounterMetricFamily(f"kspeed_client_{metric}", doc, labels=labels)
            family.add_metric(name, value)
            yield family
        yield _histogram(
            "kspeed_client_batch_wait_seconds", "Time next() waited for each batch", name, s["wait_seconds"]
        )
        per_server = CounterMetricFamily(
            "kspeed_client_server_bytes", "Bytes each server wrote", labels=["dataset", "server"]
        )
        for server, value in s["server_bytes"].items():
            per_server.add_metric([self._dataset.name, server], value)
        yield per_server
        attribution = s.get("attribution")
        if attribution:
            yield from _attribution_metrics(self._dataset.name, attribution)
        pacing = s.get("pacing")
        if pacing:
            yield from _pacing_metrics(self._dataset.name, pacing)
        offload = s.get("offload")
        if offload:
            yield from _offload_metrics(self._dataset.name, offload)


#: The rates an offload decision is made from, as exported (docs/preprocessing.md, offload="auto").
OFFLOAD_RATES = {
    "gthp": ("kspeed_client_loop_samples_per_second", "Samples/s the training loop consumes when it never waits"),
    "lthp": ("kspeed_client_local_samples_per_second", "Samples/s with every sample preprocessed on this client"),
    "rthp": ("kspeed_client_remote_samples_per_second", "Samples/s with every sample preprocessed on the servers"),
    "remote_rate": ("kspeed_client_server_capacity_samples_per_second", "Servers' preprocessing left for this job"),
    "pcycle": ("kspeed_client_local_prep_cpu_seconds", "Client CPU seconds to preprocess one sample here"),
    "ocycle": ("kspeed_client_receive_cpu_seconds", "Client CPU seconds to take one sample preprocessed remotely"),
}


def _offload_metrics(dataset: str, offload: dict) -> Iterator:
    """The split in force and the rates its decision used."""
    from prometheus_client.core import GaugeMetricFamily

    ratio = GaugeMetricFamily(
        "kspeed_client_offload_ratio", "Share of each batch preprocessed on the servers", labels=["dataset", "mode"]
    )
    ratio.add_metric([dataset, str(offload.get("mode", ""))], float(offload.get("ratio", 0.0)))
    yield ratio
    inputs = offload.get("inputs") or {}
    for key, (metric, doc) in OFFLOAD_RATES.items():
        value = inputs.get(key)
        if value is not None and value == value and value not in (float("inf"), float("-inf")):
            family = GaugeMetricFamily(metric, doc, labels=["dataset"])
            family.add_metric([dataset], float(value))
            yield family


def _attribution_metrics(dataset: str, attribution: dict) -> Iterator:
    """The wait by cause beside the step (docs/analyze.md, Attribution while a job runs), named as
    Ray Data names its blocked and user seconds."""
    from prometheus_client.core import CounterMetricFamily

    blocked = CounterMetricFamily(
        "kspeed_client_blocked_seconds",
        "Seconds the training loop waited in next(), by cause, server and stage",
        labels=["dataset", "cause", "server", "stage"],
    )
    for row in attribution["rows"]:
        blocked.add_metric([dataset, row["cause"], row["server"], row["stage"]], row["seconds"])
    yield blocked
    step = CounterMetricFamily(
        "kspeed_client_step_seconds", "Seconds the training loop spent outside next() (its step)", labels=["dataset"]
    )
    step.add_metric([dataset], attribution["step_s"])
    yield step


def _pacing_metrics(dataset: str, pacing: dict) -> Iterator:
    """The pacing window, sub-batches and their latencies (docs/feeding.md, Pacing)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for metric, key, doc in (
        ("pacing_window_bytes", "window_bytes", "Bytes allowed in flight towards this process"),
        ("pacing_in_flight_bytes", "in_flight_bytes", "Bytes granted and not yet completed"),
        ("pacing_sub_batch_bytes", "sub_batch_bytes", "Target bytes of one server's sub-batch"),
        ("pacing_drain_rate_bytes_per_second", "drain_rate", "Measured delivery rate"),
    ):
        family = GaugeMetricFamily(f"kspeed_client_{metric}", doc, labels=["dataset"])
        family.add_metric([dataset], pacing[key])
        yield family
    yield _histogram(
        "kspeed_client_pacing_sub_batch_latency_seconds",
        "Seconds from a sub-batch's grant to its completion",
        [dataset],
        pacing["sub_batch_latency_seconds"],
    )
    sent = CounterMetricFamily("kspeed_client_pacing_sub_batches", "Sub-batches granted", labels=["dataset"])
    sent.add_metric([dataset], pacing["sub_batches_sent"])
    yield sent
    table = GaugeMetricFamily(
        "kspeed_client_pacing_latency_seconds",
        "Latency table: seconds from grant to completion per size class (median over servers)",
        labels=["dataset", "size_class"],
    )
    for size_class, seconds in pacing["latency"].items():
        if seconds is not None:
            table.add_metric([dataset, size_class], seconds)
    yield table


def _histogram(metric: str, doc: str, labels: list[str], figures: dict):
    """A histogram family from :meth:`Histogram.as_dict` figures, labelled by dataset."""
    from prometheus_client.core import HistogramMetricFamily

    family = HistogramMetricFamily(metric, doc, labels=["dataset"])
    family.add_metric(labels, figures["buckets"], figures["sum"])
    return family
