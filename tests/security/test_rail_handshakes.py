"""Item 1 of the security review: slow handshakes at a client's ``tcp`` receiver during a failover.

Dialers that drip a hello one byte at a time need no credential; they held every handshake slot of
the receiver, so the new holder's feeders were refused and the job ended with ``PeerLostError``.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

from kspeed import KSpeedClient
from kspeed.rdma.rails import available_rails
from kspeed.rdma.tcp import wire
from tests.integration.test_client import config_for
from tests.integration.test_failover import BATCH, SEED, check_epoch, slow_cluster
from tests.security.attacks import drip_handshakes

pytestmark = [
    pytest.mark.security,
    pytest.mark.skipif("tcp" not in available_rails(), reason="the tcp rail is unavailable here"),
]

#: The client's rails' default connect_timeout: each handshake's whole deadline.
CONNECT_TIMEOUT = 5.0


@pytest.mark.timeout(120)
def test_a_failover_completes_while_dialers_drip_at_the_clients_tcp_receiver(cluster_factory, tmp_path):
    cluster, files, spec = slow_cluster(cluster_factory, tmp_path)
    with KSpeedClient(config=config_for(cluster, failover_timeout="20s")) as client:
        ds = client.dataset(spec, batch_size=BATCH, seed=SEED, rail="tcp", ring_bytes=2 << 20, quiet=True)
        cluster.add_server()  # the spare that takes the victim's share
        material = json.loads(ds._feed.receiver.material)
        hello = wire.HELLO.pack(wire.MAGIC, wire.BULK, material["consumer"], 0) + bytes(32)
        stop, started = threading.Event(), threading.Event()
        reports = []
        # As many dialers as the receiver had handshake slots, from the servers' own address.
        attack = threading.Thread(
            target=lambda: reports.append(
                drip_handshakes(
                    (material["host"], material["port"]),
                    32,
                    payload=hello,
                    interval=0.5,
                    duration=60,
                    stop=stop,
                    started=started,
                )
            )
        )
        attack.start()
        try:
            assert started.wait(10)
            begun = time.monotonic()
            shares = client.manager.dataset("imgs").shares
            biggest = max(shares, key=lambda share: share.end_id - share.first_id)
            victim = next(s for s in cluster.servers if s.ready["id"] == biggest.server_id)
            # The new holder's feeders dial the receiver while the drip goes on; the epoch is whole.
            check_epoch(ds, files, 0, lambda k: k == 0 and victim.signal(signal.SIGKILL))
            assert ds.stats()["replaced_servers"] == 1
            # The attack outlasts the first dialers' deadline, so the report shows it enforced.
            stop.wait(max(0.0, begun + CONNECT_TIMEOUT + 1 - time.monotonic()))
        finally:
            stop.set()
            attack.join(timeout=10)
        (report,) = reports
        assert report.refused == 0 and report.closed_by_target >= 32, report
        assert report.longest_held < CONNECT_TIMEOUT + 2, report  # each closed by its deadline
        ds.close()
