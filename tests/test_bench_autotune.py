"""The self-tuning benchmark's pure parts: a configuration's runs as one figure, the best fixed split."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import _autotune_report as report


def run(rate: float, **more) -> dict:
    return {"ok": True, "samples_per_s": rate, **more}


def test_a_configuration_stands_for_its_median_run_never_an_average():
    three = report.median_run([run(300.0, pid=1), run(250.0, pid=2), run(410.0, pid=3)])
    assert three["samples_per_s"] == 300.0 and three["pid"] == 1
    assert three["runs_samples_per_s"] == [300.0, 250.0, 410.0]
    two = report.median_run([run(460.0), run(387.0)])
    assert two["samples_per_s"] == 387.0  # the lower middle: a figure one run reached
    assert report.median_run([run(5.0)]) == run(5.0)


def test_a_failed_run_makes_its_configuration_failed():
    failed = {"ok": False, "error": "the job died"}
    assert report.median_run([run(300.0), failed, run(200.0)]) is failed


def test_the_best_fixed_split_leaves_out_auto_and_failures():
    configs = {"0.00": run(200.0), "0.50": run(380.0), "0.90": {"ok": False}, "auto": run(500.0)}
    assert report.best_fixed(configs) == ("0.50", 380.0)
    assert report.best_fixed({"auto": run(1.0)}) is None
