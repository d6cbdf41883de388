"""Prometheus metrics of the manager, declared once on the daemon's own registry."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kspeed.manager.membership import Membership, state_name


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


class ManagerMetrics:
    """Every metric the manager exports."""

    def __init__(self, membership: Membership) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_MembershipCollector(membership))
        self.probes = Counter(
            "kspeed_manager_health_probes", "Active health probes of servers", ["result"], registry=self.registry
        )
        self.watchers = Gauge(
            "kspeed_manager_membership_watchers", "Open membership watch streams", registry=self.registry
        )
