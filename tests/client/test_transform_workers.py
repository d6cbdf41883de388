"""Transform worker processes: where they come from, when they are ready, and what they leave."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pytest

from kspeed.client.prep.start_method import FORKSERVER, start_method
from kspeed.client.prep.workers import (
    Stages,
    StartFailure,
    TransformWorkers,
    _stages_file,
    sample_bytes,
    sweep_shared_memory,
)
from kspeed.errors import StateError

needs_forkserver = pytest.mark.skipif(start_method() != FORKSERVER, reason="this platform has no forkserver")


def _refuse_outside(pid: int) -> Stages:
    if os.getpid() != pid:
        raise ValueError("these stages only load where they were made")
    return Stages(loader=sample_bytes)


class LoadsOnlyHere:
    """Stages whose unpickling fails in any other process (a module the workers cannot import, say)."""

    def __reduce__(self):
        return _refuse_outside, (os.getpid(),)


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def children_of(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        found.update(int(p) for p in task.read_text().split())
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def pool_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kspeed-pool")]


def one_batch(workers: TransformWorkers) -> list[list[int]]:
    return workers.submit(b"abc", [0, 3], [None], ["a"]).result(timeout=60).value.tolist()


@pytest.fixture
def stages():
    return Stages(loader=sample_bytes)


@needs_forkserver
def test_workers_are_forked_from_the_forkserver_and_ready_together(stages):
    workers = TransformWorkers(2, stages)
    try:
        assert workers.start_method == "forkserver"
        ready = workers.wait_ready()
        assert ready == workers.pids() and len(ready) == 2  # each worker ran its initializer
        server = multiprocessing.forkserver._forkserver._forkserver_pid
        assert server is not None and server != os.getpid()
        assert {parent_of(pid) for pid in ready} == {server}  # forked by the server, not by this process
        assert "torch" in multiprocessing.forkserver._forkserver._preload_modules
        assert one_batch(workers) == [[97, 98, 99]]
        assert workers.wait_ready() == ready  # at once, the second time
    finally:
        workers.close()
    assert not any(alive(pid) for pid in ready)
    assert multiprocessing.active_children() == [] and pool_threads() == []


def test_the_stages_can_be_given_after_the_start(stages):
    workers = TransformWorkers(2, preload=["torch"])
    try:
        with pytest.raises(StateError, match="no stages"):
            workers.submit(b"abc", [0, 3], [None], ["a"])
        workers.install(stages)
        with pytest.raises(StateError, match="stages already"):
            workers.install(stages)
        assert one_batch(workers) == [[97, 98, 99]]
    finally:
        workers.close()
    with pytest.raises(StateError, match="closed"):
        workers.wait_ready()


def test_stages_that_cannot_be_unpickled_in_a_worker_are_named():
    workers = TransformWorkers(1, preload=["torch"])
    try:
        workers.install(LoadsOnlyHere())
        with pytest.raises(StartFailure, match=r"cannot be unpickled in a worker process: ValueError: these stages"):
            one_batch(workers)
    finally:
        workers.close()


@pytest.mark.parametrize("wait", [False, True], ids=["while-starting", "once-ready"])
def test_closing_leaves_no_process_or_thread(stages, wait):
    workers = TransformWorkers(2, stages)
    if wait:
        workers.wait_ready()
    workers.close()  # waits for a start in progress, then joins
    assert workers.closed and workers.pids() == []
    assert multiprocessing.active_children() == [] and pool_threads() == []
    if start_method() == FORKSERVER:
        server = multiprocessing.forkserver._forkserver._forkserver_pid
        deadline = time.monotonic() + 10
        while children_of(server) and time.monotonic() < deadline:  # the server reaps them
            time.sleep(0.05)
        assert children_of(server) == set()


OWNER = """
import json, multiprocessing.forkserver, os, sys, time
from kspeed.client.prep.workers import Stages, TransformWorkers, sample_bytes

if __name__ == "__main__":
    workers = TransformWorkers(2, Stages(loader=sample_bytes))
    pids = workers.wait_ready()
    assert workers.submit(b"abc", [0, 3], [None], ["a"]).result(timeout=60).value.tolist() == [[97, 98, 99]]
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    print(json.dumps({"workers": pids, "server": server, "stages": workers._stages_file}), flush=True)
    time.sleep(600)
"""


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not reaped by an init that does not reap, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.timeout(120)
def test_a_training_process_killed_outright_leaves_no_worker_or_forkserver(tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = owner.stdout.readline()
        assert line, f"the training process ended first (status {owner.wait()})"
        started = json.loads(line)
        left = [*started["workers"], *([started["server"]] if started["server"] else [])]
        assert len(started["workers"]) == 2 and all(running(pid) for pid in left)
    finally:
        owner.kill()  # SIGKILL: no atexit, no finalizer, no close()
        owner.wait()
        owner.stdout.close()
    deadline = time.monotonic() + 30
    while any(running(pid) for pid in left) and time.monotonic() < deadline:
        time.sleep(0.05)
    still = [pid for pid in left if running(pid)]
    for pid in still:  # (the test fails; it leaves nothing running all the same)
        os.kill(pid, signal.SIGKILL)
    assert still == [], "processes of a killed training process still run"
    # The file of its stages stays until the next process that makes one (no process is left to remove it).
    assert os.path.exists(started["stages"])
    mine = _stages_file(Stages(loader=sample_bytes))
    os.unlink(mine)
    assert not os.path.exists(started["stages"]) and os.path.basename(mine).startswith(f"kspeed-stages-{os.getpid()}-")


@pytest.mark.timeout(120)
def test_a_batch_given_after_a_worker_died_fails_as_its_result_not_at_the_hand_over(stages):
    workers = TransformWorkers(1, stages)
    try:
        assert one_batch(workers) == [[97, 98, 99]]
        os.kill(workers.pids()[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not workers._executor._broken and time.monotonic() < deadline:  # the pool has seen it die
            time.sleep(0.02)
        assert workers._executor._broken
        future = workers.submit(b"abc", [0, 3], [None], ["a"])  # no raise here: the caller reads it
        with pytest.raises(BrokenProcessPool):
            future.result(timeout=10)
    finally:
        workers.close()


def test_the_shared_memory_files_a_dead_worker_left_are_removed_and_no_one_elses(tmp_path):
    # torch names a tensor's file after the sending process and unlinks it once open: a worker
    # killed in between left a file in /dev/shm for good (seen once in a full run of the suite)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    left = [tmp_path / f"torch_{dead}_2905581873_{n}" for n in range(2)]
    others = [tmp_path / f"torch_{os.getpid()}_1_1", tmp_path / f"torch_{dead}1_1_1", tmp_path / "other"]
    for path in left + others:
        path.write_bytes(b"")
    removed = sweep_shared_memory({dead, os.getpid()}, directory=str(tmp_path))
    assert sorted(removed) == sorted(str(p) for p in left)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in others)  # the living's kept
