"""The messages of a feed on the data-plane small-message channel, shared by client and server.

After a server's feeder connects to a client's receive ring it says HELLO; from then on the client
sends GRANTS (the right to write one range of positions of one batch of one epoch at a ring
offset) and the server answers each grant with one write-with-immediate whose immediate is the
grant's tag. A server that cannot serve a grant says ERROR instead of staying silent. Nothing per
sample travels here: the positions of a grant map to samples and offsets through the epoch plan
and :func:`kspeed.layout.batch_layout`, which both sides hold.

A **probe** is a grant of epoch :data:`PROBE_EPOCH`: the server writes ``end`` bytes (at most
:data:`MAX_PROBE`) of filler at ``ring_offset`` and completes it like any grant, so the client can
measure the latency of a transfer of that size before the first epoch (kspeed.client.pacing).

A tag is 32 bits: the path's generation (8 bits) and a sequence number (24 bits). The client
bumps a server's generation when it cuts that server's path (fencing), so a completion that
arrives later from the old path carries a stale generation and is ignored.
"""

from __future__ import annotations

import json
import struct

import numpy as np

from kspeed.errors import ProtocolError

__all__ = [
    "DROP_PLAN",
    "ERROR",
    "GRANTS",
    "GRANT_DTYPE",
    "HELLO",
    "MAX_PROBE",
    "PROBE_EPOCH",
    "decode",
    "encode_drop_plan",
    "encode_error",
    "encode_grants",
    "encode_hello",
    "make_tag",
    "tag_generation",
]

HELLO, GRANTS, ERROR, DROP_PLAN = 1, 2, 3, 4

#: One grant. ``first``/``end`` are positions within the batch; ``ring_offset`` is where the batch
#: starts, relative to the ring key the feed was opened with.
GRANT_DTYPE = np.dtype(
    [("epoch", "<u4"), ("batch", "<u4"), ("ring_offset", "<u8"), ("first", "<u4"), ("end", "<u4"), ("tag", "<u4")]
)
_ERROR = struct.Struct("<III")
_DROP = struct.Struct("<I")
MAX_GENERATION = 255
PROBE_EPOCH = 0xFFFFFFFF
MAX_PROBE = 4 << 20
_SEQ_MASK = (1 << 24) - 1


def make_tag(generation: int, seq: int) -> int:
    """The immediate of a grant: generation in the top 8 bits, sequence number below."""
    return ((generation & MAX_GENERATION) << 24) | (seq & _SEQ_MASK)


def tag_generation(tag: int | np.ndarray) -> int | np.ndarray:
    """The generation a tag (or an array of tags) was issued under."""
    return tag >> 24


def encode_hello(feed_id: str, server_id: str, generation: int) -> bytes:
    """Writer -> receiver, first message after connecting."""
    return bytes([HELLO]) + json.dumps({"feed": feed_id, "server": server_id, "generation": generation}).encode()


def encode_grants(grants: np.ndarray) -> bytes:
    """Receiver -> writer: an array of :data:`GRANT_DTYPE`."""
    return bytes([GRANTS]) + np.ascontiguousarray(grants, dtype=GRANT_DTYPE).tobytes()


def encode_error(epoch: int, batch: int, tag: int, text: str) -> bytes:
    """Writer -> receiver: a grant that cannot be served, and why."""
    return bytes([ERROR]) + _ERROR.pack(epoch, batch, tag) + text.encode()[:4000]


def encode_drop_plan(epoch: int) -> bytes:
    """Receiver -> writer: the plan of ``epoch`` will not be granted again."""
    return bytes([DROP_PLAN]) + _DROP.pack(epoch)


def decode(message: bytes) -> tuple[int, object]:
    """``(kind, payload)``: HELLO -> dict, GRANTS -> structured array, ERROR -> (epoch, batch, tag, text),
    DROP_PLAN -> epoch.

    Raises:
        ProtocolError: an empty, unknown or truncated message.
    """
    if not message:
        raise ProtocolError("empty feed message")
    kind, body = message[0], memoryview(message)[1:]
    try:
        if kind == HELLO:
            return kind, json.loads(bytes(body))
        if kind == GRANTS:
            if len(body) % GRANT_DTYPE.itemsize:
                raise ProtocolError(f"grant message of {len(body)} bytes is not whole grants")
            return kind, np.frombuffer(body, dtype=GRANT_DTYPE)
        if kind == ERROR:
            epoch, batch, tag = _ERROR.unpack_from(body)
            return kind, (epoch, batch, tag, bytes(body[_ERROR.size :]).decode(errors="replace"))
        if kind == DROP_PLAN:
            return kind, _DROP.unpack_from(body)[0]
    except (ValueError, struct.error) as exc:
        raise ProtocolError(f"malformed feed message of kind {kind}: {exc}") from exc
    raise ProtocolError(f"unknown feed message kind {kind}")
