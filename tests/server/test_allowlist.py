"""Allow-list: protocols, prefixes, '..' and symlink escapes, error messages."""

from __future__ import annotations

import os

import pytest

from kspeed.errors import AccessDeniedError, ConfigError
from kspeed.server.backend.allowlist import AllowList


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


@pytest.mark.parametrize(
    ("rule", "meant"),
    [("http", "'http://'"), ("s3:", "'s3://'"), ("https:/", "'https://'"), ("data/imgs", "an absolute path such as")],
)
def test_a_rule_that_is_not_absolute_is_refused_naming_what_was_meant(rule, meant, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / rule.split(":")[0]).mkdir(parents=True)  # it would have admitted this tree
    with pytest.raises(ConfigError) as refused:
        AllowList([rule], name="--backend-allow")
    message = str(refused.value)
    assert f"--backend-allow entry {rule!r} is a relative path" in message and meant in message
    assert refused.value.field == "server.backend_allow"
    if meant.startswith("an absolute"):
        assert repr(str(tmp_path / rule)) in message
    with pytest.raises(ConfigError, match="is not an absolute local path"):
        AllowList(["file://data/imgs"])


def test_a_rule_with_credentials_is_refused_without_showing_them():
    with pytest.raises(ConfigError) as refused:
        AllowList(["https://alice:S3CRETPW@data.example/imgs"])
    assert "S3CRETPW" not in str(refused.value) and "backend_options" in str(refused.value)
    assert "S3CRETPW" not in str(refused.value.value)


@pytest.mark.parametrize(
    ("uri", "why"),
    [
        ("http://alice:S3CRETPW@data.example/imgs/x.npy", "carries credentials"),
        ("http://data.example/imgs/x.npy?X-Amz-Signature=S3CRETPW", "carries credentials"),
        ("simplecache::http://data.example/imgs/x.npy", "chained URL"),
        ("zip://x.npy::http://data.example/imgs/a.zip", "chained URL"),
        ("file://169.254.169.254/imgs/x.npy", "not an absolute local path"),
        ("imgs/x.npy", "not an absolute local path"),
        ("http://data.example/imgs/%2e%2e/admin", "contains '..'"),
        ("http://data.example/imgs/%252E%252E/admin", "contains '..'"),
        ("http://data.example/imgs/..%5Cadmin", "contains '..'"),
    ],
)
def test_uris_refused_whatever_the_rules(uri, why, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "imgs").mkdir()
    allow = AllowList(["http://", "zip://", "simplecache://", "file://", str(tmp_path)])
    with pytest.raises(AccessDeniedError, match=why) as refused:
        allow.check(uri, dataset="ds")
    assert "S3CRETPW" not in str(refused.value) and refused.value.dataset == "ds"


def test_a_request_is_admitted_by_where_it_goes_only():
    allow = AllowList(["http://127.0.0.1:8000/data"])
    assert allow.admits_request("http://127.0.0.1:8000/data/x.npy?X-Amz-Signature=abc")  # a presigned redirect
    assert not allow.admits_request("http://127.0.0.1:8000/other/x.npy")
    assert not allow.admits_request("http://127.0.0.1:8001/data/x.npy")
    assert not allow.admits_request("http://169.254.169.254/latest/meta-data/")
    assert not allow.admits_request("http://127.0.0.1:8000/data/%2e%2e/x")
