"""Rendering of the cluster status: one dict form (``/v1/status``, ``kspeed status --json``) and
one table form (``kspeed status``), so both always show the same facts."""

from __future__ import annotations

import time

from kspeed.proto import kspeed_pb2


def _state(state: int) -> str:
    return kspeed_pb2.ServerState.Name(state).removeprefix("SERVER_STATE_").lower()


def human_bytes(n: float) -> str:
    """``1.5 GiB`` style sizes."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def server_dict(record: kspeed_pb2.ServerRecord) -> dict:
    """One server as plain JSON-able data."""
    inv = record.inventory
    return {
        "id": record.id,
        "address": record.address,
        "http_address": record.http_address,
        "state": _state(record.state),
        "state_reason": record.state_reason,
        "incarnation": record.incarnation,
        "hostname": inv.hostname,
        "memory_bytes": inv.memory_bytes,
        "memory_used_bytes": inv.memory_used_bytes,
        "region_size": inv.region_size,
        "cores": inv.cores,
        "transports": list(inv.transports),
        "nics": [{"name": n.name, "pci_bus_id": n.pci_bus_id, "numa_node": n.numa_node} for n in inv.nics],
        "registered_unix": record.registered_unix,
        "last_heartbeat_unix": record.last_heartbeat_unix,
        "protocol_version": record.protocol_version,
        "software_version": record.software_version,
    }


def status_dict(status: kspeed_pb2.ClusterStatus) -> dict:
    """The whole cluster status as plain JSON-able data."""
    return {
        "cluster_id": status.cluster_id,
        "manager_version": status.manager_version,
        "uptime_s": round(status.uptime_s, 3),
        "revision": status.revision,
        "servers": [server_dict(r) for r in status.servers],
    }


def status_table(status: kspeed_pb2.ClusterStatus, now: float | None = None) -> str:
    """The cluster as a fixed-width table, one server per row."""
    now = time.time() if now is None else now
    header = ("SERVER", "ADDRESS", "STATE", "MEMORY (USED/POOL)", "LAST HEARTBEAT")
    rows = []
    for record in status.servers:
        inv = record.inventory
        age = f"{max(0.0, now - record.last_heartbeat_unix):.1f}s ago" if record.last_heartbeat_unix else "never"
        memory = f"{human_bytes(inv.memory_used_bytes)} / {human_bytes(inv.memory_bytes)}"
        rows.append((record.id, record.address, _state(record.state), memory, age))
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = [f"cluster {status.cluster_id}  manager {status.manager_version}  {len(rows)} server(s)"]
    for row in [header, *rows]:
        lines.append("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())
    return "\n".join(lines)
