"""A dataset's listing sent from the server that listed it to the servers that hold its shares.

Registration lists the backend once, on one server (``DescribeDataset``); the servers assigned
shares fetch that listing (``FetchListing``) rather than list the backend again. The stream is a
:class:`~kspeed.proto.kspeed_pb2.ListingHeader` (kind, root, fingerprint, classes, shards and each
array's name, dtype and length), then the arrays' bytes in chunks of at most :data:`CHUNK` bytes:
never one message per sample, never one giant message. The receiver checks what it is sent
against the header (names, dtypes, lengths, the sample count) before it builds anything, and
refuses a listing larger than it was told to accept.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from kspeed.errors import ProtocolError
from kspeed.proto import kspeed_pb2
from kspeed.server.backend.listing import Keys, Listing
from kspeed.server.backend.sources import Fingerprint, Source

__all__ = ["CHUNK", "listing_chunks", "listing_from_chunks"]

CHUNK = 1 << 20  # bytes of array data per message

# The arrays a listing may carry: name -> the dtypes allowed for it.
_ARRAYS = {
    "sizes": ("<i8",),
    "blob": ("|u1",),
    "starts": ("<i8",),
    "ends": ("<i8",),
    "stamps": ("<f8",),
    "labels": ("<i4", "<i8"),
    "shard_of": ("<i4", "<i8"),
    "offsets": ("<i8",),
    "unwatchable": ("<i8",),
}
_PER_SAMPLE = ("sizes", "starts", "ends", "stamps", "labels", "shard_of", "offsets")


def _arrays(source: Source) -> list[tuple[str, np.ndarray]]:
    keys = source.keys
    found: list[tuple[str, np.ndarray | None]] = [
        ("sizes", source.sizes),
        ("blob", None if keys is None else np.frombuffer(keys.blob, dtype=np.uint8)),
        ("starts", None if keys is None else keys.starts),
        ("ends", None if keys is None else keys.ends),
        ("stamps", source.stamps),
        ("labels", source.labels),
        ("shard_of", source.shard_of),
        ("offsets", source.offsets),
        ("unwatchable", source.unwatchable),
    ]
    little = [(name, a.astype(a.dtype.newbyteorder("<"), copy=False)) for name, a in found if a is not None]
    return [(name, np.ascontiguousarray(a)) for name, a in little]


def listing_chunks(source: Source) -> Iterator[kspeed_pb2.ListingChunk]:
    """``source``'s listing as a stream: the header, then each array's bytes in chunks."""
    arrays = _arrays(source)
    fp = source.fingerprint
    header = kspeed_pb2.ListingHeader(
        kind=source.kind,
        root=source.root,
        fingerprint=kspeed_pb2.Fingerprint(count=fp.count, total_bytes=fp.total_bytes, digest=fp.digest),
        classes=list(source.classes),
        shards=list(source.shards),
        row_offset=source.row_offset,
        file_stamp=source.file_stamp,
        dtype=source.dtype,
        row_shape=list(source.row_shape),
        arrays=[kspeed_pb2.ListingArray(name=n, dtype=a.dtype.str, nbytes=a.nbytes) for n, a in arrays],
    )
    yield kspeed_pb2.ListingChunk(header=header)
    pending = b""
    for _, array in arrays:
        data = memoryview(array.data).cast("B")
        for at in range(0, len(data), CHUNK):
            part = data[at : at + CHUNK]
            if len(pending) + len(part) > CHUNK:
                yield kspeed_pb2.ListingChunk(data=pending)
                pending = b""
            pending += bytes(part)
    if pending:
        yield kspeed_pb2.ListingChunk(data=pending)


def listing_from_chunks(
    chunks: Iterable[kspeed_pb2.ListingChunk], *, dataset: str, max_bytes: int
) -> tuple[Listing, Fingerprint]:
    """The listing a :func:`listing_chunks` stream carries, and the fingerprint its lister computed.

    Raises:
        ProtocolError: the stream is not a listing: no header first, an unknown array or dtype,
            lengths that do not match the sample count, more bytes than the header announced or
            than ``max_bytes`` in all, or fewer than announced.
    """
    stream = iter(chunks)
    first = next(stream, None)
    if first is None or not first.HasField("header"):
        raise ProtocolError(f"dataset {dataset!r}: a listing stream must start with its header")
    header = first.header
    count = int(header.fingerprint.count)
    plan = _check_header(header, dataset, count, max_bytes)
    buffers = [bytearray(nbytes) for _, _, nbytes in plan]
    which, filled = 0, 0
    for chunk in stream:
        if chunk.HasField("header"):
            raise ProtocolError(f"dataset {dataset!r}: a listing stream has one header")
        data = memoryview(chunk.data)
        while len(data):
            while which < len(plan) and filled == plan[which][2]:
                which, filled = which + 1, 0
            if which == len(plan):
                raise ProtocolError(f"dataset {dataset!r}: the listing stream sent more than its header announced")
            take = min(len(data), plan[which][2] - filled)
            buffers[which][filled : filled + take] = data[:take]
            filled += take
            data = data[take:]
    while which < len(plan) and filled == plan[which][2]:
        which, filled = which + 1, 0
    if which != len(plan):
        raise ProtocolError(f"dataset {dataset!r}: the listing stream ended before its array {plan[which][0]!r}")
    arrays = {name: np.frombuffer(buf, dtype=dtype) for (name, dtype, _), buf in zip(plan, buffers, strict=True)}
    keys = None
    if "blob" in arrays:
        if not {"starts", "ends"} <= arrays.keys():
            raise ProtocolError(f"dataset {dataset!r}: a listing's keys need their starts and ends")
        blob = bytes(buffers[[p[0] for p in plan].index("blob")])
        starts, ends = arrays["starts"], arrays["ends"]
        if count and ((starts < 0).any() or (ends > len(blob)).any() or (starts > ends).any()):
            raise ProtocolError(f"dataset {dataset!r}: a listing's key offsets lie outside its keys")
        keys = Keys(blob, starts, ends)
    fp = Fingerprint(count, int(header.fingerprint.total_bytes), header.fingerprint.digest)
    listing = Listing(
        kind=header.kind,
        root=header.root,
        sizes=arrays["sizes"],
        tags=b"",
        keys=keys,
        row_offset=int(header.row_offset),
        labels=arrays.get("labels"),
        classes=tuple(header.classes),
        stamps=arrays.get("stamps"),
        file_stamp=float(header.file_stamp),
        shards=tuple(header.shards),
        shard_of=arrays.get("shard_of"),
        offsets=arrays.get("offsets"),
        dtype=header.dtype,
        row_shape=tuple(int(d) for d in header.row_shape),
        unwatchable=_ids(arrays.get("unwatchable"), count, dataset),
    )
    return listing, fp


def _ids(ids: np.ndarray | None, count: int, dataset: str) -> np.ndarray | None:
    """Sample IDs a listing names, checked to lie in ``0..count-1``."""
    if ids is not None and len(ids) and (ids.min() < 0 or ids.max() >= count):
        raise ProtocolError(f"dataset {dataset!r}: a listing names samples outside 0..{count - 1}")
    return ids


def _check_header(
    header: kspeed_pb2.ListingHeader, dataset: str, count: int, max_bytes: int
) -> list[tuple[str, str, int]]:
    """The arrays a header announces, checked: known names once each, allowed dtypes, per-sample
    lengths matching the count, key offsets within the blob's length, at most ``max_bytes`` in all."""
    plan: list[tuple[str, str, int]] = []
    total = 0
    for array in header.arrays:
        allowed = _ARRAYS.get(array.name)
        if allowed is None or any(p[0] == array.name for p in plan):
            raise ProtocolError(f"dataset {dataset!r}: a listing stream names array {array.name!r} (unknown or twice)")
        if array.dtype not in allowed:
            raise ProtocolError(f"dataset {dataset!r}: listing array {array.name!r} of dtype {array.dtype!r}")
        itemsize = np.dtype(array.dtype).itemsize
        if array.name in _PER_SAMPLE and array.nbytes != count * itemsize:
            raise ProtocolError(
                f"dataset {dataset!r}: listing array {array.name!r} holds {array.nbytes} bytes for {count} samples"
            )
        total += int(array.nbytes)
        plan.append((array.name, array.dtype, int(array.nbytes)))
    if total > max_bytes:
        raise ProtocolError(f"dataset {dataset!r}: a listing of {total} bytes exceeds the {max_bytes} accepted")
    if "sizes" not in {p[0] for p in plan}:
        raise ProtocolError(f"dataset {dataset!r}: a listing stream lacks the samples' sizes")
    return plan
