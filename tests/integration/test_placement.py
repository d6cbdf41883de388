"""The client places itself on the NIC and cores nearest its GPU; a forced NIC that is absent is an error."""

from __future__ import annotations

import os

import pytest

from kspeed import KSpeedClient
from kspeed.errors import ConfigError
from kspeed.rdma.topology import find_nics
from tests.integration.test_client import config_for, fed  # noqa: F401  (the fixture)


def test_placement_and_forced_nic(fed):  # noqa: F811
    cluster, client, _, spec = fed
    ds = client.dataset(spec, batch_size=8, quiet=True)
    try:
        placement = ds.placement
        assert set(placement.cores) <= os.sched_getaffinity(0) and placement.cores
        if not find_nics():  # this machine: no GPU, no NIC -> no preference, all allowed cores
            assert placement.nic is None and "no preference" in placement.reason
        ds.preload()
        ds.set_epoch(0)
        assert sum(len(b.ids) for b in ds) == ds.num_samples  # helper threads pinned, delivery unchanged
    finally:
        ds.close()
    tcp = client.dataset(spec, batch_size=8, quiet=True, rail="tcp")
    try:
        pids = tcp._feed.helper_pids
        assert pids and all(os.sched_getaffinity(pid) == set(tcp.placement.cores) for pid in pids)
    finally:
        tcp.close()
    forced = KSpeedClient(config=config_for(cluster, nic="mlx5_9"))
    try:
        with pytest.raises(ConfigError, match="mlx5_9"):
            forced.dataset(spec, batch_size=8, quiet=True)
    finally:
        forced.close()
