"""The cluster status as fixed-width tables for ``kspeed status`` (from :mod:`kspeed.control.status`)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from kspeed.control.status import dataset_dict, human_bytes, job_dict, state_name
from kspeed.proto import kspeed_pb2

__all__ = ["dataset_table", "job_table", "slowest_ranks_table", "status_table"]

READY, LEFT = kspeed_pb2.ServerState.SERVER_STATE_READY, kspeed_pb2.ServerState.SERVER_STATE_LEFT


def dataset_table(datasets: list[kspeed_pb2.DatasetInfo]) -> str:
    """Datasets as a fixed-width table."""
    header = ("DATASET", "STATE", "OWNER", "SAMPLES", "SIZE", "LOADED", "SERVERS", "LEASES")
    rows = []
    notes = []
    for info in datasets:
        d = dataset_dict(info)
        notes += [
            f"{d['name']}: samples {s['first_id']}..{s['end_id'] - 1} are served on demand by {s['server_id']} "
            f"(read from the backend as jobs need them: no ready server has {s['num_regions']} regions free)"
            for s in d["shares"]
            if s["on_demand"]
        ]
        notes += [
            f"{d['name']}: samples {s['first_id']}..{s['end_id'] - 1} are held by {s['server_id']} in "
            f"{s['memory_regions']} of their {s['num_regions']} regions (policy {s['policy']}: the rest is read from "
            "the backend as jobs need it)"
            for s in d["shares"]
            if s["policy"] != "cache" and not s["on_demand"]
        ]
        notes += [
            f"{d['name']}: samples {s['first_id']}..{s['end_id'] - 1} are being handed off from {s['server_id']} "
            f"(draining; it serves them meanwhile) to {s['handoff_to']}, which loads them"
            for s in d["shares"]
            if s["handoff_to"]
        ]
        total = d["progress"]["samples_total"] or 1
        rows.append(
            (
                d["name"],
                d["state"],
                d["owner"],
                str(d["samples"]),
                human_bytes(d["bytes"]),
                f"{100 * d['progress']['samples_loaded'] / total:.0f}%",
                str(len(d["shares"])),
                str(d["leases"]),
            )
        )
    return "\n".join([_table(header, rows), *notes])


def _table(header: tuple[str, ...], rows: Sequence[Sequence[object]]) -> str:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows])


def status_table(status: kspeed_pb2.ClusterStatus, now: float | None = None) -> str:
    """The cluster as a fixed-width table, one server per row, then why each server that is not
    ready is in its state."""
    now = time.time() if now is None else now
    header = (
        "SERVER",
        "ADDRESS",
        "STATE",
        "MEMORY (USED/POOL)",
        "REGIONS FREE/ALLOC/FILL/SEAL",
        "PREP WORKERS",
        "LAST HEARTBEAT",
    )
    rows = []
    shares = []
    for record in status.servers:
        inv = record.inventory
        age = f"{max(0.0, now - record.last_heartbeat_unix):.1f}s ago" if record.last_heartbeat_unix else "never"
        memory = f"{human_bytes(inv.memory_used_bytes)} / {human_bytes(inv.memory_bytes)}"
        regions = f"{inv.regions_free}/{inv.regions_allocated}/{inv.regions_filling}/{inv.regions_sealed}"
        workers = f"{inv.preprocess_active or inv.preprocess_workers}/{inv.preprocess_workers} active"
        rows.append((record.id, record.address, state_name(record.state), memory, regions, workers, age))
        if inv.preprocess_share:
            split = ", ".join(
                f"{job} {100 * share:.0f}% (weight {inv.preprocess_weights.get(job, 1.0):g})"
                for job, share in sorted(inv.preprocess_share.items(), key=lambda kv: -kv[1])
            )
            shares.append(f"{record.id} preprocesses for {split}")
    left = sum(record.state == LEFT for record in status.servers)
    counted = f"{len(rows)} server(s)" + (f", {left} of them left" if left else "")
    text = f"cluster {status.cluster_id}  manager {status.manager_version}  {counted}\n"
    text += _table(header, rows)
    reasons = [
        f"{record.id} is {state_name(record.state)}: {record.state_reason}"
        for record in status.servers
        if record.state != READY and record.state_reason
    ]
    if reasons:
        text += "\n" + "\n".join(reasons)
    if shares:
        text += "\n" + "\n".join(shares)
    if status.datasets:
        text += "\n\n" + dataset_table(list(status.datasets))
    return text


def job_table(job: kspeed_pb2.JobStats) -> str:
    """A job's ranks as a table, then the spread across ranks (the stragglers)."""
    header = (
        "RANK",
        "HOST",
        "DATASET",
        "BATCHES",
        "SAMPLES/S",
        "WAIT MEAN",
        "P50",
        "P99",
        "MAX",
        "OFFLOAD",
        "FROM SERVERS",
    )
    rows = []
    for r in job_dict(job)["ranks"]:
        total = sum(r["server_bytes"].values()) or 1
        servers = " ".join(f"{k}:{100 * v / total:.0f}%" for k, v in sorted(r["server_bytes"].items()))
        rows.append(
            (
                f"{r['rank']}/{r['world_size']}",
                r["host"],
                r["dataset"],
                str(r["batches"]),
                f"{r['samples_per_s']:,.0f}",
                f"{r['wait_mean_ms']:.2f}ms",
                f"{r['wait_p50_ms']:.2f}ms",
                f"{r['wait_p99_ms']:.2f}ms",
                f"{r['wait_max_ms']:.2f}ms",
                "-" if r["offload_ratio"] is None else f"{r['offload_ratio']:.2f}",
                servers,
            )
        )
    lines = [
        f"job {job.job}: {len(rows)} rank report(s)",
        _table(header, rows),
        "",
        "spread across ranks       min        p50        p99        max",
    ]
    for name, sp, unit in (
        ("data wait mean", job.wait_mean_ms, "ms"),
        ("data wait p99", job.wait_p99_ms, "ms"),
        ("samples/s", job.samples_per_s, ""),
    ):
        lines.append(f"{name:<20}" + "".join(f"{v:>10.2f}{unit:<1}" for v in (sp.min, sp.p50, sp.p99, sp.max)))
    slowest = slowest_ranks_table(job_dict(job)["ranks"])
    if slowest:
        lines += ["", slowest]
    return "\n".join(lines)


SLOWEST = 5  # ranks shown by their wait's top cause


def slowest_ranks_table(ranks: list[dict], count: int = SLOWEST) -> str:
    """The ``count`` ranks with the largest share of their loop's time waiting, with the cause
    most of it went to ("" when no rank reports causes)."""
    attributed = [r for r in ranks if r["top_cause"] is not None]
    if not attributed:
        return ""
    attributed.sort(key=lambda r: r["wait_share"], reverse=True)
    rows = []
    for r in attributed[:count]:
        top = r["top_cause"]
        cause = top["cause"] + (f" ({top['stage']})" if top["stage"] else "")
        rows.append(
            (
                f"{r['rank']}/{r['world_size']}",
                r["dataset"],
                f"{100 * r['wait_share']:.1f}%",
                f"{r['blocked_s']:.2f}s",
                cause,
                top["server"] or "-",
                f"{100 * top['seconds'] / r['blocked_s']:.0f}%" if r["blocked_s"] > 0 else "-",
            )
        )
    header = ("SLOWEST RANKS", "DATASET", "WAIT/TIME", "WAITED", "TOP CAUSE", "SERVER", "OF WAIT")
    return _table(header, rows)
