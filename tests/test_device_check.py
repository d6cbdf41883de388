"""``scripts/device-check``: its dry run (what ``make test`` keeps from rotting), and how a run reads
its parts' results, keeps going past a failing part and reruns only what did not pass."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "device-check"
PARTS = ["env", "dmabuf", "tests", "gpu-prep", "delivery"]


def _load():
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "scripts" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


check = _load()
wheels = sys.modules["_device_wheels"]  # loaded beside it


def _script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run([str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_dry_run_finds_what_the_run_needs_and_lists_it():
    done = _script("--dry-run")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["problems"] == []
    assert [p["name"] for p in report["parts"]] == PARTS
    delivery = next(p for p in report["parts"] if p["name"] == "delivery")
    assert "kspeed-shm-cuda" in ",".join(delivery["argv"]) and "1M" in ",".join(delivery["argv"])
    gpu_tests = report["gpu_tests"]
    assert "tests/preprocess/test_gpu.py::test_decode_jpeg_on_cuda_is_close_to_pillow" in gpu_tests
    assert all(t.split("::")[0] in check.gpu_test_files() for t in gpu_tests)
    assert {r.split("==")[0] for r in report["wheels"]["wanted"]} == set(wheels.CARRIED)


def test_a_dry_run_names_arguments_a_benchmark_refuses(monkeypatch, capsys):
    monkeypatch.setattr(check, "DELIVERY_SYSTEMS", "kspeed-shm,no-such-system")
    assert check.main(["--dry-run", "--wheels", "/nonexistent"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert len(problems) == 1 and "client.py refuses the arguments" in problems[0]


def test_a_module_the_gpu_tests_import_but_the_machine_lacks_is_named(monkeypatch):
    files = check.gpu_test_files()
    assert wheels.missing_on_the_machine(files) == set()
    monkeypatch.setattr(wheels, "CARRIED", tuple(c for c in wheels.CARRIED if c != "simplejpeg"))
    assert wheels.missing_on_the_machine(files) == {"simplejpeg"}  # tests/client/test_wrap.py imports it


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.a" name="test_ok" time="0.1"/>
<testcase classname="tests.a" name="test_bad" time="0.1"><failure message="assert 1 == 2">trace</failure></testcase>
<testcase classname="tests.b" name="test_broken" time="0.1"><error message="fixture exploded">trace</error></testcase>
<testcase classname="tests.b" name="test_gpu" time="0"><skipped message="no dma-buf here"/></testcase>
</testsuite></testsuites>
"""


def test_the_tests_part_is_judged_from_its_junit_report(tmp_path):
    (tmp_path / "gpu-tests.xml").write_text(JUNIT)
    status, figures = check.judge("tests", 1, tmp_path, None)
    assert status == check.FAILED
    assert figures["tests"] == 4 and figures["passed"] == 1
    assert [f["test"] for f in figures["failed"]] == ["tests.a::test_bad", "tests.b::test_broken"]
    assert figures["failed"][1]["message"] == "fixture exploded"
    assert figures["skipped"] == [{"test": "tests.b::test_gpu", "reason": "no dma-buf here"}]
    status, figures = check.judge("tests", 2, tmp_path / "nothing-here", None)
    assert status == check.FAILED and "wrote no report" in figures["error"]


def test_a_benchmark_part_fails_on_an_error_row_or_a_timeout(tmp_path):
    rows = [
        {"system": "kspeed-shm", "size": "1M", "gbps": 3.0},
        {"system": "kspeed-shm-cuda", "size": "1M", "error": "boom"},
    ]
    (tmp_path / "delivery.json").write_text(json.dumps({"results": rows, "targets": {"x": {"met": True}}}))
    status, figures = check.judge("delivery", 0, tmp_path, None)
    assert status == check.FAILED and figures["errors"] == ["kspeed-shm-cuda 1M: boom"]
    (tmp_path / "delivery.json").write_text(json.dumps({"results": rows[:1], "targets": {}}))
    assert check.judge("delivery", 0, tmp_path, None)[0] == check.PASSED
    assert check.judge("delivery", 124, tmp_path, None) == (check.FAILED, {"error": "ran past its time limit"})
    assert check.judge("gpu-prep", 1, tmp_path, None)[1] == {"error": "exited with 1 and wrote no gpu_prep.json"}


def test_a_rerun_takes_only_the_parts_that_did_not_pass():
    earlier = {"parts": {"env": {"status": "passed"}, "tests": {"status": "failed"}, "dmabuf": {"status": "skipped"}}}
    args = check.parse_args(["--rerun", "x.json"])
    assert check.select(args, earlier) == {"tests", "dmabuf", "gpu-prep", "delivery"}
    assert check.select(check.parse_args(["--only", "env,tests"]), earlier) == {"env", "tests"}
    with pytest.raises(SystemExit, match="unknown part"):
        check.select(check.parse_args(["--only", "env,nope"]), None)


def test_a_run_goes_past_a_failing_part_and_writes_its_results(tmp_path):
    """On a machine without a GPU the gpu tests all skip, which the check counts as not passed;
    the next part still runs, and the JSON records both."""
    results = tmp_path / "results"
    done = _script("--only", "env,tests", "--no-install", "--results", str(results), timeout=240)
    assert done.returncode == 1, done.stdout + done.stderr
    doc = json.loads((results / "device-check.json").read_text())
    assert doc["parts"]["env"]["status"] == "passed"
    assert doc["parts"]["env"]["figures"]["cores"] == os.cpu_count()
    tests = doc["parts"]["tests"]
    if tests["figures"]["passed"] == 0:  # no GPU here: every gpu test skipped, and the check says so
        assert tests["status"] == "failed" and tests["figures"]["skipped"]
    assert doc["targets"]["every_gpu_test_passes"]["of"] == tests["figures"]["tests"] > 0
    assert (results / "log.txt").read_text().count("=====") >= 2
