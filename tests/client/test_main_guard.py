"""Transform workers started from an unguarded line of the main script are refused at once, naming the guard.

Each case runs a small script as ``python script.py``: the workers, forked from the forkserver or
spawned, import it again.
"""

from __future__ import annotations

import os
import re
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


REIMPORT = """\
import multiprocessing.forkserver
import os

print("IMPORTED", __name__, os.getpid(), flush=True)
if __name__ == "__mp_main__" and os.environ.get("FAIL_IN_WORKERS"):
    raise RuntimeError("this script cannot run in a worker")

from kspeed.client.prep.workers import Stages, StartFailure, TransformWorkers, sample_bytes

if __name__ == "__main__":
    pool = TransformWorkers(2, Stages(loader=sample_bytes))
    try:
        print("READY", *pool.wait_ready(), flush=True)
        print("METHOD", pool.start_method, multiprocessing.forkserver._forkserver._forkserver_pid, flush=True)
    except StartFailure as exc:
        print("FAILED", exc, flush=True)
    finally:
        pool.close()
"""


def run_reimport(tmp_path: Path, **env: str) -> str:
    """Run :data:`REIMPORT`; its output."""
    script = tmp_path / "train.py"
    script.write_text(REIMPORT)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        cwd=tmp_path,
    )
    return done.stdout


def test_each_worker_imports_the_main_script_again_so_the_guard_stays_needed(tmp_path):
    out = run_reimport(tmp_path)
    workers = re.search(r"^READY (.*)$", out, re.M).group(1).split()
    assert len(workers) == 2
    imported = re.findall(r"IMPORTED (\S+) (\d+)", out)
    assert imported[0][0] == "__main__"
    # Once in each worker, as __mp_main__; never in the forkserver (it does not preload __main__).
    assert sorted(pid for name, pid in imported[1:] if name == "__mp_main__") == sorted(workers)
    assert len(imported) == 3
    method, server = re.search(r"^METHOD (\S+) (\S+)$", out, re.M).groups()
    if method == "forkserver":
        assert server not in workers and all(pid != server for _, pid in imported)


def test_a_worker_that_cannot_import_the_main_script_is_reported_at_start(tmp_path):
    out = run_reimport(tmp_path, FAIL_IN_WORKERS="1")
    assert "READY" not in out
    failure = re.search(r"FAILED (.*)$", out, re.M).group(1)  # (a worker's output may end mid-line)
    assert "ended while starting" in failure and "importing the main script again" in failure


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
