"""DatasetSpec checks the manager's rules before anything is sent."""

from __future__ import annotations

import dataclasses

import pytest

from kspeed.client.spec import DatasetSpec
from kspeed.errors import ConfigError


def test_valid_spec_mirrors_the_proto():
    spec = DatasetSpec(name="imgs", uri="/data/imgs", labels="dirname", quota_bytes=1 << 20)
    proto = spec.to_proto()
    assert (proto.name, proto.uri, proto.kind, proto.labels, proto.quota_bytes) == (
        "imgs",
        "/data/imgs",
        "auto",
        "dirname",
        1 << 20,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("name", "-bad"),
        ("name", ""),
        ("uri", ""),
        ("kind", "zip"),
        ("labels", "filename"),
        ("quota_bytes", -1),
        ("quota_bytes", True),
    ],
)
def test_bad_fields_are_named(field, value):
    args = {"name": "imgs", "uri": "/data", field: value}
    with pytest.raises(ConfigError, match=field) as exc:
        DatasetSpec(**args)
    assert exc.value.field == field


def test_a_relative_path_is_made_absolute_and_urls_are_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert DatasetSpec(name="a", uri="data/imgs").uri == str(tmp_path / "data" / "imgs")
    assert DatasetSpec(name="b", uri="s3://bucket/train").uri == "s3://bucket/train"
    assert DatasetSpec(name="c", uri="/data/imgs").uri == "/data/imgs"
