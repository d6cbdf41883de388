"""Allow-list: protocols, prefixes, '..' and symlink escapes, error messages."""

from __future__ import annotations

import os

import pytest

from kspeed.errors import AccessDeniedError
from kspeed.server.allowlist import AllowList


def test_empty_allow_list_refuses_everything(tmp_path):
    with pytest.raises(AccessDeniedError, match="every URI is refused"):
        AllowList().check(str(tmp_path), dataset="ds")


def test_prefix_matches_whole_components(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs2").mkdir()
    allow = AllowList([f"file://{tmp_path}/imgs"])
    assert allow.check(f"{tmp_path}/imgs/a.jpg")[0] == "file"
    assert allow.admits(f"file://{tmp_path}/imgs")
    assert not allow.admits(f"{tmp_path}/imgs2/a.jpg")


def test_dotdot_cannot_escape(tmp_path):
    (tmp_path / "data").mkdir()
    allow = AllowList([str(tmp_path / "data")])
    with pytest.raises(AccessDeniedError) as err:
        allow.check(f"{tmp_path}/data/" + "../" * 40 + "etc/shadow", dataset="ds")
    msg = str(err.value)
    assert "'ds'" in msg and "resolves to file:///etc/shadow" in msg and str(tmp_path / "data") in msg
    assert err.value.dataset == "ds"


def test_symlink_cannot_escape(tmp_path):
    (tmp_path / "data").mkdir()
    os.symlink("/etc", tmp_path / "data" / "etc")
    allow = AllowList([str(tmp_path / "data")])
    assert not allow.admits(f"{tmp_path}/data/etc/hostname")


def test_rules_are_resolved_too(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    allow = AllowList([str(tmp_path / "link")])
    assert allow.admits(str(tmp_path / "real" / "x"))


def test_remote_protocol_and_prefix():
    allow = AllowList(["s3://bucket/prefix", "gs://"])
    assert allow.admits("s3://bucket/prefix/a/b.jpg")
    assert not allow.admits("s3://bucket/other/b.jpg")
    assert not allow.admits("s3://bucket/prefix/../other/b.jpg")
    assert not allow.admits("file:///bucket/prefix/a")
    assert allow.admits("gs://anything/at/all")
    assert not allow.admits("http://bucket/prefix/a")
