"""The faults an operator meets, one after another under one job: a dataset three times its memory
streams for three epochs while a holder is killed, another is stopped for good, and the manager is
restarted with its state file removed, each while grants are in flight.

Real daemons on loopback: two servers hold the dataset under ``stream`` over a backend that takes a
few milliseconds a read (grants wait on production, so every fault lands on work in flight), two
spares registered after it. Epoch 0: a holder is SIGKILLed (declared failed after ``fail_after``,
2 s; its share moves to a spare). Epoch 1: another holder is SIGTERMed and not started again
(``stopped``, then ``left`` after ``restart_grace``, 2 s; its share moves again). Epoch 2: the
manager is stopped, its state file deleted, and started again (it takes the cluster id and the
dataset back from the servers). Every epoch arrives whole: each sample exactly once, in the
sampler's order, bytes intact.
"""

from __future__ import annotations

import os
import signal

import pytest

from kspeed import DatasetSpec, KSpeedClient
from kspeed.cli.cluster import wait_for
from tests.integration.test_client import config_for
from tests.integration.test_failover import BATCH, SEED, check_epoch, holders_of
from tests.integration.test_failover_streamed import QUOTA, dataset, slow_servers


@pytest.mark.timeout(240)
def test_a_kill_a_stop_and_a_lost_manager_state_over_three_streamed_epochs(cluster_factory, tmp_path):
    files, uri, kind = dataset("dir", tmp_path)
    cluster = slow_servers(cluster_factory, tmp_path, manager_args=["--restart-grace", "2s"])
    spec = DatasetSpec(name="big", uri=uri, kind=kind, quota_bytes=QUOTA, policy="stream")
    state = os.path.join(cluster.state_dir, "manager", "manager.sqlite3")
    with KSpeedClient(config=config_for(cluster, failover_timeout="90s")) as client:
        ds = client.dataset(spec, batch_size=BATCH, seed=SEED, ring_bytes=1 << 20, quiet=True)
        shares = client.manager.dataset("big").shares
        assert {s.policy for s in shares} == {"stream"} and all(s.num_regions >= 3 * s.memory_regions for s in shares)
        cluster.add_server()
        cluster.add_server()
        by_id = {s.ready["id"]: s for s in cluster.servers}
        cluster_id = client.manager.status().cluster_id
        done: list[str] = []

        def kill(k: int) -> None:
            if k == 1:
                victim = by_id[holders_of(client, "big")[0]]
                victim.signal(signal.SIGKILL)
                done.append(victim.ready["id"])

        def stop(k: int) -> None:
            if k == 1:
                leaving = by_id[next(h for h in holders_of(client, "big") if h not in done)]
                assert leaving.stop() == 0  # systemctl stop, and it stays stopped
                done.append(leaving.ready["id"])

        def lose_manager_state(k: int) -> None:
            if k == 1:
                assert cluster.manager.stop() == 0
                for suffix in ("", "-wal", "-shm"):
                    if os.path.exists(state + suffix):
                        os.unlink(state + suffix)
                cluster.start_manager()

        check_epoch(ds, files, 0, kill)
        check_epoch(ds, files, 1, stop)
        check_epoch(ds, files, 2, lose_manager_state)
        check_epoch(ds, files, 3)  # and on, with the registry rebuilt from the servers

        stats = ds.stats()
        assert stats["replaced_servers"] >= 2 and stats["fenced_grants"] >= 1, stats
        assert client.manager.status().cluster_id == cluster_id  # taken back, never replaced
        # The shares are with servers that run: neither the killed nor the stopped one holds any.
        wait_for(lambda: not set(holders_of(client, "big")) & set(done) or None, 30, "the shares moved")
        running = {s.ready["id"] for s in cluster.servers if s.running}
        assert set(holders_of(client, "big")) <= running and len(running) == 2
        ds.close()
    with open(cluster.manager.log_file, encoding="utf-8") as fh:
        assert f"cluster id {cluster_id} taken over from server" in fh.read()
