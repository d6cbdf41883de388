"""``kspeed doctor`` against a running cluster: each mistake an operator makes is found and named
with what to change, and a sound configuration passes."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys

import pytest

from tests.integration.test_cluster import _self_signed


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def doctor(*args: str) -> tuple[int, dict[str, list[dict]]]:
    done = subprocess.run(
        [sys.executable, "-m", "kspeed.cli", "doctor", *args, "--json"], capture_output=True, text=True, timeout=120
    )
    findings: dict[str, list[dict]] = {}
    for finding in json.loads(done.stdout):
        findings.setdefault(finding["check"], []).append(finding)
    return done.returncode, findings


def server_args(cluster, tmp_path, **overrides: str) -> list[str]:
    port = free_port()
    values = {
        "manager": cluster.address,
        "auth": "none",
        "listen": f"127.0.0.1:{port}",
        "state-dir": str(tmp_path / "server"),
        "memory": "64MiB",
        "region-size": "1MiB",
        "backend-allow": str(tmp_path),
        **overrides,
    }
    return [arg for key, value in values.items() for arg in (f"--{key}", value)]


def test_a_sound_server_configuration_passes_and_each_mistake_is_named(cluster_factory, tmp_path):
    cluster = cluster_factory(1)
    status, found = doctor("server", *server_args(cluster, tmp_path))
    assert status == 0, found
    assert found["advertise"][0]["ok"] and "the manager reaches 127.0.0.1:" in found["advertise"][0]["detail"]

    # An advertised address nobody listens on, a pool larger than /dev/shm, an allow-list entry that is not there.
    status, found = doctor(
        "server",
        *server_args(
            cluster,
            tmp_path,
            advertise=f"127.0.0.1:{free_port()}",
            memory="100TiB",
            **{"backend-allow": f"{tmp_path},{tmp_path}/missing"},
        ),
    )
    assert status == 1
    advertise = found["advertise"][0]
    assert not advertise["ok"] and "the manager cannot reach 127.0.0.1:" in advertise["detail"], advertise
    assert "set server.advertise (KSPEED_SERVER_ADVERTISE, --advertise)" in advertise["fix"]
    memory = found["memory"][0]
    assert not memory["ok"] and "does not fit" in memory["detail"] and "lower memory" in memory["fix"]
    missing = [f for f in found["backend_allow"] if not f["ok"]]
    assert len(missing) == 1 and f"{tmp_path}/missing does not exist" in missing[0]["detail"]


def test_a_wrong_token_is_named_with_the_setting_that_holds_it(cluster_factory, tmp_path):
    token = tmp_path / "token"
    token.write_text("right-token\n")
    cluster = cluster_factory(1, token_file=str(token))
    wrong = tmp_path / "wrong"
    wrong.write_text("wrong-token\n")
    status, found = doctor("client", "--manager", cluster.address, "--auth", "token", "--token-file", str(wrong))
    assert status == 1
    assert found["token"][0]["fix"].startswith(f"put the manager's token in token_file {wrong}")
    status, found = doctor("client", "--manager", cluster.address, "--auth", "token", "--token-file", str(token))
    assert status == 0, found
    assert found["servers"][0]["ok"]


def test_tls_on_one_side_only_is_named_as_such(cluster_factory, tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (needed to make a test certificate)")
    cert, key = _self_signed(tmp_path)
    env = {"KSPEED_TLS_CERT": str(cert), "KSPEED_TLS_KEY": str(key), "KSPEED_TLS_CA": str(cert)}
    cluster = cluster_factory(1, env=env)
    status, found = doctor("client", "--manager", cluster.address, "--auth", "none")
    assert status == 1
    assert "speaks TLS and this configuration does not" in found["tls"][0]["detail"]
    assert "set tls_ca" in found["tls"][0]["fix"]
    status, found = doctor("client", "--manager", cluster.address, "--auth", "none", "--tls-ca", str(cert))
    assert status == 0, found
