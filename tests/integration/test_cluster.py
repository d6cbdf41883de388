"""A real manager and real servers on loopback: membership, lifecycle, restart, status."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kspeed.cli.cluster import wait_for
from kspeed.control import rpc
from kspeed.errors import BusyError
from kspeed.proto import kspeed_pb2, kspeed_pb2_grpc
from tests.helpers import client_for, http_get

S = kspeed_pb2.ServerState


def states(client) -> dict[str, int]:
    return {r.id: r.state for r in client.servers(include_left=True)}


def all_ready(client, count: int) -> bool:
    """Exactly ``count`` servers registered, all ready (a server may register after its ready file)."""
    current = states(client)
    return len(current) == count and all(s == S.SERVER_STATE_READY for s in current.values())


def test_two_servers_ready_in_status_json_metrics_and_cli(cluster):
    with client_for(cluster) as client:
        assert wait_for(lambda: list(states(client).values()) == [S.SERVER_STATE_READY] * 2, 10, "2 ready")
        ids = sorted(s.ready["id"] for s in cluster.servers)
        assert sorted(states(client)) == ids

    code, body = http_get(cluster.http_address, "/v1/status")
    assert code == 200
    servers = json.loads(body)["servers"]
    assert sorted(s["id"] for s in servers) == ids
    assert {s["state"] for s in servers} == {"ready"}
    assert all(s["address"].startswith("127.0.0.1:") for s in servers)

    code, metrics = http_get(cluster.http_address, "/metrics")
    assert code == 200 and 'kspeed_manager_servers{state="ready"} 2.0' in metrics
    assert http_get(cluster.http_address, "/healthz")[0] == 200
    assert http_get(cluster.http_address, "/readyz")[0] == 200
    assert http_get(cluster.servers[0].ready["http"], "/readyz")[0] == 200
    assert "kspeed_server_registered 1.0" in http_get(cluster.servers[0].ready["http"], "/metrics")[1]

    out = subprocess.run(
        [sys.executable, "-m", "kspeed.cli", "status", "--manager", cluster.address, "--auth", "none"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "SERVER" in lines[1] and "LAST HEARTBEAT" in lines[1]
    assert all(any(i in line and "ready" in line for line in lines) for i in ids)


def test_status_shows_a_server_that_stopped_then_left_and_why(cluster_factory):
    cluster = cluster_factory(2, manager_args=["--restart-grace", "5s"])
    gone = cluster.servers[1]
    gone_id = gone.ready["id"]

    def status(*args: str) -> str:
        argv = [sys.executable, "-m", "kspeed.cli", "status", *args, "--manager", cluster.address, "--auth", "none"]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout

    gone.stop()  # SIGTERM: it deregisters, its pool kept for a restart
    out = status()
    assert any(gone_id in line and " stopped " in line for line in out.splitlines()), out
    assert f"{gone_id} is stopped: stopped cleanly (shutdown); its shares wait 5s for it to restart" in out, out
    with client_for(cluster) as client:
        wait_for(lambda: states(client)[gone_id] == S.SERVER_STATE_LEFT, 15, "left")
    out = status()
    assert any(gone_id in line and " left " in line for line in out.splitlines()), out
    assert f"{gone_id} is left: stopped and not back within restart_grace" in out, out
    out = status("--json")
    listed = {s["id"]: (s["state"], s["state_reason"]) for s in json.loads(out)["servers"]}
    assert listed[gone_id][0] == "left" and "not back within restart_grace" in listed[gone_id][1]
    assert listed[cluster.servers[0].ready["id"]][0] == "ready"


def test_sigkill_moves_server_to_failed_within_timeout(cluster):
    victim = cluster.servers[0]
    with client_for(cluster) as client:
        wait_for(lambda: all_ready(client, 2), 10, "both servers ready")
        victim.signal(signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: states(client)[victim.ready["id"]] == S.SERVER_STATE_FAILED, 8, "failed")
        # fail_after is 2s in the fixture; allow for the tick and a loaded machine.
        assert time.monotonic() - killed < 6
        assert states(client)[cluster.servers[1].ready["id"]] == S.SERVER_STATE_READY
    status = json.loads(http_get(cluster.http_address, "/v1/status")[1])
    assert {s["id"]: s["state"] for s in status["servers"]}[victim.ready["id"]] == "failed"
    metrics = http_get(cluster.http_address, "/metrics")[1]
    assert f'kspeed_manager_server_state{{server="{victim.ready["id"]}",state="failed"}} 1.0' in metrics


def test_manager_restart_keeps_membership_and_servers_rejoin(cluster):
    with client_for(cluster) as client:
        wait_for(lambda: all_ready(client, 2), 10, "both servers ready")
        before = {r.id: r.incarnation for r in client.servers()}
        cluster_id = client.status().cluster_id
    assert cluster.manager.stop() == 0
    cluster.start_manager()
    with client_for(cluster) as client:
        assert client.status().cluster_id == cluster_id
        assert set(states(client)) == set(before)  # restored from SQLite before any server spoke
        wait_for(lambda: all_ready(client, 2), 10, "rejoined")
        assert {r.id: r.incarnation for r in client.servers()} == before  # heartbeats, not re-registration


def test_a_manager_back_after_a_long_outage_finds_every_healthy_server_ready(cluster_factory):
    # Three servers, failed 3 s after their last heartbeat. The manager is away 10 s: gRPC's own
    # reconnect backoff would by then wait seconds between attempts, so servers would dial the
    # restarted manager too late and be declared failed although they never stopped.
    cluster = cluster_factory(3, manager_args=["--suspect-after", "1.5s", "--fail-after", "3s"])
    with client_for(cluster) as client:
        wait_for(lambda: all_ready(client, 3), 10, "three servers ready")
        before = {r.id: r.incarnation for r in client.servers()}
    assert cluster.manager.stop() == 0
    time.sleep(10)
    cluster.start_manager()
    seen: dict[str, set[int]] = {}
    with client_for(cluster) as client:
        deadline = time.monotonic() + 6  # twice the failure timeout
        while time.monotonic() < deadline:
            for server_id, state in states(client).items():
                seen.setdefault(server_id, set()).add(state)
            time.sleep(0.05)
        assert all_ready(client, 3)
        assert {r.id: r.incarnation for r in client.servers()} == before  # the same incarnations: never lost
    assert all(S.SERVER_STATE_FAILED not in states_seen for states_seen in seen.values()), seen


def test_idle_streams_cannot_starve_health_and_info_calls(cluster_factory):
    cluster = cluster_factory(1, server_args=["--rpc-threads", "16", "--stream-idle-timeout", "3s"])
    server = cluster.servers[0]
    channel = grpc.insecure_channel(server.ready["grpc"])
    stub = kspeed_pb2_grpc.ServerStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    never = threading.Event()

    def silent():  # a StreamPlan stream that never sends a chunk
        never.wait()
        yield from ()

    calls = [stub.StreamPlan.future(silent(), timeout=60) for _ in range(20)]
    try:
        # 16 threads: 8 for streams, 4 of them for one caller; the other 16 streams are refused at once.
        wait_for(lambda: sum(c.done() for c in calls) >= 16, 5, "the streams past the limits refused")
        refused = [c for c in calls if c.done()]
        assert [c.code() for c in refused] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 16
        assert isinstance(rpc.error_from_rpc(refused[0], "server"), BusyError)  # clients retry these
        for _ in range(10):  # health and info answer at once while the streams hold their threads
            started = time.monotonic()
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1
            stub.GetInfo(kspeed_pb2.GetInfoRequest(), timeout=2)
            assert time.monotonic() - started < 1.0
        # The idle streams are cancelled after 3 s without a message, giving their threads back.
        wait_for(lambda: all(c.done() for c in calls), 10, "the idle streams cancelled")
        assert [c.code() for c in calls].count(grpc.StatusCode.CANCELLED) == 4
    finally:
        never.set()
        channel.close()
    with client_for(cluster) as client:
        assert all_ready(client, 1)  # the manager's probes never found it unresponsive


def test_unknown_server_heartbeat_is_not_found_and_server_reregisters(cluster):
    with client_for(cluster) as client:
        wait_for(lambda: all_ready(client, 2), 10, "both servers ready")
        with pytest.raises(Exception) as info:
            client._stub.Heartbeat(kspeed_pb2.HeartbeatRequest(id="srv-unknown"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    # The manager loses its state: servers are told NOT_FOUND and register again by themselves.
    cluster.manager.stop()
    shutil.rmtree(f"{cluster.state_dir}/manager")
    cluster.start_manager()
    with client_for(cluster) as client:
        wait_for(
            lambda: len(states(client)) == 2 and all(s == S.SERVER_STATE_READY for s in states(client).values()),
            10,
            "servers to re-register",
        )


def test_sigterm_server_is_waited_for_its_restart_grace_then_leaves(cluster_factory):
    cluster = cluster_factory(2, manager_args=["--restart-grace", "5s"])
    leaving = cluster.servers[1]
    with client_for(cluster) as client:
        wait_for(lambda: all_ready(client, 2), 10, "both servers ready")
        assert leaving.stop() == 0
        record = next(r for r in client.servers() if r.id == leaving.ready["id"])
        assert record.state == S.SERVER_STATE_STOPPED, record
        assert "wait 5s for it to restart" in record.state_reason
        wait_for(lambda: states(client)[leaving.ready["id"]] == S.SERVER_STATE_LEFT, 15, "the grace to pass")
        gone = next(r for r in client.servers(include_left=True) if r.id == leaving.ready["id"])
        assert "not back within restart_grace" in gone.state_reason
        assert leaving.ready["id"] not in {r.id for r in client.servers()}


def test_sigterm_server_without_its_pool_leaves_at_once(cluster_factory):
    cluster = cluster_factory(2, server_args=["--keep-pool-on-exit", "false"])
    leaving = cluster.servers[1]
    with client_for(cluster) as client:
        wait_for(lambda: all_ready(client, 2), 10, "both servers ready")
        assert leaving.stop() == 0
        assert states(client)[leaving.ready["id"]] == S.SERVER_STATE_LEFT
        assert leaving.ready["id"] not in {r.id for r in client.servers()}


def test_membership_watch_streams_snapshot_then_changes(cluster):
    with client_for(cluster) as client:
        wait_for(lambda: all_ready(client, 2), 10, "both servers ready")
        stream = client._stub.WatchMembership(kspeed_pb2.WatchMembershipRequest(), timeout=20)
        first = next(stream)
        assert first.snapshot and len(first.servers) == 2
        cluster.servers[0].stop()
        for event in stream:
            if any(r.state == S.SERVER_STATE_STOPPED for r in event.servers):
                assert event.revision > first.revision
                break
        stream.cancel()


def test_auth_refuses_missing_or_wrong_token_and_changes_nothing(cluster_factory, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    cluster = cluster_factory(1, token_file=str(token_file))
    with client_for(cluster) as client:  # the right token: probes and heartbeats work
        wait_for(lambda: list(states(client).values()) == [S.SERVER_STATE_READY], 10, "ready with auth")
        revision = client.status().revision
    channel = grpc.insecure_channel(cluster.address)
    stub = kspeed_pb2_grpc.ManagerStub(channel)
    register = kspeed_pb2.RegisterServerRequest(id="intruder", address="127.0.0.1:1", http_address="127.0.0.1:2")
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "s3cret-token"),)):
        with pytest.raises(grpc.RpcError) as info:
            stub.RegisterServer(register, metadata=metadata, timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    server_stub = kspeed_pb2_grpc.ServerStub(grpc.insecure_channel(cluster.servers[0].ready["grpc"]))
    with pytest.raises(grpc.RpcError) as info:
        server_stub.GetInfo(kspeed_pb2.GetInfoRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with client_for(cluster) as client:
        assert "intruder" not in states(client)
        assert client.status().revision == revision


def test_health_answers_without_a_token_and_status_needs_one(cluster_factory, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    cluster = cluster_factory(1, token_file=str(token_file))
    serving = health_pb2.HealthCheckResponse.SERVING
    for address, service in (
        (cluster.address, "kspeed.v1.Manager"),
        (cluster.servers[0].ready["grpc"], "kspeed.v1.Server"),
    ):
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))  # no token, as a Kubernetes probe
        for name in ("", service):
            assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == serving
        with pytest.raises(grpc.RpcError) as info:
            health.Check(health_pb2.HealthCheckRequest(service="kspeed.v1.Nothing"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert http_get(cluster.http_address, "/v1/status")[0] == 401  # the cluster's layout needs the token
    code, body = http_get(cluster.http_address, "/v1/status", token="s3cret-token")
    assert code == 200 and json.loads(body)["servers"]
    assert http_get(cluster.http_address, "/v1/status", token="wrong")[0] == 401
    for path in ("/healthz", "/readyz", "/metrics"):  # open by default (http_open)
        assert http_get(cluster.http_address, path)[0] == 200
        assert http_get(cluster.servers[0].ready["http"], path)[0] == 200


def _raw(cluster, method: str, payload: bytes):
    channel = grpc.insecure_channel(cluster.address)
    return channel.unary_unary(f"/kspeed.v1.Manager/{method}")(payload, timeout=5)


def test_malformed_oversized_and_invalid_requests_are_invalid_argument(cluster):
    with client_for(cluster) as client:
        wait_for(lambda: all_ready(client, 2), 10, "both servers ready")
        revision = client.status().revision
        inventory = kspeed_pb2.ServerInventory(memory_bytes=2**20, region_size=2**20)
        bad = [
            b"\xff\xff\xff\xff",  # not a protobuf message
            kspeed_pb2.RegisterServerRequest(
                id="x",
                address="127.0.0.1:1",
                http_address="127.0.0.1:2",
                inventory=kspeed_pb2.ServerInventory(hostname="h" * 100_000),
            ).SerializeToString(),  # 100 kB > the 64 KiB limit
            kspeed_pb2.RegisterServerRequest(
                id="../etc", address="127.0.0.1:1", http_address="127.0.0.1:2", inventory=inventory
            ).SerializeToString(),
            kspeed_pb2.RegisterServerRequest(
                id="ok", address="no-port", http_address="127.0.0.1:2", inventory=inventory
            ).SerializeToString(),
        ]
        for payload in bad:
            with pytest.raises(grpc.RpcError) as info:
                _raw(cluster, "RegisterServer", payload)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert client.status().revision == revision
        assert len(states(client)) == 2


def test_incompatible_protocol_version_is_refused_naming_both(cluster):
    with client_for(cluster) as client:
        for method, request in (
            ("Hello", kspeed_pb2.HelloRequest(version=kspeed_pb2.PeerVersion(protocol_versions=[99]))),
            (
                "RegisterServer",
                kspeed_pb2.RegisterServerRequest(
                    id="future",
                    address="127.0.0.1:1",
                    http_address="127.0.0.1:2",
                    inventory=kspeed_pb2.ServerInventory(memory_bytes=2**20, region_size=2**20),
                    version=kspeed_pb2.PeerVersion(protocol_versions=[99]),
                ),
            ),
        ):
            with pytest.raises(grpc.RpcError) as info:
                getattr(client._stub, method)(request, timeout=5)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "[1]" in info.value.details() and "[99]" in info.value.details()
        # Nothing was registered (the revision may still move: a loaded machine can delay a heartbeat).
        assert "future" not in {s.id for s in client.servers(include_left=True)}


def _self_signed(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=kspeed",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def test_tls_on_both_daemons(cluster_factory, tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (needed to make a test certificate)")
    cert, key = _self_signed(tmp_path)
    env = {"KSPEED_TLS_CERT": str(cert), "KSPEED_TLS_KEY": str(key), "KSPEED_TLS_CA": str(cert)}
    cluster = cluster_factory(1, env=env)  # servers reach the manager, the manager probes them: all over TLS
    from kspeed.config import ClientConfig, load_config
    from kspeed.control.manager_client import ManagerClient

    config = load_config(
        ClientConfig,
        environ={},
        overrides={"manager": cluster.address, "security.auth": "none", "security.tls_ca": str(cert)},
    )
    with ManagerClient(config) as client:
        wait_for(lambda: [r.state for r in client.servers()] == [S.SERVER_STATE_READY], 10, "ready over TLS")
    plain = kspeed_pb2_grpc.ManagerStub(grpc.insecure_channel(cluster.address))
    with pytest.raises(grpc.RpcError) as info:
        plain.GetStatus(kspeed_pb2.GetStatusRequest(), timeout=3)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # HTTP is HTTPS with the same certificate: /v1/status's bearer token never crosses in clear text.
    for http in (cluster.http_address, cluster.servers[0].ready["http"]):
        assert http_get(http, "/healthz", ca=str(cert)) == (200, "ok\n")
        with pytest.raises(OSError):  # plain HTTP is not answered
            http_get(http, "/healthz")
    if shutil.which("curl") is not None:  # what a probe or an operator runs
        done = subprocess.run(
            ["curl", "-sS", "--cacert", str(cert), f"https://{cluster.http_address}/readyz"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert (done.returncode, done.stdout) == (0, "ready\n"), done.stderr


def test_many_watch_streams_do_not_hold_the_manager(cluster):
    import asyncio

    async def watch_all(n: int) -> list[int]:
        channel = grpc.aio.insecure_channel(cluster.address)
        stub = kspeed_pb2_grpc.ManagerStub(channel)
        streams = [stub.WatchMembership(kspeed_pb2.WatchMembershipRequest(), timeout=30) for _ in range(n)]
        firsts = await asyncio.gather(*(s.read() for s in streams))
        assert all(f.snapshot for f in firsts)
        # With n streams open, unary calls are still answered at once.
        started = time.monotonic()
        await stub.GetStatus(kspeed_pb2.GetStatusRequest(), timeout=5)
        assert time.monotonic() - started < 2
        await asyncio.get_running_loop().run_in_executor(None, cluster.servers[0].stop)
        seconds = await asyncio.gather(*(s.read() for s in streams))
        for s in streams:
            s.cancel()
        await channel.close()
        return [len(e.servers) for e in seconds]

    counts = asyncio.run(watch_all(200))  # more streams than the server daemon has threads
    assert len(counts) == 200 and all(c >= 1 for c in counts)


def test_json_log_format_writes_one_object_per_line(cluster_factory):
    cluster = cluster_factory(1, manager_args=["--log-format", "json"], server_args=["--log-format", "json"])
    cluster.stop()  # shutdown logs too, and the logs are complete
    for daemon, process in ((cluster.manager, "manager"), (cluster.servers[0], "server")):
        with open(daemon.log_file, encoding="utf-8") as fh:
            lines = [line for line in fh.read().splitlines() if line.strip()]
        assert lines, f"{daemon.name} logged nothing"
        records = [json.loads(line) for line in lines]  # every line is one JSON object
        assert {r["process"] for r in records} <= {process, "feeder"} and process in {r["process"] for r in records}
        assert all({"time", "level", "logger", "message", "pid"} <= set(r) for r in records)
