"""Configuration: precedence, parsing and errors that name the field, the value and its source."""

from __future__ import annotations

import argparse
import os

import pytest

from kspeed.config import (
    ClientConfig,
    ManagerConfig,
    ServerConfig,
    add_arguments,
    load_config,
    parse_address,
    parse_bytes,
    parse_duration,
    usable_cores,
)
from kspeed.errors import ConfigError

NO_AUTH = {"KSPEED_AUTH": "none"}


def flags(cls, *argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("raw", "value"), [("128MiB", 128 * 2**20), ("1G", 10**9), (4096, 4096), ("2 GiB", 2 * 2**30), ("1.5KiB", 1536)]
)
def test_parse_bytes(raw, value):
    assert parse_bytes(raw) == value


@pytest.mark.parametrize(("raw", "value"), [("500ms", 0.5), ("10s", 10.0), ("2m", 120.0), (3, 3.0)])
def test_parse_duration(raw, value):
    assert parse_duration(raw) == value


@pytest.mark.parametrize("raw", ["12XB", "-1", "lots", True])
def test_parse_bytes_rejects(raw):
    with pytest.raises(ValueError):
        parse_bytes(raw)


@pytest.mark.parametrize("raw", ["localhost", ":80", "host:99999", "host:port"])
def test_parse_address_rejects(raw):
    with pytest.raises(ValueError):
        parse_address(raw)


def test_precedence_defaults_file_env_flags(tmp_path):
    config_file = tmp_path / "k.yaml"
    config_file.write_text("server:\n  memory: 2GiB\n  region_size: 64MiB\n  cores: 3\nsecurity:\n  auth: none\n")
    env = {"KSPEED_CONFIG": str(config_file), "KSPEED_REGION_SIZE": "32MiB", "KSPEED_SERVER_CORES": "5"}
    config = load_config(ServerConfig, flags(ServerConfig, "--cores", "7"), environ=env)
    assert config.memory == 2 * 2**30  # from the file
    assert config.region_size == 32 * 2**20  # env beats the file
    assert config.cores == 7  # the flag beats env
    assert config.listen == "0.0.0.0:7071"  # default
    assert config.security.auth == "none"


def test_bad_env_value_names_field_value_and_source():
    with pytest.raises(ConfigError) as info:
        load_config(ServerConfig, environ={**NO_AUTH, "KSPEED_SERVER_MEMORY": "12XB"})
    assert "server.memory" in str(info.value) and "12XB" in str(info.value)
    assert "KSPEED_SERVER_MEMORY" in str(info.value)
    assert info.value.field == "server.memory"


def test_bad_flag_names_flag():
    with pytest.raises(ConfigError, match="--fail-after"):
        load_config(ManagerConfig, flags(ManagerConfig, "--fail-after", "soon"), environ=NO_AUTH)


def test_cross_field_rules():
    with pytest.raises(ConfigError, match="suspect_after"):
        load_config(ManagerConfig, environ={**NO_AUTH, "KSPEED_SUSPECT_AFTER": "20s"})
    with pytest.raises(ConfigError, match="region_size"):
        load_config(ServerConfig, environ={**NO_AUTH, "KSPEED_REGION_SIZE": "1000"})
    with pytest.raises(ConfigError, match="less than one region"):
        load_config(ServerConfig, environ={**NO_AUTH, "KSPEED_SERVER_MEMORY": "1MiB"})
    with pytest.raises(ConfigError, match="server_id"):
        load_config(ServerConfig, environ={**NO_AUTH, "KSPEED_SERVER_ID": "../x"})


@pytest.mark.parametrize(
    ("config", "variables", "field"),
    [
        (
            ManagerConfig,
            {"KSPEED_HTTP_CONNECTIONS": "8", "KSPEED_HTTP_CONNECTIONS_PER_PEER": "9"},
            "manager.http_connections_per_peer",
        ),
        (ServerConfig, {"KSPEED_HTTP_CONNECTIONS": "0"}, "server.http_connections"),
        (ServerConfig, {"KSPEED_MAX_CONNECTIONS": "4"}, "server.max_connections"),
        (ManagerConfig, {"KSPEED_HEALTH_WATCHES": "0"}, "manager.health_watches"),
        (ManagerConfig, {"KSPEED_MANAGER_MAX_STREAMS": "1"}, "manager.max_streams"),
        (ServerConfig, {"KSPEED_MAX_PLAN_BYTES": "64KiB"}, "server.max_plan_bytes"),
    ],
)
def test_listener_caps_out_of_range_name_the_field(config, variables, field):
    with pytest.raises(ConfigError) as err:
        load_config(config, environ={**NO_AUTH, **variables})
    assert err.value.field == field and field in str(err.value)


def test_token_is_required_unless_auth_none(tmp_path):
    with pytest.raises(ConfigError, match="no token"):
        load_config(ManagerConfig, environ={})
    token = tmp_path / "token"
    token.write_text("abc\n")
    config = load_config(ManagerConfig, environ={"KSPEED_TOKEN_FILE": str(token)})
    assert config.security.token == "abc"
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(ManagerConfig, environ={"KSPEED_TOKEN_FILE": str(tmp_path / "nope")})
    token.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        load_config(ManagerConfig, environ={"KSPEED_TOKEN_FILE": str(token)})


def test_tls_cert_and_key_together(tmp_path):
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(ConfigError, match="together"):
        load_config(ManagerConfig, environ={**NO_AUTH, "KSPEED_TLS_CERT": str(cert)})


def test_yaml_unknown_field_and_section(tmp_path):
    path = tmp_path / "k.yaml"
    path.write_text("manager:\n  listn: 1.2.3.4:5\n")
    with pytest.raises(ConfigError, match="listn"):
        load_config(ManagerConfig, environ={**NO_AUTH, "KSPEED_CONFIG": str(path)})
    path.write_text("mangaer:\n  listen: 1.2.3.4:5\n")
    with pytest.raises(ConfigError, match="mangaer"):
        load_config(ManagerConfig, environ={**NO_AUTH, "KSPEED_CONFIG": str(path)})
    path.write_text("manager: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(ManagerConfig, environ={**NO_AUTH, "KSPEED_CONFIG": str(path)})


def test_transports_list():
    config = load_config(ServerConfig, environ={**NO_AUTH, "KSPEED_SERVER_TRANSPORTS": "tcp, shm"})
    assert config.transports == ("tcp", "shm")


def test_pacing_options():
    config = load_config(
        ClientConfig, environ={"KSPEED_PACING": "on", "KSPEED_CREDIT": "equal", "KSPEED_PACE_ROUND": "5ms"}
    )
    assert (config.pacing, config.credit, config.pace_round) == ("on", "equal", 0.005)
    assert config.loaders_on_node({"LOCAL_WORLD_SIZE": "8"}) == 8  # torchrun's ranks on this node
    assert config.loaders_on_node({}) == 1
    forced = load_config(ClientConfig, environ={"KSPEED_NODE_LOADERS": "3"})
    assert forced.loaders_on_node({"LOCAL_WORLD_SIZE": "8"}) == 3
    with pytest.raises(ConfigError, match=r"client\.pacing.*sometimes.*KSPEED_PACING"):
        load_config(ClientConfig, environ={"KSPEED_PACING": "sometimes"})
    with pytest.raises(ConfigError, match="pace_round"):
        load_config(ClientConfig, environ={"KSPEED_PACE_ROUND": "0s"})


def test_a_cross_field_error_names_where_each_value_came_from(tmp_path):
    path = tmp_path / "kspeed.yaml"
    path.write_text("server:\n  production_window: 8GiB\nsecurity:\n  auth: none\n")
    with pytest.raises(ConfigError) as info:
        load_config(ServerConfig, environ={"KSPEED_CONFIG": str(path), "KSPEED_SERVER_MEMORY": "4GiB"})
    message = str(info.value)
    assert f"server.production_window from config file {path}" in message
    assert "server.memory from environment KSPEED_SERVER_MEMORY" in message
    assert info.value.field == "server.production_window" and info.value.source == f"config file {path}"
    with pytest.raises(ConfigError) as info:
        load_config(ServerConfig, flags(ServerConfig, "--production-window", "2GiB"), environ=NO_AUTH)
    assert "server.production_window from --production-window" in str(info.value)
    assert "server.memory is the default" in str(info.value)


def test_a_token_file_error_names_the_variable_that_set_it(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(ManagerConfig, environ={"KSPEED_TOKEN_FILE": str(tmp_path / "nope")})
    assert "security.token_file from environment KSPEED_TOKEN_FILE" in str(info.value)


def test_a_bad_backend_options_value_is_refused_without_showing_the_credentials_in_it(tmp_path):
    for raw in ('{"s3": "key=AKIA secret=S3CRETPW"}', '{"s3": {"secret": "S3CRETPW"}'):
        with pytest.raises(ConfigError, match=r"server\.backend_options: invalid value of .* characters") as bad:
            load_config(ServerConfig, environ={**NO_AUTH, "KSPEED_BACKEND_OPTIONS": raw})
        assert "S3CRETPW" not in str(bad.value) and bad.value.value is None
        assert bad.value.source == "environment KSPEED_BACKEND_OPTIONS"
    path = tmp_path / "kspeed.yaml"
    path.write_text("server:\n  backend_options:\n    s3: [S3CRETPW]\n")
    with pytest.raises(ConfigError, match="not shown: it holds credentials") as bad:
        load_config(ServerConfig, environ={**NO_AUTH, "KSPEED_CONFIG": str(path)})
    assert "S3CRETPW" not in str(bad.value)


def test_usable_cores_follow_the_affinity_not_the_machine(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5}, raising=False)  # taskset -c 3,5
    assert usable_cores() == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5, 6})  # read at each call
    assert usable_cores() == 3
    monkeypatch.delattr(os, "sched_getaffinity")  # a platform without affinity
    assert usable_cores() == 64
