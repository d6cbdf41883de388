"""Daemons that cannot start say why in one line; `kspeed up` starts and stops cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers import http_get, pid_alive

PY = sys.executable


def run_daemon(module: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", module, "--auth", "none", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def assert_one_line_error(out: subprocess.CompletedProcess, *needles: str) -> None:
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def busy_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


def test_manager_port_in_use(tmp_path, busy_port):
    out = run_daemon(
        "kspeed.manager",
        "--listen",
        f"127.0.0.1:{busy_port}",
        "--http-listen",
        "127.0.0.1:0",
        "--state-dir",
        str(tmp_path),
    )
    assert_one_line_error(out, "kspeed-manager: error:", f"127.0.0.1:{busy_port}")


def test_manager_http_port_in_use(tmp_path, busy_port):
    out = run_daemon(
        "kspeed.manager",
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        f"127.0.0.1:{busy_port}",
        "--state-dir",
        str(tmp_path),
    )
    assert_one_line_error(out, "HTTP", f"127.0.0.1:{busy_port}")


def test_server_port_in_use(tmp_path, busy_port):
    out = run_daemon(
        "kspeed.server",
        "--listen",
        f"127.0.0.1:{busy_port}",
        "--state-dir",
        str(tmp_path),
        "--memory",
        "8MiB",
        "--region-size",
        "1MiB",
    )
    assert_one_line_error(out, "kspeed-server: error:", f"127.0.0.1:{busy_port}")
    assert not [p for p in os.listdir("/dev/shm") if p.startswith("kspeed-pool-")]  # nothing carved


def test_unreadable_config_file(tmp_path):
    out = run_daemon("kspeed.manager", "--config", str(tmp_path / "missing.yaml"))
    assert_one_line_error(out, "missing.yaml", "cannot read")


def test_config_file_with_bad_value_names_field_and_value(tmp_path):
    config = tmp_path / "kspeed.yaml"
    config.write_text("server:\n  memory: 12XB\n")
    out = run_daemon("kspeed.server", "--config", str(config), "--state-dir", str(tmp_path))
    assert_one_line_error(out, "server.memory", "12XB", str(config))


def test_unwritable_state_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    out = run_daemon(
        "kspeed.manager",
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--state-dir",
        str(blocker / "state"),
    )
    assert_one_line_error(out, "manager.state_dir", str(blocker / "state"))


def test_token_required_unless_auth_none(tmp_path):
    out = subprocess.run(
        [PY, "-m", "kspeed.manager", "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=30,
        env={k: v for k, v in os.environ.items() if k != "KSPEED_TOKEN"},
    )
    assert_one_line_error(out, "security.auth", "token")


def test_status_with_manager_down_is_one_line(busy_port):
    out = subprocess.run(
        [PY, "-m", "kspeed.cli", "status", "--manager", "127.0.0.1:1"], capture_output=True, text=True, timeout=30
    )
    assert_one_line_error(out, "manager at 127.0.0.1:1", "unreachable")


def test_kspeed_up_prints_addresses_first_and_leaves_nothing(tmp_path):
    proc = subprocess.Popen(
        [
            PY,
            "-m",
            "kspeed.cli",
            "up",
            "--servers",
            "2",
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
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first, second = proc.stdout.readline(), proc.stdout.readline()
        assert first.startswith("manager grpc 127.0.0.1:")
        assert second.startswith("manager http http://127.0.0.1:")
        lines = []
        while not any(line.startswith("ready:") for line in lines):
            line = proc.stdout.readline()
            assert line, f"kspeed up ended early: {lines} {proc.stderr.read()}"
            lines.append(line)
        assert any(line.startswith("auth: off") for line in lines)
        state_dir = next(line.split()[1] for line in lines if line.startswith("state "))
        pids = []
        for name in ("manager", "server-0", "server-1"):
            with open(os.path.join(state_dir, "run", f"{name}.json"), encoding="utf-8") as fh:
                pids.append(json.load(fh)["pid"])
        http = second.split("http://")[1].strip()
        assert http_get(http, "/v1/status")[1].count('"state": "ready"') == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 5
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(pid_alive(p) for p in pids)
    assert not os.path.exists(state_dir)


def test_sigkilled_supervisor_takes_its_daemons_along(tmp_path):
    proc = subprocess.Popen(
        [
            PY,
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
            "--state-dir",
            str(tmp_path / "up"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while not proc.stdout.readline().startswith("ready:"):
            assert proc.poll() is None, proc.stderr.read()
        pids = [
            json.loads((tmp_path / "up" / "run" / f"{name}.json").read_text())["pid"]
            for name in ("manager", "server-0")
        ]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 20
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in pids)
