"""A link cut across network namespaces mid-epoch on ``tcp``: the share moves to a spare and the loop only pauses.

The manager, two servers holding the dataset, a spare registered after it and the client each run
in their own namespace of a :class:`tests.netlab.NetLab` (root only; skipped with the reason
elsewhere). The client reads over the ``tcp`` rail through a shaped switch port, so grants are
always in flight. Mid-epoch the switch port of one holder goes down (``ip link set p-s0 down``: its
cable is pulled) for longer than the manager's failure timeout: the manager declares it failed and
moves its share to the spare; the client hears nothing from it for ``completion_timeout``, fences
the path and follows the share. Every sample arrives exactly once, in the sampler's order, bytes
intact. Then the link comes back: the healed server learns it was declared failed and registers
again as a new incarnation; nothing moves back and the client reads on undisturbed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kspeed.cli.cluster import wait_for
from tests.conftest import FAST_MANAGER  # the loopback failover tests' timers: a server silent for 2 s is failed
from tests.integration.test_client import loader_order
from tests.integration.test_incast import LabCluster, lab_cluster
from tests.integration.test_production import metric

pytestmark = pytest.mark.slow

#: Equal files, so the two holders own halves; a few epochs through the shaped port take ~10 s.
FILES, SIZE = 1200, 32 * 1024
BATCH, SEED, EPOCHS = 16, 5, 3
#: The client's switch port: slow enough that the link is the bottleneck (grants always in flight).
RATE = "100mbit"
RING_BYTES = 4 << 20
#: The client takes a server silent for 2 s for lost, and waits up to a minute for its share to move.
CLIENT_ENV = {"KSPEED_COMPLETION_TIMEOUT": "2s", "KSPEED_FAILOVER_TIMEOUT": "60s"}


@pytest.fixture
def linked(tmp_path) -> Iterator[LabCluster]:
    """Two holders ``s0``/``s1``, a spare namespace ``s2`` (nothing runs there yet) and a client ``c0``."""
    with lab_cluster(
        tmp_path, servers=2, spares=1, clients=["c0"], sizes=[SIZE] * FILES, manager_args=FAST_MANAGER
    ) as env:
        env.lab.limit_rate("c0", RATE)
        yield env


def set_link(env: LabCluster, host: str, state: str) -> None:
    """Bring the switch port of ``host``'s link ``down`` (its ``eth0`` loses the carrier) or ``up``."""
    subprocess.run(["ip", "-n", env.lab.switch, "link", "set", env.lab.port(host), state], check=True)


def status(env: LabCluster) -> dict:
    """``kspeed status --json``, asked from the client's namespace."""
    return json.loads(env.kspeed("c0", "status", "--json"))


def server(env: LabCluster, server_id: str) -> dict:
    return next((s for s in status(env)["servers"] if s["id"] == server_id), {})


def holders(env: LabCluster) -> set[str]:
    return {s["server_id"] for s in status(env)["datasets"][0]["shares"]}


def manager_metric(env: LabCluster, name: str) -> float:
    """A manager metric, scraped from the client's namespace (the test's own cannot reach the lab)."""
    scrape = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"
    url = f"http://{env.cluster.http_address}/metrics"
    return metric(env.lab.run("c0", sys.executable, "-c", scrape, url).stdout, name)


@pytest.mark.timeout(150)
def test_a_link_cut_mid_epoch_on_tcp_is_a_pause_not_an_error(linked):
    env = linked
    spare = env.cluster.add_server()  # in s2, registered after the dataset: it holds nothing
    by_host = {f"s{i}": s.ready["id"] for i, s in enumerate(env.cluster.servers)}
    assert holders(env) == {by_host["s0"], by_host["s1"]}
    victim = by_host["s0"]
    incarnation = server(env, victim)["incarnation"]
    epoch_bytes = FILES * SIZE

    out = env.tmp / "link-cut.json"
    proc = env.start_client(
        "c0",
        out,
        CLIENT_ENV,
        "--batch-size",
        str(BATCH),
        "--batches",
        str(EPOCHS * -(-FILES // BATCH)),
        "--seed",
        str(SEED),
        "--ring-bytes",
        str(RING_BYTES),
        "--verify",
        str(env.tmp / "data"),
    )
    try:
        env.wait_iterating(proc)
        # Cut once a quarter of the first epoch went through the client's port: grants are in flight.
        sent = env.lab.port_stats("c0")["qdisc_sent_bytes"]
        wait_for(
            lambda: env.lab.port_stats("c0")["qdisc_sent_bytes"] - sent > epoch_bytes // 4 or None,
            30,
            "a quarter of the epoch on the wire",
            interval=0.05,
        )
        cut_at = time.time()
        set_link(env, "s0", "down")
        # Down beyond the failure timeout: declared failed, its share moved to the spare.
        wait_for(
            lambda: holders(env) == {by_host["s1"], spare.ready["id"]} or None, 30, "s0's share moved to the spare"
        )
        assert server(env, victim)["state"] == "failed"
        set_link(env, "s0", "up")
        back = wait_for(
            lambda: (s := server(env, victim)).get("state") == "ready" and s["incarnation"] > incarnation and s,
            30,
            "the healed server back as a new incarnation",
        )
        back_at = time.time()
    except BaseException:
        proc.kill()  # what failed above is the story; the lab's teardown reaps the rest
        proc.wait()
        raise
    record = env.finish_client(proc, out, timeout=60)

    assert record["rail"] == "tcp", record["rail"]
    assert record["mismatched"] == [], f"samples with other bytes than their files: {record['mismatched'][:20]}"
    assert record["epochs"] == EPOCHS
    for epoch in range(EPOCHS):  # every sample once, in the sampler's order
        got = [ids for ids, e in zip(record["batch_ids"], record["batch_epoch"]) if e == epoch]
        assert got == loader_order(FILES, 1, 0, True, SEED, False, epoch, BATCH), f"epoch {epoch}"
    stats = record["stats"]
    assert stats["replaced_servers"] >= 1 and stats["fenced_grants"] >= 1, stats  # the cut hit grants in flight
    done = [record["t0"] + t for t in record["batch_done_s"]]
    first = [t for t, epoch in zip(done, record["batch_epoch"]) if epoch == 0]
    assert first[0] < cut_at < first[-1], "the link was not cut mid-epoch"
    assert done[-1] > back_at, "the client had finished before the healed server was back"

    # The healed server took nothing back: the share stays with the spare, moved once.
    assert back["address"].rpartition(":")[0] == env.lab.address("s0")
    assert holders(env) == {by_host["s1"], spare.ready["id"]}
    assert status(env)["datasets"][0]["state"] == "ready"
    assert manager_metric(env, "kspeed_manager_failovers_total") == 1
