"""Transform workers started from an unguarded line of the main script are refused at once, naming the guard.

Each case runs a small script as ``python script.py`` (the spawned workers import it again).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

POOL = """\
from kspeed.client.prep.workers import Stages, TransformWorkers, sample_bytes


def run():
    try:
        pool = TransformWorkers(1, Stages(loader=sample_bytes))
    except Exception as exc:
        print("REFUSED", type(exc).__name__, exc, flush=True)
        return
    try:
        print("BATCH", pool.submit(b"abc", [0, 3], [None], ["a"]).result(timeout=60).value.tolist(), flush=True)
    except Exception as exc:
        print("FAILED", type(exc).__name__, exc, flush=True)
    finally:
        pool.close()
"""


def run_script(tmp_path: Path, body: str) -> str:
    script = tmp_path / "train.py"
    script.write_text(POOL + textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=90, env=env, cwd=tmp_path
    )
    return done.stdout


def test_a_pool_started_at_the_top_of_an_unguarded_script_is_refused_naming_the_guard(tmp_path):
    out = run_script(tmp_path, "\nrun()\n")
    assert out.startswith("REFUSED StateError"), out
    assert 'if __name__ == "__main__":' in out and f"{tmp_path / 'train.py'}" in out and "line" in out


@pytest.mark.parametrize(
    "body",
    [
        '\nif __name__ == "__main__":\n    run()\n',
        '\ntry:\n    if "__main__" == __name__:\n        run()\nfinally:\n    pass\n',
    ],
    ids=["guard", "guard-in-try"],
)
def test_a_guarded_script_runs_its_workers(tmp_path, body):
    assert run_script(tmp_path, body).strip() == "BATCH [[97, 98, 99]]"
