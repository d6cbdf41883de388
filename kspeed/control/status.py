"""Plain JSON-able forms of the cluster status, shared by ``/v1/status`` and ``kspeed status --json``.

The CLI's tables (:mod:`kspeed.cli.tables`) render these same dicts, so every view shows the same
facts.
"""

from __future__ import annotations

from typing import Any

from kspeed.control.lifecycle import state_name
from kspeed.proto import kspeed_pb2
from kspeed.uris import redact

__all__ = ["dataset_dict", "human_bytes", "job_dict", "rank_attribution", "server_dict", "state_name", "status_dict"]


def server_dict(record: kspeed_pb2.ServerRecord) -> dict:
    """One server as plain JSON-able data."""
    inv = record.inventory
    return {
        "id": record.id,
        "address": record.address,
        "http_address": record.http_address,
        "state": state_name(record.state),
        "state_reason": record.state_reason,
        "incarnation": record.incarnation,
        "hostname": inv.hostname,
        "memory_bytes": inv.memory_bytes,
        "memory_used_bytes": inv.memory_used_bytes,
        "regions": {
            "total": inv.regions_total,
            "free": inv.regions_free,
            "window": inv.regions_window,
            "allocated": inv.regions_allocated,
            "filling": inv.regions_filling,
            "sealed": inv.regions_sealed,
        },
        "region_size": inv.region_size,
        "cores": inv.cores,
        "transports": list(inv.transports),
        "nics": [{"name": n.name, "pci_bus_id": n.pci_bus_id, "numa_node": n.numa_node} for n in inv.nics],
        "preprocess": {
            "workers": inv.preprocess_workers,
            "active": inv.preprocess_active or inv.preprocess_workers,
            "share": dict(inv.preprocess_share),
            "weights": dict(inv.preprocess_weights),
        },
        "registered_unix": record.registered_unix,
        "last_heartbeat_unix": record.last_heartbeat_unix,
        "protocol_version": record.protocol_version,
        "software_version": record.software_version,
    }


def dataset_state_name(state: int) -> str:
    return kspeed_pb2.DatasetState.Name(state).removeprefix("DATASET_STATE_").lower()


def dataset_dict(info: kspeed_pb2.DatasetInfo) -> dict:
    """One dataset as plain JSON-able data, with its preload progress."""
    p = info.progress
    return {
        "name": info.spec.name,
        "uri": redact(info.spec.uri),  # (a registry written before credentials were refused may hold some)
        "kind": info.spec.kind or "auto",
        "labels": info.spec.labels,
        "quota_bytes": info.spec.quota_bytes,
        "owner": kspeed_pb2.DatasetOwner.Name(info.owner).removeprefix("DATASET_OWNER_").lower(),
        "state": dataset_state_name(info.state),
        "samples": info.fingerprint.count,
        "bytes": info.fingerprint.total_bytes,
        "fingerprint": info.fingerprint.digest,
        "region_size": info.region_size,
        "leases": info.leases,
        "classes": list(info.class_names),
        "changes": list(info.changes),
        "changed_reason": info.changed_reason,
        "progress": {
            "samples_loaded": p.samples_loaded,
            "samples_total": p.samples_total,
            "bytes_loaded": p.bytes_loaded,
            "bytes_total": p.bytes_total,
            "bytes_per_s": p.bytes_per_s,
            "running": p.running,
            "error_count": p.error_count,
            "errors": list(p.errors),
        },
        "shares": [
            {
                "server_id": s.server_id,
                "address": info.server_addresses.get(s.server_id, ""),
                "first_id": s.first_id,
                "end_id": s.end_id,
                "first_region": s.first_region,
                "num_regions": s.num_regions,
                "bytes": s.bytes,
                "on_demand": s.on_demand,
                "policy": s.policy or "cache",
                "memory_regions": s.memory_regions if s.policy else s.num_regions,
                "slice_bytes": s.slice_bytes,
                "handoff_to": s.handoff_to,
                "samples_loaded": st.progress.samples_loaded,
                "regions_sealed": st.regions_sealed,
            }
            for s, st in zip(info.shares, info.share_status)
        ],
    }


def status_dict(status: kspeed_pb2.ClusterStatus) -> dict:
    """The whole cluster status as plain JSON-able data."""
    return {
        "cluster_id": status.cluster_id,
        "manager_version": status.manager_version,
        "uptime_s": round(status.uptime_s, 3),
        "revision": status.revision,
        "servers": [server_dict(r) for r in status.servers],
        "datasets": [dataset_dict(d) for d in status.datasets],
    }


def job_dict(job: kspeed_pb2.JobStats) -> dict:
    """A job's per-rank statistics and their spread as plain JSON-able data."""

    def spread(sp: kspeed_pb2.Spread) -> dict:
        return {"min": sp.min, "max": sp.max, "p50": sp.p50, "p99": sp.p99}

    return {
        "job": job.job,
        "ranks": [
            {
                "rank": r.rank,
                "world_size": r.world_size,
                "host": r.host,
                "pid": r.pid,
                "dataset": r.dataset,
                "batches": r.batches,
                "samples": r.samples,
                "bytes": r.bytes,
                "elapsed_s": r.elapsed_s,
                "samples_per_s": r.samples / r.elapsed_s if r.elapsed_s > 0 else 0.0,
                "wait_total_s": r.wait_total_s,
                "wait_mean_ms": r.wait_mean_ms,
                "wait_p50_ms": r.wait_p50_ms,
                "wait_p99_ms": r.wait_p99_ms,
                "wait_max_ms": r.wait_max_ms,
                "server_bytes": dict(r.server_bytes),
                "stale_completions": r.stale_completions,
                "report_unix": r.report_unix,
                "offload_ratio": r.offload_ratio if r.HasField("offload_ratio") else None,
                "offload_reason": r.offload_reason,
                **rank_attribution(r),
            }
            for r in job.ranks
        ],
        "spread": {
            "wait_mean_ms": spread(job.wait_mean_ms),
            "wait_p99_ms": spread(job.wait_p99_ms),
            "samples_per_s": spread(job.samples_per_s),
        },
        "blocked": [{"cause": b.cause, "server": b.server, "seconds": b.seconds} for b in job.blocked],
        "history": [
            {
                "rank": h.rank,
                "dataset": h.dataset,
                "samples": [
                    {
                        "report_unix": x.report_unix,
                        "wait_total_s": x.wait_total_s,
                        "step_s": x.step_s,
                        "blocked": {b.cause: b.seconds for b in x.blocked},
                    }
                    for x in h.samples
                ],
            }
            for h in job.history
        ],
    }


def rank_attribution(r: kspeed_pb2.RankStats) -> dict:
    """A rank's wait by cause: every row, its total, its share of the loop's time (wait over wait
    plus step) and its top cause (``None`` from a rank that reports no causes)."""
    rows: list[dict[str, Any]] = [
        {"cause": b.cause, "server": b.server, "stage": b.stage, "seconds": b.seconds} for b in r.blocked
    ]
    blocked = sum(b.seconds for b in r.blocked)
    top = max(rows, key=lambda row: float(row["seconds"]), default=None)
    return {
        "blocked": rows,
        "blocked_s": blocked,
        "step_s": r.step_s,
        "wait_share": blocked / (blocked + r.step_s) if blocked + r.step_s > 0 else 0.0,
        "top_cause": top if top is not None and top["seconds"] > 0 else None,
    }


def human_bytes(n: float) -> str:
    """``1.5 GiB`` style sizes."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
