"""The manager's check of dataset definitions (no daemon)."""

from __future__ import annotations

import pytest

from kspeed.errors import ProtocolError
from kspeed.manager.datasets import _same_definition, validate_spec
from kspeed.proto import kspeed_pb2


def spec(**fields) -> kspeed_pb2.DatasetSpec:
    return kspeed_pb2.DatasetSpec(**{"name": "imgs", "uri": "/data", **fields})


def test_a_cache_is_checked_and_part_of_the_identity():
    pipeline = kspeed_pb2.Pipeline(stages=[kspeed_pb2.Stage(op="decode_image", params="{}")])
    validate_spec(spec(pipeline=pipeline, cache="preprocessed"))
    with pytest.raises(ProtocolError, match="cache 'raw' is not one of '', 'preprocessed'"):
        validate_spec(spec(pipeline=pipeline, cache="raw"))
    with pytest.raises(ProtocolError, match="cache 'preprocessed' needs a pipeline"):
        validate_spec(spec(cache="preprocessed"))
    assert not _same_definition(spec(pipeline=pipeline), spec(pipeline=pipeline, cache="preprocessed"))
    assert _same_definition(
        spec(pipeline=pipeline, cache="preprocessed"), spec(pipeline=pipeline, cache="preprocessed")
    )


def test_a_uri_with_credentials_is_refused_without_echoing_them():
    for uri in ("http://alice:S3CRETPW@data.example/imgs", "https://data.example/x.npy?X-Amz-Signature=S3CRETPW"):
        with pytest.raises(ProtocolError, match=r"carries credentials.*backend_options") as refused:
            validate_spec(spec(uri=uri))
        assert "S3CRETPW" not in str(refused.value) and "dataset 'imgs': uri" in str(refused.value)
    with pytest.raises(ProtocolError, match="control character"):
        validate_spec(spec(uri="/data\x1b[2J"))
