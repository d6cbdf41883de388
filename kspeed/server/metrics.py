"""Prometheus metrics of a server, declared once on the daemon's own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Info


class ServerMetrics:
    """Every metric the server exports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.info = Info("kspeed_server", "Identity of this server", registry=self.registry)
        self.registered = Gauge("kspeed_server_registered", "1 while registered with the manager",
                                registry=self.registry)
        self.heartbeats = Counter("kspeed_server_heartbeats", "Heartbeats sent to the manager", ["result"],
                                  registry=self.registry)
        self.registrations = Counter("kspeed_server_registrations", "Registrations with the manager",
                                     registry=self.registry)
        self.memory = Gauge("kspeed_server_memory_bytes", "Memory this server may pool", registry=self.registry)
        self.memory_used = Gauge("kspeed_server_memory_used_bytes", "Pooled memory allocated to datasets",
                                 registry=self.registry)
