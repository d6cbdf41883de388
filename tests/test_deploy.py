"""deploy/: the example configuration loads, the units pass systemd's checks and stay hardened."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kspeed.config import ClientConfig, ManagerConfig, ServerConfig, load_config

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
EXPOSURE_LIMIT = 2.5  # systemd-analyze security: 0 is locked down, 10 is exposed; "OK" is below 3


def systemd_tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (systemd)")
    return found


def unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(path)
    return parser


def local_copies(tmp_path: Path) -> list[Path]:
    """The units with ExecStart pointed at this environment's entry points (verify checks they exist)."""
    bindir = Path(sys.executable).parent
    out = []
    for path in UNITS:
        text = path.read_text().replace("/opt/kspeed/bin/", f"{bindir}/")
        (tmp_path / path.name).write_text(text)
        out.append(tmp_path / path.name)
    return out


def test_example_config_loads_for_every_process(tmp_path):
    token = tmp_path / "token"
    token.write_text("example-token\n")
    env = {"KSPEED_CONFIG": str(DEPLOY / "config" / "kspeed.yaml"), "KSPEED_TOKEN_FILE": str(token)}
    manager = load_config(ManagerConfig, environ=env)
    server = load_config(ServerConfig, environ=env)
    client = load_config(ClientConfig, environ=env)
    assert server.backend_allow and server.memory >= 1 << 30 and server.manager == client.manager
    assert manager.security.token == server.security.token == client.security.token == "example-token"
    assert manager.log_format == "json"
    # The units' state directories are the configured ones, and the units read this file.
    for cfg, name in ((manager, "manager"), (server, "server")):
        service = unit(DEPLOY / "systemd" / f"kspeed-{name}.service")["Service"]
        assert cfg.state_dir == f"/var/lib/{service['StateDirectory']}"
        assert service["ExecStart"].endswith("--config /etc/kspeed/kspeed.yaml")


@pytest.mark.parametrize("memory", ["2GiB", "16GiB", "64GiB", "512GiB"])
def test_example_config_fits_any_memory(tmp_path, memory):
    # An operator edits memory for the node; nothing else in the file may then stop the server.
    token = tmp_path / "token"
    token.write_text("example-token\n")
    env = {
        "KSPEED_CONFIG": str(DEPLOY / "config" / "kspeed.yaml"),
        "KSPEED_TOKEN_FILE": str(token),
        "KSPEED_SERVER_MEMORY": memory,
    }
    server = load_config(ServerConfig, environ=env)
    assert server.region_size <= server.window_bytes() < server.memory


@pytest.mark.parametrize("path", UNITS, ids=[p.stem for p in UNITS])
def test_units_run_as_the_user_sysusers_creates(path, tmp_path):
    service = unit(path)["Service"]
    assert service["User"] == service["Group"] == "kspeed"
    (tmp_path / "etc").mkdir()
    done = subprocess.run(
        [
            systemd_tool("systemd-sysusers"),
            "--dry-run",
            f"--root={tmp_path}",
            str(DEPLOY / "sysusers.d" / "kspeed.conf"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "Creating user 'kspeed'" in done.stdout + done.stderr


def test_systemd_analyze_verify_accepts_the_units(tmp_path):
    tool = systemd_tool("systemd-analyze")
    done = subprocess.run(
        [tool, "verify", *map(str, local_copies(tmp_path))], capture_output=True, text=True, timeout=120
    )
    # verify exits 0 on warnings such as an unknown key; any complaint is a failure here.
    assert done.returncode == 0 and not done.stderr.strip() and not done.stdout.strip(), done.stderr + done.stdout


def test_verify_complaints_are_caught(tmp_path):
    # The check above can fail: a misspelt directive is reported on stderr.
    tool = systemd_tool("systemd-analyze")
    bad = tmp_path / "bad.service"
    bad.write_text("[Service]\nExecStart=/bin/true\nProtectSystm=strict\n")
    done = subprocess.run([tool, "verify", str(bad)], capture_output=True, text=True, timeout=60)
    assert "ProtectSystm" in done.stderr


@pytest.mark.parametrize("path", UNITS, ids=[p.stem for p in UNITS])
def test_units_are_hardened(path, tmp_path):
    tool = systemd_tool("systemd-analyze")
    copy = next(p for p in local_copies(tmp_path) if p.name == path.name)
    done = subprocess.run(
        [tool, "security", "--offline=true", "--no-pager", str(copy)], capture_output=True, text=True, timeout=120
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout)
    assert match, done.stdout + done.stderr
    assert float(match.group(1)) <= EXPOSURE_LIMIT, done.stdout


@pytest.mark.parametrize("name", ["manager", "server"])
def test_units_limit_descriptors_and_tasks_above_the_daemons_own_caps(name, tmp_path):
    # Without limits of its own, a daemon took a thread and a descriptor per idle HTTP connection
    # until the host's ran out; the units' limits must still leave room for the daemons' own caps.
    token = tmp_path / "token"
    token.write_text("example-token\n")
    env = {"KSPEED_CONFIG": str(DEPLOY / "config" / "kspeed.yaml"), "KSPEED_TOKEN_FILE": str(token)}
    cfg = load_config(ManagerConfig if name == "manager" else ServerConfig, environ=env)
    service = unit(DEPLOY / "systemd" / f"kspeed-{name}.service")["Service"]
    descriptors, tasks = int(service["LimitNOFILE"]), int(service["TasksMax"])
    assert descriptors > cfg.max_connections + cfg.http_connections
    threads = cfg.http_connections + (
        cfg.rpc_threads + cfg.preload_threads + cfg.production_threads if isinstance(cfg, ServerConfig) else 0
    )
    assert tasks > 2 * threads
