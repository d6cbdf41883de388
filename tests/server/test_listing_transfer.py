"""A listing sent between servers: the same listing arrives, and a stream that is not one is refused."""

from __future__ import annotations

import pytest

from kspeed.config import SecurityConfig
from kspeed.errors import DatasetError, ProtocolError
from kspeed.proto import kspeed_pb2
from kspeed.server.backend import transfer
from kspeed.server.backend.sources import open_source, source_of
from kspeed.server.hosting.datasets import DatasetHost
from kspeed.server.hosting.listings import Listings


def tree(root, count=300):
    for i in range(count):
        folder = root / f"class{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:05d}.bin").write_bytes(bytes([i % 251]) * (i % 17))
    return root


def test_a_listing_arrives_whole_in_chunks(tmp_path, backend, monkeypatch):
    monkeypatch.setattr(transfer, "CHUNK", 1000)  # many chunks, arrays split across them
    source = open_source(backend, "d", str(tree(tmp_path / "t")))
    chunks = list(transfer.listing_chunks(source))
    assert len(chunks) > 5 and all(len(c.data) <= 1000 for c in chunks)
    found, fingerprint = transfer.listing_from_chunks(chunks, dataset="d", max_bytes=1 << 20)
    got = source_of(backend, "d", source.uri, "file", found, fingerprint)
    assert got.fingerprint == source.fingerprint and got.classes == source.classes
    assert (got.sizes == source.sizes).all() and (got.labels == source.labels).all()
    assert (got.stamps == source.stamps).all()
    assert [got.key(i) for i in range(got.count)] == [source.key(i) for i in range(source.count)]
    assert [got.read(i) for i in (0, 7, 299)] == [source.read(i) for i in (0, 7, 299)]


def test_a_stream_that_is_not_a_listing_is_refused(tmp_path, backend):
    source = open_source(backend, "d", str(tree(tmp_path / "t", 50)))
    chunks = list(transfer.listing_chunks(source))
    header = chunks[0].header

    def refused(stream, match, max_bytes=1 << 20):
        with pytest.raises(ProtocolError, match=match):
            transfer.listing_from_chunks(stream, dataset="d", max_bytes=max_bytes)

    refused(chunks[1:], "must start with its header")
    refused([*chunks, kspeed_pb2.ListingChunk(data=b"x")], "more than its header announced")
    refused(chunks[:-1], "ended before")
    refused([*chunks[:1], chunks[0], *chunks[1:]], "one header")
    refused(chunks, "exceeds the 100 accepted", max_bytes=100)
    for change, match in (
        (lambda h: h.arrays.add(name="mystery", dtype="<i8", nbytes=0), "unknown or twice"),
        (lambda h: setattr(h.arrays[0], "dtype", "<f4"), "of dtype"),
        (lambda h: setattr(h.arrays[0], "nbytes", 8), "holds 8 bytes for 50 samples"),
    ):
        bad = kspeed_pb2.ListingHeader()
        bad.CopyFrom(header)
        change(bad)
        refused([kspeed_pb2.ListingChunk(header=bad), *chunks[1:]], match)


def test_key_offsets_outside_the_keys_are_refused(tmp_path, backend):
    source = open_source(backend, "d", str(tree(tmp_path / "t", 20)))
    source._keys.ends = source._keys.ends + 10**6  # as a broken lister would send them
    with pytest.raises(ProtocolError, match="key offsets lie outside"):
        transfer.listing_from_chunks(transfer.listing_chunks(source), dataset="d", max_bytes=1 << 20)


def test_a_holder_that_cannot_fetch_the_listing_lists_the_backend_itself(tmp_path, backend, pool, caplog):
    root = tree(tmp_path / "t", 30)
    listings = Listings(backend, SecurityConfig(auth="none"))
    host = DatasetHost(pool, backend, str(tmp_path), listings=listings)
    spec = kspeed_pb2.DatasetSpec(name="d", uri=str(root))
    described = host.describe(spec)
    kept = listings.get(described.listing_id)
    assert kept is not None and described.fingerprint.count == 30
    share = kspeed_pb2.Share(server_id="s", first_id=0, end_id=30, first_region=0, num_regions=1)
    request = kspeed_pb2.AssignShareRequest(
        spec=spec, fingerprint=described.fingerprint, region_size=pool.region_size, share=share
    )
    try:
        # the lister itself: its own listing, no second one
        request.listing.CopyFrom(kspeed_pb2.ListingSource(server_id="me", address="x", listing_id=described.listing_id))
        host.assign(request)
        assert host.get("d").source is kept
        assert not host.get("d").request.HasField("listing")  # not kept: of no use after a restart
        host.drop("d")
        # another lister, unreachable: listed here, and the fingerprint still checked
        gone = kspeed_pb2.ListingSource(server_id="gone", address="127.0.0.1:1", listing_id="elsewhere")
        request.listing.CopyFrom(gone)
        host.assign(request)
        assert host.get("d").source is not kept and host.get("d").source.fingerprint == kept.fingerprint
        assert "cannot fetch the listing from gone" in caplog.text and "listing the backend here" in caplog.text
    finally:
        host.close()
        host.drop("d")


def test_a_tree_registered_with_the_former_fingerprint_is_still_recognised(tmp_path, backend, pool):
    root = tree(tmp_path / "t", 12)
    source = open_source(backend, "d", str(root))
    legacy = kspeed_pb2.Fingerprint(
        count=source.fingerprint.count, total_bytes=source.fingerprint.total_bytes, digest=source.legacy_digest()
    )
    assert legacy.digest and legacy.digest != source.fingerprint.digest
    share = kspeed_pb2.Share(server_id="s", first_id=0, end_id=12, first_region=0, num_regions=1)
    spec = kspeed_pb2.DatasetSpec(name="d", uri=str(root))
    host = DatasetHost(pool, backend, str(tmp_path))
    request = kspeed_pb2.AssignShareRequest(spec=spec, fingerprint=legacy, region_size=pool.region_size, share=share)
    try:
        host.assign(request)  # as a server restarted after an upgrade re-adopts it
        assert host.get("d").source.count == 12
        host.drop("d")
        request.fingerprint.digest = "0" * 64  # any other digest is a changed backend
        with pytest.raises(DatasetError, match="the backend changed since registration"):
            host.assign(request)
    finally:
        host.close()
