"""A server that dies mid-epoch: its share moves to a spare and the training loop only pauses.

Real daemons on loopback: two servers hold the dataset, a third registers afterwards as a spare.
The holder of the first share is killed while batches are in flight; the manager declares it
failed (2 s here), moves its share to the spare, which reloads it in the order the committed plans
consume it; the client fences the dead path, follows the share and grants again what was in
flight. Every sample of the epoch arrives exactly once, in the sampler's order, bytes intact.
"""

from __future__ import annotations

import signal

import pytest

from kspeed import DatasetSpec, KSpeedClient
from kspeed.cli.cluster import wait_for
from kspeed.rdma.rails import available_rails
from tests.integration.test_client import config_for, loader_order
from tests.integration.test_datasets import make_tree

BATCH = 8
SEED = 5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rail", available_rails())
def test_a_holder_killed_mid_epoch_is_a_pause_not_an_error(cluster_factory, tmp_path, rail):
    files = make_tree(tmp_path / "imgs", max_size=128 * 1024)  # more than one server holds
    keys = list(files)
    # A backend that takes 20 ms a file, not preloaded: grants wait on production, so the kill
    # finds them in flight.
    slow = ["--backend-allow", f"slowfile://{tmp_path}", "--backend-options", '{"slowfile": {"latency": 0.02}}']
    cluster = cluster_factory(2, server_args=[*slow, "--preload-threads", "2", "--production-threads", "2"])
    spec = DatasetSpec(name="imgs", uri=f"slowfile://{tmp_path / 'imgs'}", labels="dirname")
    with KSpeedClient(config=config_for(cluster, failover_timeout="60s")) as client:
        ds = client.dataset(spec, batch_size=BATCH, seed=SEED, rail=rail, ring_bytes=2 << 20, quiet=True)
        spare = cluster.add_server()  # registered after the dataset: it holds nothing
        shares = client.manager.dataset("imgs").shares
        holders = {s.server_id for s in shares}
        assert spare.ready["id"] not in holders and len(holders) == 2
        biggest = max(shares, key=lambda share: share.end_id - share.first_id)
        victim = next(s for s in cluster.servers if s.ready["id"] == biggest.server_id)

        got = []
        for k, batch in enumerate(ds):
            for i, sid in enumerate(batch.ids.tolist()):
                assert batch.numpy(i).tobytes() == files[keys[sid]], f"sample {sid}"
            got.append(batch.ids.tolist())
            if k == 0:  # the server and its feeders die at once, as with their host
                victim.signal(signal.SIGKILL)
        assert got == loader_order(len(files), 1, 0, True, SEED, False, 0, BATCH)  # once each, in order

        stats = ds.stats()
        assert stats["replaced_servers"] == 1 and stats["fenced_grants"] >= 1, stats
        moved = {s.server_id for s in client.manager.dataset("imgs").shares}
        assert moved == (holders - {victim.ready["id"]}) | {spare.ready["id"]}
        # The quarantined ranges come back once the dead feeders' mappings are gone.
        wait_for(lambda: ds.stats()["ring_quarantined"] == 0 or None, 10, "the quarantine lifted")
        ds.close()
