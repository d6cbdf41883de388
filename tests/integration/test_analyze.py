"""``kspeed analyze`` against a local cluster: every field of its JSON, its report folder, and the
twins it registers gone afterwards."""

from __future__ import annotations

import json
import os

import pytest

from kspeed import KSpeedClient
from kspeed.analyze.measure import PHASES
from kspeed.cli.cluster import wait_for
from kspeed.cli.main import main
from tests.integration.test_autotune import photo_cluster
from tests.integration.test_client import config_for
from tests.integration.test_preprocess import SIDE

pytestmark = pytest.mark.timeout(240)

TERMS = {"step", "server_prep", "client_prep", "client_cpu", "memory", "backend"}
PREDICTION = {"samples_per_s", "bound", "terms", "prep_stall", "fetch_stall"}
CURVES = {"servers", "server_cores", "client_cores", "cache_fraction", "offload", "rail_bytes_per_s"}


def _check_prediction(p: dict) -> None:
    assert set(p) == PREDICTION and set(p["terms"]) == TERMS
    assert p["bound"] in TERMS and p["samples_per_s"] > 0
    finite = [v for v in p["terms"].values() if v is not None]
    assert p["samples_per_s"] == pytest.approx(min(finite))
    assert 0 <= p["prep_stall"] <= 1 and 0 <= p["fetch_stall"] <= 1


def test_analyze_measures_every_rate_and_reports_them(cluster_factory, tmp_path, capsys):
    cluster, photos, spec = photo_cluster(cluster_factory, tmp_path)
    with KSpeedClient(config=config_for(cluster)) as client:
        info = client.manager.create_dataset(spec.to_proto(), operator=True).dataset
    holders = {share.server_id for share in info.shares}
    stored = [(photos.root / key).stat().st_size for key in photos.keys]
    report = tmp_path / "report"
    argv = [
        "analyze",
        "--manager",
        cluster.address,
        "--auth",
        "none",
        "--dataset",
        "photos",
        "--batch-size",
        "4",
        "--step-ms",
        "4",
        "--seconds",
        "0.6",
        "--warmup",
        "0.3",
        "--workers",
        "1",
        "--json",
        "--report",
        str(report),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    doc = json.loads(out[: out.rindex("}") + 1])
    assert set(doc) == {
        "dataset",
        "started_unix",
        "seconds",
        "options",
        "measured",
        "phases",
        "as_is",
        "observed_samples_per_s",
        "prediction",
        "prediction_error",
        "ranks",
        "curves",
        "smallest_cluster",
        "notes",
    }
    assert doc["dataset"] == "photos" and doc["seconds"] > 0 and doc["started_unix"] > 1.7e9
    assert doc["options"] == {
        "step": "sleep:4",
        "batch_size": 4,
        "seconds": 0.6,
        "warmup_batches": 3,
        "warmup_s": 0.3,
        "ranks": 1,
        "offload": None,
        "num_workers": 1,
        "rail": None,
        "device": "cpu",
    }
    m = doc["measured"]
    for rate in ("step", "memory_fetch", "backend_fetch", "server_prep", "client_prep"):
        assert m[rate] > 0, rate
    assert m["step"] < 4 / 0.004  # a batch of 4 per 4 ms step, at most
    assert min(stored) <= m["raw_bytes"] <= max(stored)
    assert m["out_bytes"] == 3 * SIDE * SIDE  # the pipeline's declared uint8 CHW output
    assert m["servers"] == len(holders)
    assert m["server_cores"] == 1 and m["client_cores"] == 1 and m["ranks"] == 1
    assert m["server_memory"] == 32 << 20 and m["dataset_bytes"] == sum(stored)
    assert m["rail_bytes_per_s"] == pytest.approx(m["memory_fetch"] * m["raw_bytes"])
    assert 0 <= m["step_cpu"] < 0.5e-3  # the step sleeps: its CPU per sample is tiny
    assert m["local_cpu"] > m["remote_cpu"] > 0  # decoding here costs more than receiving the servers' output
    assert m["client_cpus"] == len(os.sched_getaffinity(0))
    assert m["server_read_bytes_per_s"] > 0  # the stream twin's reads, from the servers' own figures
    assert set(doc["phases"]["backend"][0]["backend_reads"]) <= holders
    assert set(doc["phases"]) == set(PHASES)
    for name, ranks in doc["phases"].items():
        (rank,) = ranks
        assert rank["rank"] == 0 and rank["samples"] > 0 and rank["seconds"] >= 0.6, name
        assert rank["samples_per_s"] == pytest.approx(rank["samples"] / rank["seconds"])
        assert 0 <= rank["wait_share"] <= 1
    assert doc["phases"]["server"][0]["server_capacity"] == pytest.approx(m["server_prep"])
    assert doc["phases"]["server"][0]["offload"] == 1.0 and doc["phases"]["client"][0]["offload"] == 0.0
    assert doc["as_is"] == {
        "servers": m["servers"],
        "server_cores": 1,
        "client_cores": 1,
        "offload": doc["phases"]["as_is"][0]["offload"],
        "cache_fraction": 1.0,
        "rail_bytes_per_s": pytest.approx(m["rail_bytes_per_s"]),
        "ranks": 1,
        "shares": doc["as_is"]["shares"],
    }
    per_server: dict[str, float] = {}
    for share in info.shares:
        per_server[share.server_id] = per_server.get(share.server_id, 0.0) + share.bytes
    assert sorted(doc["as_is"]["shares"]) == sorted([held, held] for held in per_server.values())  # held whole
    assert doc["observed_samples_per_s"] == pytest.approx(doc["phases"]["as_is"][0]["samples_per_s"])
    _check_prediction(doc["prediction"])
    assert doc["prediction_error"] == pytest.approx(
        (doc["prediction"]["samples_per_s"] - doc["observed_samples_per_s"]) / doc["observed_samples_per_s"]
    )
    (row,) = doc["ranks"]
    assert set(row) == {
        "rank",
        "observed_samples_per_s",
        "observed_wait_share",
        "predicted_samples_per_s",
        "prep_stall",
        "fetch_stall",
        "bound",
    }
    assert row["rank"] == 0 and row["observed_samples_per_s"] == pytest.approx(doc["observed_samples_per_s"])
    assert set(doc["curves"]) == CURVES
    for key, points in doc["curves"].items():
        assert len(points) >= 4, key
        for point in points:
            assert point[key] is not None
            _check_prediction({k: v for k, v in point.items() if k not in (key, "cache_fraction")})
    assert [p["servers"] for p in doc["curves"]["servers"]][:2] == [1, 2]
    assert [p["offload"] for p in doc["curves"]["offload"]] == [k / 20 for k in range(21)]
    small = doc["smallest_cluster"]
    assert set(small) == {"servers", "offload", "cache_fraction", "samples_per_s", "removes_stall", "line"}
    assert small["removes_stall"] == (small["servers"] is not None) and small["line"]
    assert isinstance(doc["notes"], list)
    # the report folder: the same JSON, a chart and the summary
    assert json.loads((report / "analysis.json").read_text())["measured"] == m
    assert (report / "whatif.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (report / "summary.md").read_text()
    assert summary.startswith("# Stall analysis of `photos`") and small["line"] in summary
    # the twins were held by the analyzer alone: nothing of them stays
    with KSpeedClient(config=config_for(cluster)) as client:
        wait_for(
            lambda: not [d for d in client.manager.datasets() if ".analyze-" in d.spec.name] or None,
            20,
            "the analyzer's twins to be freed",
        )
        assert [d.spec.name for d in client.manager.datasets()] == ["photos"]


def test_analyze_names_a_dataset_it_does_not_know(cluster, capsys):
    argv = ["analyze", "--manager", cluster.address, "--auth", "none", "--dataset", "nope"]
    assert main([*argv, "--batch-size", "4", "--step-ms", "1"]) == 1
    assert "nope" in capsys.readouterr().err
