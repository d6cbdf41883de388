"""A server that dies mid-epoch: its share moves to a spare and the training loop only pauses.

Real daemons on loopback: two servers hold the dataset, a third registers afterwards as a spare.
The holder of the first share is killed while batches are in flight; the manager declares it
failed (2 s here), moves its share to the spare, which reloads it in the order the committed plans
consume it; the client fences the dead path, follows the share and grants again what was in
flight. Every sample of the epoch arrives exactly once, in the sampler's order, bytes intact.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from kspeed import DatasetSpec, KSpeedClient
from kspeed.cli.cluster import wait_for
from kspeed.control.rpc import map_rpc_errors
from kspeed.errors import NotHeldError
from kspeed.proto import kspeed_pb2, kspeed_pb2_grpc
from kspeed.rdma.rails import available_rails
from tests.helpers import http_get
from tests.integration.test_client import config_for, loader_order
from tests.integration.test_datasets import make_tree
from tests.integration.test_production import metric

BATCH = 8
SEED = 5


def slow_cluster(cluster_factory, tmp_path, env=None):
    """Two servers over a backend that takes 20 ms a file, with two reading threads each, and a
    dataset more than one server holds, not preloaded: grants wait on production, so a kill finds
    them in flight. ``env`` is added to the daemons' environment. Returns ``(cluster, files, spec)``."""
    files = make_tree(tmp_path / "imgs", max_size=128 * 1024)
    slow = ["--backend-allow", f"slowfile://{tmp_path}", "--backend-options", '{"slowfile": {"latency": 0.02}}']
    cluster = cluster_factory(2, server_args=[*slow, "--preload-threads", "2", "--production-threads", "2"], env=env)
    return cluster, files, DatasetSpec(name="imgs", uri=f"slowfile://{tmp_path / 'imgs'}", labels="dirname")


def plain_cluster(cluster_factory, tmp_path, max_size: int):
    """Two servers over the local files of a dataset of files up to ``max_size`` bytes. Returns
    ``(cluster, files, spec)``."""
    files = make_tree(tmp_path / "imgs", max_size=max_size)
    cluster = cluster_factory(2, server_args=["--backend-allow", str(tmp_path)])
    return cluster, files, DatasetSpec(name="imgs", uri=str(tmp_path / "imgs"), labels="dirname")


def check_epoch(ds, files, epoch: int, on_batch=None) -> None:
    """Read one epoch: every sample once, in the sampler's order, bytes intact; ``on_batch(k)``
    runs after batch ``k`` arrived (to kill or hang a server mid-epoch)."""
    keys = list(files)
    got = []
    ds.set_epoch(epoch)
    for k, batch in enumerate(ds):
        for i, sid in enumerate(batch.ids.tolist()):
            assert batch.numpy(i).tobytes() == files[keys[sid]], f"epoch {epoch} sample {sid}"
        got.append(batch.ids.tolist())
        if on_batch is not None:
            on_batch(k)
    assert got == loader_order(len(files), 1, 0, True, SEED, False, epoch, BATCH), f"epoch {epoch}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rail", available_rails())
def test_a_holder_killed_mid_epoch_is_a_pause_not_an_error(cluster_factory, tmp_path, rail):
    cluster, files, spec = slow_cluster(cluster_factory, tmp_path)
    with KSpeedClient(config=config_for(cluster, failover_timeout="60s")) as client:
        ds = client.dataset(spec, batch_size=BATCH, seed=SEED, rail=rail, ring_bytes=2 << 20, quiet=True)
        spare = cluster.add_server()  # registered after the dataset: it holds nothing
        shares = client.manager.dataset("imgs").shares
        holders = {s.server_id for s in shares}
        assert spare.ready["id"] not in holders and len(holders) == 2
        biggest = max(shares, key=lambda share: share.end_id - share.first_id)
        victim = next(s for s in cluster.servers if s.ready["id"] == biggest.server_id)

        # The server and its feeders die at once, as with their host; the epoch is still whole.
        check_epoch(ds, files, 0, lambda k: k == 0 and victim.signal(signal.SIGKILL))

        stats = ds.stats()
        assert stats["replaced_servers"] == 1 and stats["fenced_grants"] >= 1, stats
        moved = {s.server_id for s in client.manager.dataset("imgs").shares}
        assert moved == (holders - {victim.ready["id"]}) | {spare.ready["id"]}
        # The quarantined ranges come back once the dead feeders' mappings are gone.
        wait_for(lambda: ds.stats()["ring_quarantined"] == 0 or None, 10, "the quarantine lifted")
        ds.close()
    assert metric(http_get(cluster.http_address, "/metrics")[1], "kspeed_manager_failovers_total") == 1


@pytest.mark.timeout(120)
def test_without_a_spare_a_survivor_with_room_takes_the_share(cluster_factory, tmp_path):
    cluster, files, spec = plain_cluster(cluster_factory, tmp_path, 128 * 1024)
    with KSpeedClient(config=config_for(cluster, failover_timeout="60s")) as client:
        ds = client.dataset(spec, batch_size=BATCH, seed=SEED, ring_bytes=2 << 20, quiet=True)
        ds.preload()
        shares = client.manager.dataset("imgs").shares
        victim_id = shares[0].server_id
        survivor_id = shares[1].server_id
        victim = next(s for s in cluster.servers if s.ready["id"] == victim_id)
        check_epoch(ds, files, 0, lambda k: k == 0 and victim.signal(signal.SIGKILL))
        both = [survivor_id, survivor_id]  # both shares, each with its copy (the epoch may end before the move)
        wait_for(lambda: holders_of(client) == both or None, 30, "the share moved to the survivor")
        assert not any(s.on_demand for s in client.manager.dataset("imgs").shares)
        ready = kspeed_pb2.DatasetState.DATASET_STATE_READY
        wait_for(lambda: client.manager.dataset("imgs").state == ready or None, 30, "the moved share loaded")
        check_epoch(ds, files, 1)
        assert ds.stats()["replaced_servers"] == 1
        ds.close()
    assert metric(http_get(cluster.http_address, "/metrics")[1], "kspeed_manager_failovers_total") == 1


@pytest.mark.timeout(180)
def test_without_room_a_survivor_serves_the_share_on_demand_until_a_server_has_room(cluster_factory, tmp_path):
    # 6 MiB pools of 1 MiB regions, one of them the production window: 5 regions free on each
    # server; the dataset takes 3 or 4 on each, so neither can hold the other's share.
    files = make_tree(tmp_path / "imgs", per_class=80, max_size=256 * 1024, seed=3)
    memory = ["--memory", "6MiB", "--region-size", "1MiB"]
    cluster = cluster_factory(2, server_args=["--backend-allow", str(tmp_path), *memory])
    spec = DatasetSpec(name="imgs", uri=str(tmp_path / "imgs"), labels="dirname")
    with KSpeedClient(config=config_for(cluster, failover_timeout="60s")) as client:
        ds = client.dataset(spec, batch_size=BATCH, seed=SEED, ring_bytes=2 << 20, quiet=True)
        ds.preload()
        shares = client.manager.dataset("imgs").shares
        assert all(s.num_regions >= 3 for s in shares), shares
        victim_id, survivor_id = shares[0].server_id, shares[1].server_id
        victim = next(s for s in cluster.servers if s.ready["id"] == victim_id)
        check_epoch(ds, files, 0, lambda k: k == 0 and victim.signal(signal.SIGKILL))

        # The epoch may end before the manager declares the victim failed (its feeders had
        # written its part); the next one is served on demand either way.
        on_demand = [(survivor_id, True), (survivor_id, False)]
        wait_for(
            lambda: [(s.server_id, s.on_demand) for s in client.manager.dataset("imgs").shares] == on_demand or None,
            30,
            "the share served on demand by the survivor",
        )
        info = client.manager.dataset("imgs")
        assert info.state == kspeed_pb2.DatasetState.DATASET_STATE_DEGRADED
        text = http_get(cluster.http_address, "/metrics")[1]
        assert metric(text, "kspeed_manager_datasets", '{state="degraded"}') == 1
        status = subprocess.run(
            [sys.executable, "-m", "kspeed.cli", "status", "--manager", cluster.address, "--auth", "none"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        assert f"samples 0..{shares[0].end_id - 1} are served on demand by {survivor_id}" in status, status
        ds.preload(quiet=True, timeout=20)  # returns: the share served on demand has nothing to load
        check_epoch(ds, files, 1)  # degraded: read from the backend again, still whole and in order

        spare = cluster.add_server()  # room at last: the share moves there and is loaded
        spare_id = spare.ready["id"]
        wait_for(lambda: holders_of(client)[0] == spare_id or None, 30, "the share moved to the new server")
        check_epoch(ds, files, 2)
        ready = kspeed_pb2.DatasetState.DATASET_STATE_READY
        wait_for(lambda: client.manager.dataset("imgs").state == ready or None, 30, "the dataset whole again")
        assert not any(s.on_demand for s in client.manager.dataset("imgs").shares)
        assert ds.stats()["replaced_servers"] == 2, ds.stats()
        ds.close()
    assert metric(http_get(cluster.http_address, "/metrics")[1], "kspeed_manager_failovers_total") == 2


def holders_of(client, name: str = "imgs") -> list[str]:
    return [s.server_id for s in client.manager.dataset(name).shares]


def freeze(server, seconds: float) -> threading.Thread:
    """SIGSTOP a server with its helper processes (as a hung host) for ``seconds``, in the background."""
    group = server.process.pid  # daemons start in their own session: the group is theirs alone

    def run() -> None:
        os.killpg(group, signal.SIGSTOP)
        time.sleep(seconds)
        os.killpg(group, signal.SIGCONT)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rail", available_rails())
def test_chaos_three_kills_and_a_hung_server_over_three_epochs(cluster_factory, tmp_path, rail):
    cluster, files, spec = slow_cluster(cluster_factory, tmp_path)
    keys = list(files)
    with KSpeedClient(config=config_for(cluster, failover_timeout="60s")) as client:
        ds = client.dataset(spec, batch_size=BATCH, seed=SEED, rail=rail, ring_bytes=2 << 20, quiet=True)
        for _ in range(4):  # a spare for each kill and for the hung server
            cluster.add_server()
        by_id = {s.ready["id"]: s for s in cluster.servers}
        killed, hung = [], None
        # Its own loop, not check_epoch: the kills must land on work in flight, and through the
        # helper (which lets go of an epoch's last batch earlier) one sometimes landed after its
        # server had written its part of the epoch.
        for epoch in range(3):
            ds.set_epoch(epoch)
            got = []
            for k, batch in enumerate(ds):
                for i, sid in enumerate(batch.ids.tolist()):
                    assert batch.numpy(i).tobytes() == files[keys[sid]], f"epoch {epoch} sample {sid}"
                got.append(batch.ids.tolist())
                if k == 1:  # kill a holder with grants in flight (not the hung one: each loss is another server)
                    alive = [h for h in holders_of(client) if hung is None or h != hung.ready["id"]]
                    victim = by_id[alive[epoch % len(alive)]]
                    victim.signal(signal.SIGKILL)
                    killed.append(victim.ready["id"])
                if epoch == 1 and k == 6:  # and hang the other holder longer than the failure timeout
                    hung = by_id[holders_of(client)[0]]
                    assert hung.ready["id"] not in killed
                    incarnation = next(r.incarnation for r in client.manager.servers() if r.id == hung.ready["id"])
                    freeze(hung, 5.0)
            assert got == loader_order(len(files), 1, 0, True, SEED, False, epoch, BATCH), f"epoch {epoch}"
        stats = ds.stats()
        # Each loss the feed still needed was carried over: three kills and the hung server make
        # four, but the last kill can land after its server wrote its part of the final epoch.
        assert stats["replaced_servers"] >= 3, stats
        assert stats["fenced_grants"] >= 3, stats  # grants in flight were cut and granted again
        assert hung is not None
        # Every killed holder's share moved (the last one's perhaps only after the epoch ended).
        wait_for(lambda: not set(holders_of(client)) & set(killed) or None, 15, "the killed servers' shares moved")
        # The hung server came back as a new incarnation (holding nothing of its old share; it may
        # since have taken another one over, as any spare).
        wait_for(
            lambda: (
                any(r.id == hung.ready["id"] and r.incarnation > incarnation for r in client.manager.servers()) or None
            ),
            30,
            "the hung server back as a new incarnation",
        )
        ds.close()


@pytest.mark.timeout(120)
def test_training_goes_on_while_the_manager_restarts(cluster_factory, tmp_path):
    cluster, files, spec = plain_cluster(cluster_factory, tmp_path, 128 * 1024)
    with KSpeedClient(config=config_for(cluster)) as client:
        ds = client.dataset(spec, batch_size=BATCH, seed=SEED, ring_bytes=1 << 20, quiet=True)
        ds.preload()
        before = {r.id: r.incarnation for r in client.manager.servers()}
        holders = [s.server_id for s in client.manager.dataset("imgs").shares]

        def restart(k: int) -> None:
            if k == 2:
                assert cluster.manager.stop() == 0  # the rest of the epoch runs without a manager
            if k == 8:
                time.sleep(3)  # longer than the servers' failure timeout: nobody may be declared failed
                cluster.start_manager()

        check_epoch(ds, files, 0, restart)
        check_epoch(ds, files, 1)
        # Back, the manager knows the same servers, ready, as the same incarnations.
        wait_for(lambda: all(r.state == 2 for r in client.manager.servers()) or None, 10, "servers ready")
        assert {r.id: r.incarnation for r in client.manager.servers()} == before
        ready = kspeed_pb2.DatasetState.DATASET_STATE_READY  # once the servers' heartbeats say so again
        wait_for(lambda: client.manager.dataset("imgs").state == ready or None, 10, "the dataset ready")
        assert [s.server_id for s in client.manager.dataset("imgs").shares] == list(holders)  # nothing moved
        ds.close()


@pytest.mark.timeout(120)
def test_a_server_asked_about_a_share_it_let_go_says_so(cluster_factory, tmp_path):
    # What a client with a stale view hears from the server its share moved away from: a lookup
    # or a plan for its feed there is NotHeldError (the client follows the share as after a lost
    # server), not a bare "not found" that would end the job.
    cluster, files, spec = plain_cluster(cluster_factory, tmp_path, 64 * 1024)
    with KSpeedClient(config=config_for(cluster)) as client:
        ds = client.dataset(spec, batch_size=BATCH, seed=SEED, ring_bytes=1 << 20, quiet=True)
        ds.preload()
        check_epoch(ds, files, 0)
        path = ds._feed.paths[0]
        link, first = path.link, path.link.first_id
        server = kspeed_pb2_grpc.ServerStub(grpc.insecure_channel(link.address))
        server.DropDataset(kspeed_pb2.DatasetRequest(name="imgs", first_id=first))  # as the manager does
        with pytest.raises(NotHeldError, match=rf"holds no share starting at sample {first}"):
            link.lookup("imgs", np.arange(len(files), dtype=np.int64))
        stale = rf"no longer holds share {first}\.\. of dataset 'imgs'"
        with pytest.raises(NotHeldError, match=stale), map_rpc_errors(link.name):
            server.CommitPlan(kspeed_pb2.PlanChunk(feed_id=path.feed_id))
        ds.close()
