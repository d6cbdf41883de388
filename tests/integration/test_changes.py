"""A changed backend is noticed and never served stale; a dataset in use is not removed from under a job."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kspeed import DatasetSpec, KSpeedClient
from kspeed.cli.cluster import wait_for
from kspeed.config import ClientConfig, load_config
from kspeed.control.progress import follow_preload
from kspeed.errors import ChangedError, DatasetError, StateError
from kspeed.proto import kspeed_pb2
from tests.integration.test_datasets import make_tree

DS = kspeed_pb2.DatasetState


@pytest.fixture
def watched(cluster_factory, tmp_path):
    """Two servers that compare every backend file with the listing four times a second."""
    files = make_tree(tmp_path / "imgs", per_class=20, max_size=16 * 1024)
    cluster = cluster_factory(
        2,
        server_args=[
            "--backend-allow",
            str(tmp_path),
            "--memory",
            "8MiB",
            "--region-size",
            "1MiB",
            "--change-check-interval",
            "250ms",
            "--change-check-budget",
            "100",
        ],
    )
    config = load_config(ClientConfig, environ={}, overrides={"manager": cluster.address, "security.auth": "none"})
    clients = []

    def client() -> KSpeedClient:
        clients.append(KSpeedClient(config=config))
        return clients[-1]

    yield cluster, client, files, DatasetSpec(name="imgs", uri=str(tmp_path / "imgs"), labels="dirname")
    for c in clients:
        c.close()


def rewrite_keeping_size(path, data: bytes) -> None:
    """New bytes of the same length and a new mtime (what a re-encode or an rsync leaves)."""
    path.write_bytes(bytes(255 - b for b in data))
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))


def test_a_file_rewritten_after_preload_is_never_served(watched, tmp_path):
    _, client, files, spec = watched
    keys = list(files)
    job = client()
    ds = job.dataset(spec, batch_size=8, shuffle=False, quiet=True)
    loaded = ds.preload(quiet=True)
    assert (loaded.state, loaded.samples) == ("ready", len(files)) and loaded.servers >= 1 and "ready" in str(loaded)
    assert sum(len(b) for b in ds) == len(files)  # all served while the backend is as listed
    victim = next(i for i, k in enumerate(keys) if files[k])  # a sample with bytes
    rewrite_keeping_size(tmp_path / "imgs" / keys[victim], files[keys[victim]])

    info = wait_for(
        lambda: (i := job.manager.dataset("imgs")).state == DS.DATASET_STATE_CHANGED and i, 20, "the change noticed"
    )
    assert any(f"sample {victim}" in c and "modified" in c for c in info.changes), info.changes
    # The running job: the epoch that needs the stale sample fails, naming it; no stale byte arrives.
    with pytest.raises(DatasetError, match=rf"sample {victim}\b.*(modified|stale)"):
        for batch in ds:
            assert victim not in batch.ids.tolist()
    # A second job is refused at attach, with the sample and the remedy named.
    with pytest.raises(ChangedError, match=rf"sample {victim}\b.*kspeed dataset rm imgs"):
        client().dataset(spec, batch_size=8, quiet=True)


def test_a_deleted_file_and_a_changed_listing_refuse_a_new_job(watched, tmp_path):
    _, client, files, spec = watched
    keys = list(files)
    operator = client().manager
    operator.create_dataset(spec.to_proto(), operator=True)  # lives until removed, whatever the jobs do
    follow_preload(operator, "imgs", out=None, timeout=60)
    (tmp_path / "imgs" / keys[7]).unlink()
    # Attaching lists the backend again: the listing has one file less, so the job is refused at
    # once (without waiting for the periodic check), and every holder names the changed samples.
    with pytest.raises(ChangedError, match=r"listing changed since registration.*sample 7 .*deleted"):
        client().dataset(spec, batch_size=8, quiet=True)
    status = operator.dataset("imgs")
    assert status.state == DS.DATASET_STATE_CHANGED and status.changed_reason


def kspeed_cli(cluster, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kspeed.cli", *args, "--manager", cluster.address, "--auth", "none"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_rm_of_a_dataset_in_use_is_refused_and_forced_removal_is_named_to_the_job(watched):
    cluster, client, _, spec = watched
    job = client()
    ds = job.dataset(spec, batch_size=8, quiet=True)
    it = iter(ds)
    next(it)
    operator = client().manager
    with pytest.raises(StateError, match=r"'imgs' is in use: 1 job lease.*--force"):
        operator.remove_dataset("imgs")
    refused = kspeed_cli(cluster, "dataset", "rm", "imgs")
    assert refused.returncode == 1 and "in use" in refused.stderr and "--force" in refused.stderr
    assert next(it) is not None  # refused and nothing changed: the job goes on
    forced = kspeed_cli(cluster, "dataset", "rm", "imgs", "--force")
    assert forced.returncode == 0 and "removed imgs" in forced.stdout, forced.stderr
    deadline = time.monotonic() + 20
    with pytest.raises(DatasetError, match=r"'imgs' was removed from the cluster"):
        while time.monotonic() < deadline:
            ds.set_epoch(ds.epoch + 1)
            for _ in ds:
                pass


def test_a_file_rewritten_in_place_refuses_the_next_job_at_attach(cluster_factory, tmp_path):
    """No periodic check runs: the attach's stat of every file notices a same-size rewrite that the
    folder's own mtime does not show, and the holders name the sample."""
    files = make_tree(tmp_path / "imgs", per_class=20, max_size=16 * 1024)
    keys = list(files)
    cluster = cluster_factory(2, server_args=["--backend-allow", str(tmp_path), "--memory", "8MiB"])
    config = load_config(ClientConfig, environ={}, overrides={"manager": cluster.address, "security.auth": "none"})
    spec = DatasetSpec(name="imgs", uri=str(tmp_path / "imgs"), labels="dirname")
    with KSpeedClient(config=config) as first, KSpeedClient(config=config) as second:
        ds = first.dataset(spec, batch_size=8, quiet=True)
        assert ds.preload(quiet=True).state == "ready"
        victim = next(i for i, k in enumerate(keys) if files[k])
        folder = (tmp_path / "imgs" / keys[victim]).parent
        before = os.stat(folder).st_mtime_ns
        rewrite_keeping_size(tmp_path / "imgs" / keys[victim], files[keys[victim]])
        assert os.stat(folder).st_mtime_ns == before  # the folder does not show it
        with pytest.raises(ChangedError, match=rf"listing changed since registration.*sample {victim}\b.*modified"):
            second.dataset(spec, batch_size=8, quiet=True)
