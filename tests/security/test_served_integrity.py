"""A sample corrupted in a server's memory is never served: the feeder checks its crc32c, the
server re-reads it from the backend, and the repair is counted.

The tests play a process that writes into a pool region file behind the server's back (issue 29,
item 5), as root (no other user can open the pool: the last test): with ``verify_served: always``
a loaded dataset's sample is overwritten between two epochs; with the default (``first``: each
sample checked the first time a feeder serves it from its place) it is overwritten before it is
first served (as while a server is stopped, before it re-adopts its pool). The next epochs are
exact, and the repair shows in the server's metrics and in the share's status
(``integrity_repairs``), without waiting for the scrub (hourly).
"""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

from kspeed import DatasetSpec, KSpeedClient
from kspeed.cli.cluster import wait_for
from tests.helpers import http_get
from tests.integration.test_production import metric
from tests.security.test_sandbox import SAMPLE, home_of, write_samples

pytestmark = [pytest.mark.security, pytest.mark.timeout(120)]


def repairs(cluster, dataset: str) -> tuple[float, int]:
    """The server's repair counter of ``dataset`` and the share status the manager has of it."""
    text = http_get(cluster.servers[0].ready["http"], "/metrics")[1]
    counted = metric(text, "kspeed_server_integrity_events_total", f'{{dataset="{dataset}",event="repaired"}}')
    with KSpeedClient(config=cluster.client_config()) as client:
        status = sum(s.integrity_repairs for s in client.manager.dataset(dataset).share_status)
    return counted, status


@pytest.mark.parametrize("verify", ["always", "first"])
def test_a_sample_overwritten_in_its_region_file_is_served_right_and_the_repair_counted(
    cluster_factory, tmp_path, verify
):
    files = write_samples(tmp_path / "data", 16, seed=3)
    keys = sorted(files)
    cluster = cluster_factory(1, server_args=["--backend-allow", str(tmp_path), "--verify-served", verify])
    client = KSpeedClient(config=cluster.client_config())
    try:
        spec = DatasetSpec(name="victim", uri=str(tmp_path / "data"), labels="dirname")
        feed = client.dataset(spec, 16, shuffle=False, quiet=True)
        feed.preload(quiet=True)
        if verify == "always":  # served once, then overwritten
            epoch = [bytes(b.numpy(i)) for b in feed for i in range(len(b))]
            assert epoch == [files[k] for k in keys]
        stored = b"".join(files[k] for k in keys)
        pool_dir = tmp_path / "cluster-0" / "server-0" / "pool"
        region, at = wait_for(lambda: home_of(pool_dir, stored), 30, "the samples at home")
        with open(region, "r+b") as fh:  # behind the server's back: sample 5 gets other bytes
            fh.seek(at + 5 * SAMPLE + 100)
            fh.write(bytes(b ^ 0xFF for b in files[keys[5]][100:164]))
        assert region.read_bytes()[at + 5 * SAMPLE : at + 6 * SAMPLE] != files[keys[5]]
        for _ in range(2):  # the next epochs are exact
            epoch = [bytes(b.numpy(i)) for b in feed for i in range(len(b))]
            assert epoch == [files[k] for k in keys]
        assert region.read_bytes()[at + 5 * SAMPLE : at + 6 * SAMPLE] == files[keys[5]]  # repaired in place
        assert wait_for(lambda: repairs(cluster, "victim") == (1, 1) or None, 10, "the repair counted once")
        feed.close()
    finally:
        client.close()


def test_no_other_user_can_open_a_servers_pool(cluster_factory, tmp_path):
    # What keeps a sample checked once from changing afterwards: the pool is the server's alone.
    files = write_samples(tmp_path / "data", 16, seed=4)
    cluster = cluster_factory(1, server_args=["--backend-allow", str(tmp_path)])
    with KSpeedClient(config=cluster.client_config()) as client:
        client.dataset(DatasetSpec(name="ds", uri=str(tmp_path / "data")), 16, quiet=True).preload(quiet=True)
    pool_dir = tmp_path / "cluster-0" / "server-0" / "pool"
    region = wait_for(lambda: home_of(pool_dir, b"".join(files[k] for k in sorted(files))), 30, "the samples")[0]
    assert stat.S_IMODE(os.stat(pool_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(region).st_mode) == 0o600
    if os.geteuid() != 0:
        pytest.skip("needs root to try as another user")
    for how in ("<>", "<"):  # open it to write, then to read
        tried = subprocess.run(
            ["/bin/sh", "-c", f'exec 3{how}"$0"', str(region)],
            user="nobody",
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
        )
        assert tried.returncode != 0 and "Permission denied" in tried.stderr, tried.stderr
