"""Under torchrun, with a process group and no rank/world_size given, each sample reaches one rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kspeed.config import LAUNCHER_VARIABLES
from tests.integration.test_datasets import make_tree

JOB = Path(__file__).with_name("torchrun_job.py")


def launcher_env(cluster) -> dict[str, str]:
    """The environment of a job a launcher starts against ``cluster``: its manager, no token, this
    checkout importable, and none of the launcher variables of whatever runs the tests."""
    env = {
        **os.environ,
        "KSPEED_MANAGER": cluster.address,
        "KSPEED_AUTH": "none",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "OMP_NUM_THREADS": "1",
    }
    for name in (*LAUNCHER_VARIABLES, "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def run_job(cluster, *argv: str) -> None:
    """Run ``python argv...`` as a job a launcher starts against ``cluster``; asserts that it succeeded."""
    done = subprocess.run(
        [sys.executable, *argv], env=launcher_env(cluster), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]


def torchrun(cluster, script: Path, *args: str, processes: int = 2, launcher: tuple[str, ...] = ("--standalone",)):
    """Run ``script`` with ``args`` as a torchrun job of ``processes`` ranks against ``cluster`` (its
    ``launcher`` options: ``--standalone`` unless given); asserts that it succeeded."""
    run_job(cluster, "-m", "torch.distributed.run", *launcher, "--nproc-per-node", str(processes), str(script), *args)


@pytest.mark.parametrize("mode", ["group", "env"])
def test_two_rank_torchrun_job_reads_each_sample_once(cluster_factory, tmp_path, mode):
    files = make_tree(tmp_path / "imgs", per_class=50, max_size=4000)  # 150 samples
    cluster = cluster_factory(2, server_args=["--backend-allow", str(tmp_path)])
    out = tmp_path / "out"
    out.mkdir()
    torchrun(cluster, JOB, str(tmp_path / "imgs"), str(out), mode)
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [(r["ds_rank"], r["ds_world_size"]) for r in ranks] == [(0, 2), (1, 2)]
    got = [r["ids"] for r in ranks]
    assert all(len(ids) == len(files) // 2 for ids in got)  # the DistributedSampler split: 75 each
    assert not set(got[0]) & set(got[1])  # no sample twice
    assert sorted(got[0] + got[1]) == list(range(len(files)))  # every sample once
