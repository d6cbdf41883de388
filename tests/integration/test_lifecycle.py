"""A server's clean ways out and the manager's lost registry, as an operator meets them, with real
daemons on loopback and a job reading throughout.

- a **restart** (SIGTERM, then the same server back within ``restart_grace``) keeps and re-adopts
  its pool: the job pauses for the restart, nothing moves;
- a **stop past the grace period** moves the server's shares, as a failure does;
- a **drain** (``kspeed server drain``) hands the shares off while the server still serves, then
  the server retires, discarding its pool;
- a manager whose state file is **lost** or **damaged** gets its registry back from the servers.
Every epoch of the job is whole, in order, bytes intact.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kspeed import DatasetSpec, KSpeedClient
from kspeed.cli.cluster import wait_for
from kspeed.proto import kspeed_pb2
from tests.helpers import http_get
from tests.integration.test_client import config_for
from tests.integration.test_datasets import make_tree
from tests.integration.test_failover import BATCH, SEED, check_epoch, holders_of, plain_cluster
from tests.integration.test_production import metric

S = kspeed_pb2.ServerState


def lifecycle_cluster(cluster_factory, tmp_path, *, grace: str, servers: int = 2):
    """Two servers over local files (a dataset both hold, preloaded by the test), the manager
    waiting ``grace`` for a stopped server. Returns ``(cluster, files, spec)``."""
    cluster, files, spec = plain_cluster(cluster_factory, tmp_path, 128 * 1024)
    cluster.manager.stop()
    cluster.manager.argv += ["--restart-grace", grace]
    cluster.start_manager()
    cluster.wait_members()
    return cluster, files, spec


def failovers(cluster) -> float:
    return metric(http_get(cluster.http_address, "/metrics")[1], "kspeed_manager_failovers_total")


def cli(cluster, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kspeed.cli", *args, "--manager", cluster.address, "--auth", "none"],
        capture_output=True,
        text=True,
        timeout=120,
        check=check,
    )


@pytest.mark.timeout(120)
def test_a_restart_within_the_grace_period_is_a_pause_and_nothing_moves(cluster_factory, tmp_path, monkeypatch):
    # The restarted server is dialled as soon as it is back (a newer incarnation than the one the
    # feed was made to), never after the wait for a server still called ready: the restart is
    # usually over before the job notices it, and the job then waited those 5 s.
    monkeypatch.setattr("kspeed.client.feeding.failover.SAME_SERVER_AFTER", 1000.0)
    cluster, files, spec = lifecycle_cluster(cluster_factory, tmp_path, grace="30s")
    with KSpeedClient(config=config_for(cluster, failover_timeout="60s")) as client:
        ds = client.dataset(spec, batch_size=BATCH, seed=SEED, ring_bytes=1 << 20, quiet=True)
        ds.preload()
        before = holders_of(client)
        victim = next(s for s in cluster.servers if s.ready["id"] == before[0])

        def restart(k: int) -> None:
            if k == 1:  # systemctl restart: SIGTERM, then the same server (state dir, pool) again
                assert victim.stop() == 0
                record = next(r for r in client.manager.servers() if r.id == victim.ready["id"])
                assert record.state == S.SERVER_STATE_STOPPED, record
                cluster.start_server(victim)

        check_epoch(ds, files, 0, restart)
        check_epoch(ds, files, 1)
        assert holders_of(client) == before  # nothing moved
        assert failovers(cluster) == 0
        ready = kspeed_pb2.DatasetState.DATASET_STATE_READY
        info = wait_for(
            lambda: ((i := client.manager.dataset("imgs")).state == ready and i) or None, 20, "the dataset ready"
        )
        assert info.progress.samples_loaded == len(files)  # the pool re-adopted: loaded, not reloaded
        ds.close()
    with open(victim.log_file, encoding="utf-8") as fh:
        log = fh.read()
    assert "re-adopted after restart" in log


@pytest.mark.timeout(120)
def test_a_stop_past_the_grace_period_moves_the_shares_and_the_job_goes_on(cluster_factory, tmp_path):
    cluster, files, spec = lifecycle_cluster(cluster_factory, tmp_path, grace="1s")
    with KSpeedClient(config=config_for(cluster, failover_timeout="60s")) as client:
        ds = client.dataset(spec, batch_size=BATCH, seed=SEED, ring_bytes=1 << 20, quiet=True)
        ds.preload()
        spare = cluster.add_server()
        before = holders_of(client)
        victim = next(s for s in cluster.servers if s.ready["id"] == before[0])
        check_epoch(ds, files, 0, lambda k: k == 1 and victim.stop() == 0)  # systemctl stop, for good
        wait_for(lambda: holders_of(client)[0] == spare.ready["id"] or None, 20, "the share moved to the spare")
        check_epoch(ds, files, 1)
        gone = next(r for r in client.manager.servers(include_left=True) if r.id == victim.ready["id"])
        assert gone.state == S.SERVER_STATE_LEFT and "not back within restart_grace" in gone.state_reason
        assert failovers(cluster) == 1
        ds.close()


@pytest.mark.timeout(150)
def test_a_drain_hands_the_shares_off_while_serving_then_the_server_retires(cluster_factory, tmp_path):
    cluster, files, spec = lifecycle_cluster(cluster_factory, tmp_path, grace="30s")
    with KSpeedClient(config=config_for(cluster, failover_timeout="60s")) as client:
        ds = client.dataset(spec, batch_size=BATCH, seed=SEED, ring_bytes=1 << 20, quiet=True)
        ds.preload()
        spare = cluster.add_server()
        before = holders_of(client)
        leaving = next(s for s in cluster.servers if s.ready["id"] == before[0])
        pool = cluster.pool_dir(leaving)
        assert os.listdir(pool)
        drained: dict[str, subprocess.Popen] = {}
        waits: list[float] = []
        last = [time.monotonic()]

        def drain(k: int) -> None:
            now = time.monotonic()
            waits.append(now - last[0])
            if k == 1 and "cli" not in drained:
                argv = [sys.executable, "-m", "kspeed.cli", "server", "drain", leaving.ready["id"], "--wait"]
                argv += ["--manager", cluster.address, "--auth", "none"]
                drained["cli"] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            last[0] = time.monotonic()

        for epoch in range(3):  # the handoff lands somewhere in these epochs
            check_epoch(ds, files, epoch, drain)
            if not leaving.running:
                break
        out, _ = drained["cli"].communicate(timeout=60)
        assert drained["cli"].returncode == 0, out
        assert f"draining {leaving.ready['id']}: 1 share(s) to hand off (imgs@0)" in out
        assert f"{leaving.ready['id']} left: drained" in out
        assert leaving.process.wait(timeout=30) == 0  # it retired by itself
        assert not os.path.exists(pool)  # and discarded its pool
        assert holders_of(client)[0] == spare.ready["id"]
        check_epoch(ds, files, 3)
        assert failovers(cluster) == 0  # handed off, not failed over
        # Where the job waited (the figures, not a check: a drain's switch is one reconnect).
        print(f"drain: longest wait between batches {max(waits):.3f}s over {len(waits)} batches")
        ds.close()


@pytest.mark.timeout(60)
def test_a_drain_with_nowhere_to_go_is_refused_and_changes_nothing(cluster_factory, tmp_path):
    # 6 MiB pools of 1 MiB regions, one the production window: 5 free on each; each server holds 3
    # or 4 regions of the dataset, so neither has room for the other's share.
    files = make_tree(tmp_path / "imgs", per_class=80, max_size=256 * 1024, seed=3)
    memory = ["--memory", "6MiB", "--region-size", "1MiB"]
    cluster = cluster_factory(2, server_args=["--backend-allow", str(tmp_path), *memory])
    spec = DatasetSpec(name="imgs", uri=str(tmp_path / "imgs"), labels="dirname")
    with KSpeedClient(config=config_for(cluster)) as client:
        ds = client.dataset(spec, batch_size=BATCH, seed=SEED, ring_bytes=2 << 20, quiet=True)
        share = client.manager.dataset("imgs").shares[0]
        assert share.num_regions >= 3
        done = cli(cluster, "server", "drain", share.server_id, check=False)
        assert done.returncode == 1
        assert f"cannot drain {share.server_id}: no ready server has {share.num_regions} region(s) free" in done.stderr
        assert "--allow-degraded" in done.stderr, done.stderr
        assert all(r.state == S.SERVER_STATE_READY for r in client.manager.servers())
        check_epoch(ds, files, 0)
        ds.close()


@pytest.mark.timeout(150)
def test_a_manager_that_lost_its_state_file_gets_its_registry_back_from_the_servers(cluster_factory, tmp_path):
    cluster, files, spec = lifecycle_cluster(cluster_factory, tmp_path, grace="30s")
    with KSpeedClient(config=config_for(cluster, failover_timeout="60s")) as client:
        ds = client.dataset(spec, batch_size=BATCH, seed=SEED, ring_bytes=1 << 20, quiet=True)
        ds.preload()
        cluster_id = client.manager.status().cluster_id
        before = holders_of(client)
        state = os.path.join(cluster.state_dir, "manager", "manager.sqlite3")

        def lose(k: int) -> None:
            if k == 2:
                assert cluster.manager.stop() == 0
                for suffix in ("", "-wal", "-shm"):
                    if os.path.exists(state + suffix):
                        os.unlink(state + suffix)
                cluster.start_manager()

        check_epoch(ds, files, 0, lose)
        check_epoch(ds, files, 1)  # the next epoch's lookups reach servers that kept their shares
        wait_for(lambda: holders_of(client) == before or None, 20, "the dataset rebuilt")
        assert client.manager.status().cluster_id == cluster_id  # never silently replaced
        check_epoch(ds, files, 2)
        ds.close()
    with open(cluster.manager.log_file, encoding="utf-8") as fh:
        log = fh.read()
    assert f"cluster id {cluster_id} taken over from server" in log


@pytest.mark.timeout(90)
def test_a_damaged_state_file_stops_the_manager_with_the_command_that_rebuilds_it(cluster_factory, tmp_path):
    cluster, _, spec = lifecycle_cluster(cluster_factory, tmp_path, grace="30s")
    with KSpeedClient(config=config_for(cluster)) as client:
        # An operator's registration: held with no job, so the manager cannot free it on the way
        # down (a job's dataset closed just before the stop could be, and then nothing is rebuilt).
        client.manager.create_dataset(spec.to_proto(), operator=True)
        before = holders_of(client)
        assert before, "the dataset has no holder to rebuild it from"
    assert cluster.manager.stop() == 0
    state = os.path.join(cluster.state_dir, "manager", "manager.sqlite3")
    with open(state, "r+b") as fh:
        fh.write(b"\0" * 4096)  # the header and the first page destroyed
    cluster.manager.start()
    assert cluster.manager.process.wait(timeout=30) == 2
    with open(cluster.manager.log_file, encoding="utf-8") as fh:
        log = fh.read()
    assert "is damaged" in log and "--rebuild-state" in log
    cluster.manager.argv += ["--rebuild-state", "true"]
    cluster.start_manager()
    with KSpeedClient(config=config_for(cluster)) as client:
        wait_for(lambda: holders_of(client) == before or None, 20, "the dataset rebuilt from the servers")
    assert [p for p in os.listdir(os.path.dirname(state)) if ".damaged-" in p]


@pytest.mark.timeout(60)
def test_purge_discards_a_stopped_servers_pool_and_refuses_a_running_one(cluster_factory, tmp_path):
    cluster, _, spec = lifecycle_cluster(cluster_factory, tmp_path, grace="1s")
    with KSpeedClient(config=config_for(cluster)) as client:
        client.dataset(spec, batch_size=BATCH, seed=SEED, ring_bytes=1 << 20, quiet=True).close()
    server = cluster.servers[0]
    state_dir = server.argv[server.argv.index("--state-dir") + 1]
    pool = cluster.pool_dir(server)
    purge = [sys.executable, "-m", "kspeed.cli", "server", "purge", "--state-dir", state_dir, "--pool-dir", pool]
    running = subprocess.run(purge, capture_output=True, text=True, timeout=60)
    assert running.returncode == 1 and "in use by a running server" in running.stderr, running.stderr
    assert os.listdir(pool)
    assert server.stop() == 0
    assert os.listdir(pool)  # a clean stop keeps the pool for a restart
    done = subprocess.run(purge, capture_output=True, text=True, timeout=60, check=True)
    assert f"purged server {server.ready['id']}: pool {pool}" in done.stdout, done.stdout
    assert not os.path.exists(pool) and not os.path.exists(os.path.join(state_dir, "assignments.json"))


def test_kspeed_up_keeps_the_logs_of_a_dead_server_without_its_pool(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KSPEED_")}
    env["TMPDIR"] = str(tmp_path)
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kspeed.cli",
            "up",
            "--servers",
            "1",
            "--port",
            "0",
            "--http-port",
            "0",
            "--memory",
            "8MiB",
            "--region-size",
            "1MiB",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines = []
    assert up.stdout is not None
    for line in up.stdout:
        lines.append(line)
        if line.startswith("ready:"):
            break
    state_dir = next(line.split()[1] for line in lines if line.startswith("state "))
    with open(os.path.join(state_dir, "run", "server-0.json"), encoding="utf-8") as fh:
        pid = json.load(fh)["pid"]
    os.kill(pid, signal.SIGKILL)
    out = []
    for line in up.stdout:
        out.append(line)
        if "fail_after" in line:
            break
    up.send_signal(signal.SIGINT)
    try:
        rest, _ = up.communicate(timeout=60)
        text = "".join(out) + rest
        assert "the manager marks the server failed once it has been silent for fail_after" in text, text
        assert "pools discarded" in text, text
        assert os.path.exists(os.path.join(state_dir, "logs", "server-0.log"))
        assert not os.path.exists(os.path.join(state_dir, "server-0", "pool"))
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)  # kept for the operator (in /dev/shm): the test's to remove


def watch(address: str, heard: list[int], ended: list[str]) -> None:
    """Watch a daemon's health until the stream ends; note each status, then how it ended."""
    channel = grpc.insecure_channel(address)
    try:
        for reply in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="")):
            heard.append(reply.status)
        ended.append("OK")
    except grpc.RpcError as exc:
        ended.append(f"{exc.code().name}: {exc.details()}")
    finally:
        channel.close()


@pytest.mark.timeout(60)
def test_a_stopping_daemon_tells_its_health_watchers_and_ends_their_streams(cluster_factory):
    # A server's gRPC grace period (drain_timeout, 10 s) waited for every call still open: one
    # health watcher held each stop for those 10 s, then was cut off with UNAVAILABLE.
    cluster = cluster_factory(1)
    for daemon, address in ((cluster.servers[0], cluster.servers[0].ready["grpc"]), (cluster.manager, cluster.address)):
        heard: list[int] = []
        ended: list[str] = []
        watcher = threading.Thread(target=watch, args=(address, heard, ended), daemon=True)
        watcher.start()
        wait_for(lambda heard=heard: heard == [health_pb2.HealthCheckResponse.SERVING] or None, 10, "the first status")
        assert daemon.stop() == 0
        watcher.join(10)
        assert heard[-1] == health_pb2.HealthCheckResponse.NOT_SERVING, (daemon.name, heard)
        assert ended == ["OK"], (daemon.name, ended)
