"""Every daemon's and the client's metrics pass ``promtool check metrics`` (Prometheus' own linter)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kspeed import DatasetSpec, KSpeedClient
from kspeed.cli.cluster import wait_for
from kspeed.client.stats import PrometheusCollector
from tests.helpers import http_get
from tests.integration.test_client import config_for
from tests.integration.test_datasets import make_tree


def promtool() -> str:
    """The venv's promtool (``scripts/system-deps.sh`` puts Debian's there), else one on PATH."""
    local = Path(sys.executable).parent / "promtool"
    found = str(local) if local.exists() else shutil.which("promtool")
    if found is None:
        pytest.skip("promtool not installed (scripts/system-deps.sh extracts it from Debian's prometheus package)")
    return found


def lint(text: str) -> str:
    """promtool's complaints about one exposition (empty when it passes)."""
    done = subprocess.run([promtool(), "check", "metrics"], input=text.encode(), capture_output=True, timeout=60)
    return "" if done.returncode == 0 else (done.stdout + done.stderr).decode()


def test_promtool_passes_manager_server_and_client_metrics(cluster_factory, tmp_path):
    files = make_tree(tmp_path / "imgs", per_class=8, max_size=8000)
    cluster = cluster_factory(1, server_args=["--backend-allow", str(tmp_path)])
    client = KSpeedClient(config=config_for(cluster, job="metrics-job", pacing="on", stats_interval="100ms"))
    try:
        ds = client.dataset(DatasetSpec(name="imgs", uri=str(tmp_path / "imgs")), batch_size=4, quiet=True)
        batches = len(list(ds))
        registry = CollectorRegistry()
        registry.register(PrometheusCollector(ds))
        # the rank's wait by cause reaches the manager with its next report
        manager = wait_for(
            lambda: (lambda text: text if 'kspeed_job_blocked_seconds_total{cause="' in text else None)(
                http_get(cluster.http_address, "/metrics")[1]
            ),
            10,
            "the job's wait by cause in the manager's metrics",
        )
        exposed = {
            "manager": manager,
            "server": http_get(cluster.servers[0].ready["http"], "/metrics")[1],
            "client": generate_latest(registry).decode(),
        }
        ds.close()
    finally:
        client.close()
    assert batches == -(-len(files) // 4)
    # Latencies are histograms in seconds: every batch's wait is counted once.
    assert f'kspeed_client_batch_wait_seconds_count{{dataset="imgs"}} {float(batches)}' in exposed["client"]
    assert 'kspeed_client_pacing_sub_batch_latency_seconds_bucket{dataset="imgs",le="+Inf"}' in exposed["client"]
    assert "kspeed_server_preload_samples" in exposed["server"] and "kspeed_manager_servers" in exposed["manager"]
    # the wait by cause beside the step, in seconds, in the training process and summed per job
    assert 'kspeed_client_blocked_seconds_total{cause="client",dataset="imgs",server="",stage=""}' in exposed["client"]
    assert 'kspeed_client_step_seconds_total{dataset="imgs"}' in exposed["client"]
    assert 'job="metrics-job"' in exposed["manager"] and "kspeed_job_step_seconds_total" in exposed["manager"]
    complaints = {name: lint(text) for name, text in exposed.items()}
    assert complaints == {"manager": "", "server": "", "client": ""}


def test_lint_finds_what_promtool_rejects():
    # The check itself can fail: a counter without _total and a millisecond unit are named.
    bad = "# HELP kspeed_x_wait_ms A wait\n# TYPE kspeed_x_wait_ms counter\nkspeed_x_wait_ms 1.0\n"
    assert "kspeed_x_wait_ms" in lint(bad)
