"""Prometheus metrics of a server, declared once on the daemon's own registry."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kspeed.errors import NotFoundError

if TYPE_CHECKING:
    from kspeed.server.hosting.datasets import DatasetHost
    from kspeed.server.production.core import Production


class _HostCollector(Collector):
    """Reads the pool and the hosted datasets at scrape time (no stale labels)."""

    def __init__(self, host: Callable[[], DatasetHost | None]) -> None:
        self._host = host

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        host = self._host()
        if host is None:
            return
        regions = GaugeMetricFamily("kspeed_server_regions", "Pool regions per lifecycle state", labels=["state"])
        for state, count in host.pool.counts().items():
            regions.add_metric([state.name.lower()], count)
        yield regions
        samples = GaugeMetricFamily(
            "kspeed_server_preload_samples", "Samples of each hosted share", labels=["dataset", "kind"]
        )
        nbytes = GaugeMetricFamily(
            "kspeed_server_preload_bytes", "Bytes of each hosted share", labels=["dataset", "kind"]
        )
        rate = GaugeMetricFamily("kspeed_server_preload_rate_bytes_per_second", "Preload read rate", labels=["dataset"])
        errors = GaugeMetricFamily("kspeed_server_preload_errors", "Samples that failed to load", labels=["dataset"])
        integrity = CounterMetricFamily(
            "kspeed_server_integrity_events", "crc32c checks that found trouble", labels=["dataset", "event"]
        )
        per: dict[str, dict[str, float]] = {}  # a server may hold several shares of a dataset: summed
        for status in host.statuses():
            p = status.progress
            sums = per.setdefault(status.dataset, collections.defaultdict(float))
            for key, value in (
                ("samples_loaded", p.samples_loaded),
                ("samples_total", p.samples_total),
                ("bytes_loaded", p.bytes_loaded),
                ("bytes_total", p.bytes_total),
                ("rate", p.bytes_per_s),
                ("errors", p.error_count),
            ):
                sums[key] += value
            with contextlib.suppress(NotFoundError):  # dropped meanwhile
                for event, count in host.get(status.dataset, status.first_id).store.counters.items():
                    sums[f"event:{event}"] += count
        for name, sums in sorted(per.items()):
            samples.add_metric([name, "loaded"], sums["samples_loaded"])
            samples.add_metric([name, "total"], sums["samples_total"])
            nbytes.add_metric([name, "loaded"], sums["bytes_loaded"])
            nbytes.add_metric([name, "total"], sums["bytes_total"])
            rate.add_metric([name], sums["rate"])
            errors.add_metric([name], sums["errors"])
            for key, total in sums.items():
                if key.startswith("event:"):
                    integrity.add_metric([name, key[6:]], total)
        yield from (samples, nbytes, rate, errors, integrity)


class _ProductionCollector(Collector):
    """The production window and the producers, read at scrape time (docs/feeding.md, Production)."""

    def __init__(self, production: Callable[[], Production | None]) -> None:
        self._production = production

    def collect(self) -> Iterator[Metric]:
        production = self._production()
        if production is None:
            return
        window = production.window
        fill = GaugeMetricFamily("kspeed_server_window_bytes", "Production window bytes", labels=["kind"])
        fill.add_metric(["capacity"], window.capacity)
        fill.add_metric(["used"], window.used)
        fill.add_metric(["peak"], window.peak)
        yield fill
        for name, value, doc in (
            ("kspeed_server_produced_samples", production.produced_samples, "Samples produced into the window"),
            ("kspeed_server_produced_bytes", production.produced_bytes, "Bytes produced into the window"),
            ("kspeed_server_production_failures", production.failed_samples, "Samples a plan needed that failed"),
            ("kspeed_server_window_full", production.window_full, "Times a producer found the window full"),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily(
            "kspeed_server_production_rate_bytes_per_second",
            "Bytes produced per second, recently",
            value=production.rate(),
        )
        yield GaugeMetricFamily(
            "kspeed_server_feeds", "Open feeds (one per attached client rank)", value=production.feed_count()
        )
        yield GaugeMetricFamily(
            "kspeed_server_grants_waiting",
            "Grants waiting for their samples to be produced",
            value=production.waiting(),
        )
        fetched = CounterMetricFamily(
            "kspeed_server_fetched_bytes",
            "Bytes producers read from the backend for feeds (beside the preload)",
            labels=["dataset"],
        )
        for dataset, (_, nbytes) in sorted(production.fetch_reads.items()):
            fetched.add_metric([dataset], nbytes)
        yield fetched
        yield from _group_metrics(production)
        waits = production.waits.as_dict()
        family = HistogramMetricFamily(
            "kspeed_server_grant_wait_seconds", "How long grants that had to wait for production waited"
        )
        family.add_metric([], waits["buckets"], waits["sum"])
        yield family
        prep = production.prep
        if prep is None:
            return
        yield GaugeMetricFamily(
            "kspeed_server_preprocess_workers", "Preprocessing worker processes", value=prep.workers
        )
        counters: tuple[tuple[str, float, str], ...] = (
            ("kspeed_server_preprocessed_samples", prep.samples, "Samples run through server stages of pipelines"),
            ("kspeed_server_preprocess_busy_seconds", prep.busy_seconds, "Seconds preprocessing workers were busy"),
            (
                "kspeed_server_preprocess_cpu_seconds",
                prep.cpu_seconds,
                "CPU seconds preprocessing workers spent on tasks",
            ),
            ("kspeed_server_preprocess_worker_restarts", prep.restarts, "Preprocessing workers replaced after dying"),
        )
        for name, count, doc in counters:
            yield CounterMetricFamily(name, doc, value=count)
        stages = CounterMetricFamily(
            "kspeed_server_preprocess_stage_seconds",
            "Seconds spent in each server stage",
            labels=["dataset", "stage"],
        )
        for dataset, spent in sorted(prep.all_seconds().items()):
            for stage, seconds in sorted(spent.items()):
                stages.add_metric([dataset, stage], seconds)
        yield stages


def _group_metrics(production: Production) -> Iterator[Metric]:
    """Shared preparation per group (docs/groups.md)."""
    outputs = CounterMetricFamily(
        "kspeed_server_group_outputs",
        "Outputs a group's members share: made (produced), or let go by the lag bound while awaited (evicted)",
        labels=["dataset", "group", "kind"],
    )
    positions = CounterMetricFamily(
        "kspeed_server_group_positions",
        "A member's positions served a shared output (shared) or made for it alone while it had company (alone)",
        labels=["dataset", "group", "member", "served"],
    )
    window = GaugeMetricFamily(
        "kspeed_server_group_window_bytes",
        "Window bytes a group's outputs hold (held), of them kept for lagging members (kept), and its bound (cap)",
        labels=["dataset", "group", "kind"],
    )
    members = GaugeMetricFamily("kspeed_server_group_members", "Jobs in a group here", labels=["dataset", "group"])
    for dataset in production.group_datasets():
        for g in production.group_figures(dataset):
            outputs.add_metric([dataset, g.group, "produced"], g.produced)
            outputs.add_metric([dataset, g.group, "evicted"], g.evicted)
            for member, n in sorted(g.member_shared.items()):
                positions.add_metric([dataset, g.group, member, "shared"], n)
            for member, n in sorted(g.member_alone.items()):
                positions.add_metric([dataset, g.group, member, "alone"], n)
            window.add_metric([dataset, g.group, "held"], g.held_bytes)
            window.add_metric([dataset, g.group, "kept"], g.kept_bytes)
            window.add_metric([dataset, g.group, "cap"], g.cap_bytes)
            members.add_metric([dataset, g.group], g.members)
    yield from (outputs, positions, window, members)


class ServerMetrics:
    """Every metric the server exports."""

    def __init__(
        self,
        host: Callable[[], DatasetHost | None] = lambda: None,
        production: Callable[[], Production | None] = lambda: None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_HostCollector(host))
        self.registry.register(_ProductionCollector(production))
        self.info = Info("kspeed_server", "Identity of this server", registry=self.registry)
        self.registered = Gauge(
            "kspeed_server_registered", "1 while registered with the manager", registry=self.registry
        )
        self.heartbeats = Counter(
            "kspeed_server_heartbeats", "Heartbeats sent to the manager", ["result"], registry=self.registry
        )
        self.registrations = Counter(
            "kspeed_server_registrations", "Registrations with the manager", registry=self.registry
        )
        self.memory = Gauge("kspeed_server_memory_bytes", "Memory this server may pool", registry=self.registry)
        self.memory_used = Gauge(
            "kspeed_server_memory_used_bytes", "Pooled memory allocated to datasets", registry=self.registry
        )
