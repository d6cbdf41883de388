"""The manager's check of dataset definitions and lease holders (no daemon)."""

from __future__ import annotations

import asyncio

import pytest

from kspeed.errors import ProtocolError
from kspeed.manager.datasets import DatasetCatalog, _same_definition, validate_spec
from kspeed.manager.membership import Membership, Timers
from kspeed.manager.store import Store
from kspeed.proto import kspeed_pb2
from tests.manager.fakes import listing, ready


def spec(**fields) -> kspeed_pb2.DatasetSpec:
    return kspeed_pb2.DatasetSpec(**{"name": "imgs", "uri": "/data", **fields})


class Calls:
    """Server calls that succeed: a listing of two regions of ten 100-byte samples."""

    async def call(self, address, server_id, method, request, timeout=None):
        return listing() if method == "DescribeDataset" else kspeed_pb2.ShareStatus()


def catalog_of(tmp_path) -> tuple[DatasetCatalog, Store]:
    store = Store(str(tmp_path))
    membership = Membership(store, Timers(1.0, 3.0, 10.0))
    ready(membership, "a", "b")
    return DatasetCatalog(store, membership, Calls(), lease_ttl=60.0), store


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


@pytest.mark.parametrize(
    "holder",
    ["job\n2024-01-01 WARNING lease forged", "a\rb", "\x1b[31mred", "x\u202egnp.exe", "x\u2028y", "h" * 257],
)
def test_a_lease_holder_with_control_characters_is_refused(tmp_path, holder):
    catalog, store = catalog_of(tmp_path)
    try:
        request = kspeed_pb2.CreateDatasetRequest(spec=spec(), holder=holder)
        with pytest.raises(
            ProtocolError, match=r"lease holder .* must be at most 256 characters, none of them a control"
        ):
            asyncio.run(catalog.create(request))
        assert catalog.datasets() == [] and list(store.datasets()) == []
        reply = asyncio.run(
            catalog.create(kspeed_pb2.CreateDatasetRequest(spec=spec(), holder="pid 7 on node-1 rank 0"))
        )
        assert reply.lease.holder == "pid 7 on node-1 rank 0"
    finally:
        store.close()
