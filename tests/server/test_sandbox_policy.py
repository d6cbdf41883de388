"""What the server decides about its preprocessing workers' sandbox before any starts (no worker, no
daemon): their environment, what they may read, the settings an operator gives, and what the server
accepts of a worker's report."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from kspeed.config import ServerConfig, load_config, preprocess_environment
from kspeed.errors import ConfigError
from kspeed.server.prep.link import sweep_temporary
from kspeed.server.prep.sandbox import Confinement, SandboxPolicy, check_policy, import_paths
from kspeed.server.prep.sandbox.identity import resolve_user


def test_a_worker_gets_the_locale_and_what_the_operator_names_never_a_kspeed_variable():
    environ = {
        "PATH": "/usr/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C",
        "KSPEED_TOKEN": "secret",
        "KSPEED_TOKEN_FILE": "/etc/kspeed/token",
        "AWS_SECRET_ACCESS_KEY": "backend",
        "HOME": "/root",
        "TORCH_HOME": "/models",
    }
    assert preprocess_environment(("TORCH_HOME", "KSPEED_TOKEN"), environ) == {
        "PATH": "/usr/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C",
        "TORCH_HOME": "/models",
    }


def test_the_settings_refuse_a_kspeed_variable_and_relative_paths():
    def server(environ=None, **overrides):
        return load_config(ServerConfig, environ=environ or {}, overrides={"security.auth": "none", **overrides})

    with pytest.raises(ConfigError, match=r"server.preprocess_env: 'KSPEED_TOKEN' .* never passed"):
        server(preprocess_env="TORCH_HOME,KSPEED_TOKEN")
    with pytest.raises(ConfigError, match=r"server.preprocess_read_paths: 'models' is not an absolute path"):
        server(preprocess_read_paths="models")
    with pytest.raises(ConfigError, match="preprocess_sandbox"):
        server(preprocess_sandbox="sometimes")
    config = server({"KSPEED_PREPROCESS_NETWORK": "true"})
    assert config.preprocess_network and config.preprocess_sandbox == "required" and config.verify_served


def test_a_worker_imports_from_absolute_paths_that_open_nothing_protected(tmp_path):
    state = tmp_path / "state"
    path = ["", ".", "/", str(tmp_path), str(tmp_path / "lib"), str(tmp_path / "lib")]
    kept = import_paths(path, [str(state)])
    assert "" not in kept and "." not in kept and "/" not in kept
    assert str(tmp_path) not in kept  # it holds the state directory
    assert kept.count(str(tmp_path / "lib")) == 1 and sys.prefix in kept


def test_a_workers_report_is_kept_only_as_lists_of_bounded_strings():
    report = Confinement.from_dict({"mechanisms": ["seccomp"], "missing": [], "reachable": ["x" * 9000]})
    assert report.mechanisms == ["seccomp"] and len(report.reachable[0]) == 500
    for bad in ({"mechanisms": "seccomp"}, {"reachable": [1]}, ["mechanisms"], None):
        with pytest.raises(ValueError):
            Confinement.from_dict(bad)
    assert report.verdict("required").startswith("the preprocessing sandbox is incomplete: a worker could xxx")
    assert report.verdict("best-effort") == "" and Confinement().verdict("required") == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="the preprocessing user is resolved only when the server runs as root")
def test_a_preprocessing_user_that_is_root_or_unknown_is_a_configuration_error():
    with pytest.raises(ConfigError, match="is root"):
        check_policy(SandboxPolicy(user="root"))
    with pytest.raises(ConfigError, match="no user or group 'no-such-user-here'"):
        check_policy(SandboxPolicy(user="no-such-user-here"))
    assert resolve_user("65534:65534").uid == 65534
    check_policy(SandboxPolicy(user="nobody"))


def test_the_temporary_directories_of_workers_of_a_server_that_died_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a server killed with its workers: their directories stay behind
    (tmp_path / f"kspeed-prep-{gone.pid}-1-abc").mkdir()
    (tmp_path / f"kspeed-prep-{os.getpid()}-1-def").mkdir()  # a running server's
    (tmp_path / "kspeed-prep-notapid").mkdir()
    sweep_temporary()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"kspeed-prep-{os.getpid()}-1-def", "kspeed-prep-notapid"]
