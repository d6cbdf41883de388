"""The ``verbs`` rail on a real RDMA device: one command for anyone with a NIC.

    .venv/bin/python -m pytest -m rdma tests/rdma/test_verbs_device.py

runs the conformance suite on the host's device (where a device exists, ``tests/conformance``
runs ``verbs`` on pyverbs instead of the double) and ``bench/rails.py --rails verbs``. Skipped,
with the reason, on hosts without an RDMA device: that is every machine this project has run on,
so none of these has run yet.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kspeed.rdma.verbs import VerbsRail

REPO = Path(__file__).resolve().parents[2]
NO_DEVICE = VerbsRail().unavailable_reason()

pytestmark = [pytest.mark.rdma, pytest.mark.skipif(NO_DEVICE is not None, reason=f"needs an RDMA device: {NO_DEVICE}")]


def test_the_conformance_suite_passes_on_the_device():
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-k", "verbs", "tests/conformance"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


def test_the_rail_benchmark_runs_on_the_device(tmp_path):
    out = tmp_path / "rails.json"
    done = subprocess.run(
        [sys.executable, "bench/rails.py", "--rails", "verbs", "--quick", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(out.read_text())
    assert "verbs" in json.dumps(results)
