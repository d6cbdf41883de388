"""Prometheus metrics of the manager, declared once on the daemon's own registry."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kspeed.control.lifecycle import state_name
from kspeed.manager.datasets import DatasetCatalog
from kspeed.manager.jobs import JobBoard
from kspeed.manager.membership import Membership
from kspeed.proto import kspeed_pb2


class _MembershipCollector(Collector):
    """Reads the membership at scrape time, so no label outlives its server."""

    def __init__(self, membership: Membership) -> None:
        self._membership = membership

    def collect(self) -> Iterator[GaugeMetricFamily]:
        servers = GaugeMetricFamily("kspeed_manager_servers", "Servers per lifecycle state", labels=["state"])
        for state, count in self._membership.counts().items():
            servers.add_metric([state], count)
        yield servers
        per_server = GaugeMetricFamily(
            "kspeed_manager_server_state",
            "1 for the lifecycle state each known server is in",
            labels=["server", "state"],
        )
        pooled = GaugeMetricFamily(
            "kspeed_manager_server_memory_bytes", "Memory each server may pool", labels=["server"]
        )
        for record in self._membership.snapshot(include_left=True):
            per_server.add_metric([record.id, state_name(record.state)], 1)
            pooled.add_metric([record.id], record.inventory.memory_bytes)
        yield per_server
        yield pooled
        yield GaugeMetricFamily(
            "kspeed_manager_membership_revision", "Revision of the membership", value=self._membership.revision
        )


class _CatalogCollector(Collector):
    """Datasets per state (``degraded``: a holder is not ready) and the shares moved off failed servers."""

    def __init__(self, catalog: DatasetCatalog) -> None:
        self._catalog = catalog

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        states = GaugeMetricFamily("kspeed_manager_datasets", "Datasets per state", labels=["state"])
        counts: dict[str, int] = {}
        for info in self._catalog.datasets():
            name = kspeed_pb2.DatasetState.Name(info.state).removeprefix("DATASET_STATE_").lower()
            counts[name] = counts.get(name, 0) + 1
        for name, count in sorted(counts.items()):
            states.add_metric([name], count)
        yield states
        yield CounterMetricFamily(
            "kspeed_manager_failovers",
            "Shares moved off servers that failed or stopped past restart_grace",
            value=self._catalog.failovers,
        )
        yield CounterMetricFamily(
            "kspeed_manager_handoffs",
            "Shares handed off by drains while their server served on",
            value=self._catalog.handoffs,
        )
        yield CounterMetricFamily(
            "kspeed_manager_state_write_failures",
            "Writes of the registry file that failed (a full disk): the manager went on from memory",
            value=self._catalog.write_failures,
        )


class _JobCollector(Collector):
    """The jobs' data waits by cause and server, and their steps, summed over the ranks reporting
    now (a rank that stops reporting leaves the sums: they are gauges of counters' sums)."""

    def __init__(self, jobs: JobBoard) -> None:
        self._jobs = jobs

    def collect(self) -> Iterator[CounterMetricFamily]:
        blocked = CounterMetricFamily(
            "kspeed_job_blocked_seconds",
            "Seconds the job's ranks waited for data, by cause and server (docs/analyze.md)",
            labels=["job", "cause", "server"],
        )
        for (job, cause, server), seconds in sorted(self._jobs.blocked().items()):
            blocked.add_metric([job, cause, server], seconds)
        yield blocked
        step = CounterMetricFamily(
            "kspeed_job_step_seconds", "Seconds the job's ranks spent in their training steps", labels=["job"]
        )
        for job, seconds in sorted(self._jobs.steps().items()):
            step.add_metric([job], seconds)
        yield step


class ManagerMetrics:
    """Every metric the manager exports."""

    def __init__(
        self, membership: Membership, catalog: DatasetCatalog | None = None, jobs: JobBoard | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_MembershipCollector(membership))
        if catalog is not None:
            self.registry.register(_CatalogCollector(catalog))
        if jobs is not None:
            self.registry.register(_JobCollector(jobs))
        self.probes = Counter(
            "kspeed_manager_health_probes", "Active health probes of servers", ["result"], registry=self.registry
        )
        self.watchers = Gauge(
            "kspeed_manager_membership_watchers", "Open membership watch streams", registry=self.registry
        )
