"""A benchmark killed with SIGTERM unwinds as after Ctrl-C: its ``finally`` blocks run."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"

PROGRAM = """
import os, shutil, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
from _common import stop_on_sigterm
stop_on_sigterm()
work = tempfile.mkdtemp(prefix="kspeed-test-sigterm-")
try:
    print(work, flush=True)
    time.sleep(60)
finally:
    shutil.rmtree(work)
    print("cleaned", flush=True)
"""


def test_a_benchmark_killed_with_sigterm_removes_its_work_directory():
    child = subprocess.Popen([sys.executable, "-c", PROGRAM, str(BENCH)], stdout=subprocess.PIPE, text=True)
    try:
        work = Path(child.stdout.readline().strip())
        assert work.is_dir()
        child.send_signal(signal.SIGTERM)
        out, _ = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert "cleaned" in out and not work.exists()
    assert child.returncode != 0  # it still ends as interrupted
