"""Per-rank statistics of a 2-rank job reach the manager; `kspeed status --job` shows the spread."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kspeed import KSpeedClient
from kspeed.causes import CAUSES
from kspeed.cli.cluster import wait_for
from kspeed.proto import kspeed_pb2
from tests.integration.test_client import config_for, fed  # noqa: F401  (the fixture)


def test_two_ranks_report_and_status_shows_spread(fed):  # noqa: F811
    cluster, _, files, spec = fed
    clients = [KSpeedClient(config=config_for(cluster, job="job-a", stats_interval="200ms")) for _ in range(2)]
    try:
        datasets = [c.dataset(spec, batch_size=8, rank=r, world_size=2, quiet=True) for r, c in enumerate(clients)]
        for ds in datasets:
            ds.preload()
            ds.set_epoch(0)
            for batch in ds:
                batch.release()
        local = datasets[0].stats()
        assert local["samples"] == len(files) // 2 and local["batches"] == len(datasets[0])
        assert sum(local["server_bytes"].values()) == local["bytes"] > 0
        assert set(local["server_bytes"]) == {s.ready["id"] for s in cluster.servers}
        assert local["wait_p99_ms"] >= local["wait_p50_ms"] >= 0
        job = wait_for(
            lambda: (lambda j: j if len(j.ranks) == 2 and all(r.batches for r in j.ranks) else None)(
                clients[0].manager.call("GetJobStats", kspeed_pb2.JobRequest(job="job-a"))
            ),
            10,
            "both ranks' reports",
        )
        assert [r.rank for r in job.ranks] == [0, 1] and all(r.world_size == 2 for r in job.ranks)
        assert job.wait_mean_ms.max >= job.wait_mean_ms.min
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "kspeed.cli",
                "status",
                "--manager",
                cluster.address,
                "--auth",
                "none",
                "--job",
                "job-a",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        shown = json.loads(out.stdout)
        assert [r["rank"] for r in shown["ranks"]] == [0, 1]
        assert set(shown["spread"]) == {"wait_mean_ms", "wait_p99_ms", "samples_per_s"}
        # each rank's wait by cause: the servers' shares name them, and the rows sum to the rank's wait
        servers = {s.ready["id"] for s in cluster.servers}
        for rank in shown["ranks"]:
            assert rank["blocked"] and rank["top_cause"] is not None and 0 < rank["wait_share"] <= 1
            assert {b["cause"] for b in rank["blocked"]} <= set(CAUSES)
            assert {b["server"] for b in rank["blocked"]} <= servers | {""}
            assert sum(b["seconds"] for b in rank["blocked"]) == pytest.approx(rank["blocked_s"], rel=1e-6)
        assert {(b["cause"], b["server"]) for b in shown["blocked"]} >= {("client", "")}
        attribution = local["attribution"]
        assert attribution["blocked_s"] >= local["wait_total_s"] * 0.9 and attribution["step_s"] >= 0
        assert set(attribution["by_server"]) <= servers
        table = subprocess.run(
            [
                sys.executable,
                "-m",
                "kspeed.cli",
                "status",
                "--manager",
                cluster.address,
                "--auth",
                "none",
                "--job",
                "job-a",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        assert "spread across ranks" in table and "0/2" in table and "1/2" in table
        missing = subprocess.run(
            [
                sys.executable,
                "-m",
                "kspeed.cli",
                "status",
                "--manager",
                cluster.address,
                "--auth",
                "none",
                "--job",
                "nope",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert missing.returncode == 1 and "job-a" in missing.stderr  # names the jobs that do report
    finally:
        for c in clients:
            c.close()
