"""What the auto-offload benchmark starts: its clusters (on the server core, on loopback or in a
network lab) and its training jobs (each a fresh process, :mod:`_autotune_job`).

Every start has its stop in a ``finally``: :func:`loopback_cluster` and :func:`lab_cluster` are
context managers, and :func:`run_job` kills the job's process group whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kspeed.cli.cluster import QUICK_FAILURE_DETECTION, LocalCluster

__all__ = ["MANAGER_ARGS", "SERVER_ARGS", "lab_cluster", "loopback_cluster", "on_core", "run_job"]

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
JOB = BENCH / "_autotune_job.py"
#: The test suite's failure detector: a killed server is declared failed after 2 s of silence,
#: not the default 10 s.
MANAGER_ARGS = QUICK_FAILURE_DETECTION
#: As bench/preprocess.py: pools far larger than the photographs (two datasets of them: raw for
#: offload=0, with the pipeline otherwise), the production window at its cap there.
SERVER_ARGS = ["--memory", "512MiB", "--region-size", "4MiB", "--production-window", "128MiB"]
SERVERS = 2


@contextlib.contextmanager
def on_core(cores: set[int]) -> Iterator[None]:
    """This process on ``cores`` meanwhile (what it spawns inherits them), its affinity restored after."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _pool_root() -> str:
    return tempfile.mkdtemp(prefix="kspeed-bench-autotune-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)


def _settings(cluster: LocalCluster, server_args: list[str], where: str) -> dict:
    return {
        "where": where,
        "servers": SERVERS,
        "manager_args": MANAGER_ARGS,
        "server_args": server_args,
        "pool_root": cluster.pool_root,
        "manager": cluster.address,
    }


@contextlib.contextmanager
def loopback_cluster(work: Path, backend: Path, server_core: set[int]) -> Iterator[tuple[LocalCluster, dict]]:
    """A manager and two servers on loopback, started on ``server_core``; stopped (pools removed) after."""
    pools = _pool_root()
    server_args = [*SERVER_ARGS, "--backend-allow", str(backend), "--keep-pool-on-exit", "false"]
    cluster = LocalCluster(
        str(work / "cluster"), servers=SERVERS, manager_args=MANAGER_ARGS, server_args=server_args, pool_root=pools
    )
    try:
        with on_core(server_core):
            cluster.start(timeout=60)
        yield cluster, _settings(cluster, server_args, "loopback")
    finally:
        cluster.stop()
        shutil.rmtree(pools, ignore_errors=True)


@contextlib.contextmanager
def lab_cluster(
    work: Path, backend: Path, server_core: set[int], rate_bits: int
) -> Iterator[tuple[LocalCluster, dict, object]]:
    """A network lab of two hosts, ``srv`` (the manager and two servers, on ``server_core``) and
    ``cli`` (the job's, its switch port shaped to ``rate_bits``); all stopped and deleted after."""
    from tests.netlab import NetLab, netlab_unavailable

    reason = netlab_unavailable()
    if reason:
        raise RuntimeError(f"no network lab here: {reason}")
    pools = _pool_root()
    server_args = [*SERVER_ARGS, "--backend-allow", str(backend), "--keep-pool-on-exit", "false"]
    lab = NetLab(["srv", "cli"])
    cluster = None
    try:
        lab.build()
        host = lab.address("srv")
        cluster = LocalCluster(
            str(work / "lab-cluster"),
            servers=SERVERS,
            manager_args=MANAGER_ARGS,
            server_args=server_args,
            pool_root=pools,
            manager_host=host,
            server_hosts=[host] * SERVERS,
            launch_prefix=lambda _name: lab.prefix("srv"),
        )
        with on_core(server_core):
            cluster.start(timeout=60)
        lab.limit_rate("cli", rate_bits)
        settings = _settings(cluster, server_args, "network lab: daemons in host srv, the job in host cli")
        settings["lab"] = {"hosts": {h: lab.address(h) for h in lab.hosts}, "cli_port_rate_bits": rate_bits}
        yield cluster, settings, lab
    finally:
        if cluster is not None:
            cluster.stop()
        lab.close()
        shutil.rmtree(pools, ignore_errors=True)


def run_job(
    job: dict,
    out_dir: Path,
    name: str,
    *,
    prefix: list[str] | None = None,
    on_warm: Callable[[float, str], None] | None = None,
    timeout: float = 900.0,
) -> dict:
    """Run one job in a fresh process (under ``prefix``, e.g. a lab host's) and return its result.

    ``on_warm(monotonic time, dataset name)`` is called (on a reader thread) when the job's
    warm-up is over. A job that fails, or runs past ``timeout``, gives ``{"ok": False, "error":
    ...}`` with the end of its log; its whole process group is killed in any case.
    """
    out, log_path = out_dir / f"{name}.json", out_dir / f"{name}.log"
    out.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KSPEED_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    argv = [*(prefix or []), sys.executable, str(JOB), "--job", json.dumps(job), "--out", str(out)]
    began = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT, env=env, start_new_session=True
        )
        reader = threading.Thread(target=_read_lines, args=(proc, on_warm), daemon=True)
        reader.start()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            timed_out = proc.poll() is None
            if timed_out:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            _kill_group(proc.pid)  # workers or a receiver left behind
            reader.join(timeout=5)
    result = json.loads(out.read_text(encoding="utf-8")) if out.exists() else {"ok": False}
    if timed_out:
        result = {"ok": False, "error": f"timed out after {timeout:.0f} s"}
    if not result.get("ok"):
        result.setdefault("error", f"exited with status {proc.returncode}")
        result["log_tail"] = log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
    result["process_s"] = time.monotonic() - began
    return result


def _read_lines(proc: subprocess.Popen, on_warm: Callable[[float, str], None] | None) -> None:
    for line in proc.stdout:
        parts = line.split()
        if len(parts) == 3 and parts[0] == "warm" and on_warm is not None:
            try:
                on_warm(float(parts[1]), parts[2])
            except Exception as exc:  # the job goes on; what failed is in the parent's output
                print(f"  on warm-up: {type(exc).__name__}: {exc}", file=sys.stderr)
    proc.stdout.close()


def _kill_group(group: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)
