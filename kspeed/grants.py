"""The messages of a feed on the data-plane small-message channel, shared by client and server.

After a server's feeder connects to a client's receive ring it says HELLO; from then on the client
sends GRANTS (the right to write one range of positions of one batch of one epoch at a ring
offset) and the server answers each grant with one write-with-immediate whose immediate is the
grant's tag. A server that cannot serve a grant says ERROR instead of staying silent, and a server
that ends a feed for good (its dataset was removed) says CLOSING with the reason first. Grants that
waited at the server for their samples to be produced (read from the backend) are named in a HELD
message, with how long, before they are written: the client's pacing then counts only the rest of
a grant's latency as the path's (a backend wait is not network latency). A client that no longer
wants a plan says DROP_PLAN; one that re-split the rest of a plan into a new pass (committed from
a later batch) says TRUNCATE_PLAN with the first batch it no longer wants: the batches before it
that it granted are still served. Nothing per
sample travels here: the positions of a grant map to samples and offsets through the epoch plan
(the client lays it out with :func:`kspeed.layout.batch_layout`; each server holds its part).

A **probe** is a grant of epoch :data:`PROBE_EPOCH`: the server writes ``end`` bytes (at most
:data:`MAX_PROBE`) of filler at ``ring_offset`` and completes it like any grant, so the client can
measure the latency of a transfer of that size before the first epoch (kspeed.client.feeding.pacing).

A tag is 32 bits: the path's generation (8 bits) and a sequence number (24 bits). The client
bumps a server's generation when it cuts that server's path (fencing), so a completion that
arrives later from the old path carries a stale generation and is ignored.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kspeed.errors import ProtocolError

__all__ = [
    "GRANT_DTYPE",
    "MAX_GENERATION",
    "MAX_PROBE",
    "MAX_RING_OFFSET",
    "PROBE_EPOCH",
    "Closing",
    "DropPlan",
    "Grant",
    "GrantError",
    "Held",
    "Hello",
    "Message",
    "TruncatePlan",
    "decode",
    "encode_closing",
    "encode_drop_plan",
    "encode_error",
    "encode_grants",
    "encode_held",
    "encode_hello",
    "encode_truncate_plan",
    "make_tag",
    "tag_generation",
]

_HELLO, _GRANTS, _ERROR, _DROP_PLAN, _CLOSING, _HELD, _TRUNCATE_PLAN = 1, 2, 3, 4, 5, 6, 7

#: One grant on the wire. ``first``/``end`` are positions within the batch; ``ring_offset`` is where
#: the batch starts, relative to the ring key the feed was opened with.
GRANT_DTYPE = np.dtype(
    [("epoch", "<u4"), ("batch", "<u4"), ("ring_offset", "<u8"), ("first", "<u4"), ("end", "<u4"), ("tag", "<u4")]
)
_ERROR_HEAD = struct.Struct("<IIIq")
_DROP = struct.Struct("<I")
_TRUNCATE = struct.Struct("<II")
MAX_GENERATION = 255
#: The largest ring offset a grant may name: no ring is anywhere near it, and a batch's offsets
#: added to it stay within int64 (the server's arithmetic). A larger one is a malformed message.
MAX_RING_OFFSET = (1 << 62) - 1
PROBE_EPOCH = 0xFFFFFFFF
MAX_PROBE = 4 << 20
_SEQ_MASK = (1 << 24) - 1
_MAX_ERROR_TEXT = 4000


@dataclass(frozen=True)
class Grant:
    """The right to write positions ``[first, end)`` of ``batch`` of pass ``epoch`` at ``ring_offset``.

    ``tag`` is the immediate the completion carries (:func:`make_tag`).
    """

    epoch: int
    batch: int
    ring_offset: int
    first: int
    end: int
    tag: int

    def row(self) -> tuple[int, int, int, int, int, int]:
        """The grant as a :data:`GRANT_DTYPE` record."""
        return (self.epoch, self.batch, self.ring_offset, self.first, self.end, self.tag)


@dataclass(frozen=True)
class Hello:
    """Writer -> receiver, first message after connecting: which feed, server and generation it serves."""

    feed: str
    server: str
    generation: int


@dataclass(frozen=True)
class GrantError:
    """Writer -> receiver: the grant tagged ``tag`` (``batch`` of pass ``epoch``) cannot be served, and
    why; ``sample`` is the sample it failed on, where one did (-1: none)."""

    epoch: int
    batch: int
    tag: int
    text: str
    sample: int = -1


@dataclass(frozen=True)
class Held:
    """Writer -> receiver: grants (by tag) that waited ``seconds`` at the server for production."""

    tags: np.ndarray  # uint32
    seconds: np.ndarray  # float64


@dataclass(frozen=True)
class DropPlan:
    """Receiver -> writer: the plan of pass ``epoch`` will not be granted again."""

    epoch: int


@dataclass(frozen=True)
class TruncatePlan:
    """Receiver -> writer: the plan of pass ``epoch`` will not be granted from ``batch`` on (the
    client committed the rest as a new pass); the batches before it that were granted are still
    served."""

    epoch: int
    batch: int


@dataclass(frozen=True)
class Closing:
    """Writer -> receiver: the server ends this feed for good (e.g. the dataset was removed), and why."""

    reason: str


#: A decoded feed message; grants arrive as a :data:`GRANT_DTYPE` array.
Message = Hello | GrantError | DropPlan | TruncatePlan | Closing | Held | np.ndarray


def make_tag(generation: int, seq: int) -> int:
    """The immediate of a grant: generation in the top 8 bits, sequence number below."""
    return ((generation & MAX_GENERATION) << 24) | (seq & _SEQ_MASK)


def tag_generation(tag: int) -> int:
    """The generation a tag was issued under."""
    return tag >> 24


def encode_hello(hello: Hello) -> bytes:
    """Writer -> receiver, first message after connecting."""
    body = {"feed": hello.feed, "server": hello.server, "generation": hello.generation}
    return bytes([_HELLO]) + json.dumps(body).encode()


def encode_grants(grants: Sequence[Grant] | np.ndarray) -> bytes:
    """Receiver -> writer: grants, as records or as an array of :data:`GRANT_DTYPE`."""
    if not isinstance(grants, np.ndarray):
        grants = np.array([g.row() for g in grants], dtype=GRANT_DTYPE)
    return bytes([_GRANTS]) + np.ascontiguousarray(grants, dtype=GRANT_DTYPE).tobytes()


def encode_error(error: GrantError) -> bytes:
    """Writer -> receiver: a grant that cannot be served, and why."""
    head = _ERROR_HEAD.pack(error.epoch, error.batch, error.tag, error.sample)
    return bytes([_ERROR]) + head + error.text.encode()[:_MAX_ERROR_TEXT]


def encode_closing(closing: Closing) -> bytes:
    """Writer -> receiver: the feed ends, and why."""
    return bytes([_CLOSING]) + closing.reason.encode()[:_MAX_ERROR_TEXT]


def encode_held(tags: Sequence[int], seconds: Sequence[float]) -> bytes:
    """Writer -> receiver: grants that waited for production, and how long (to the microsecond,
    at most about 71 minutes)."""
    micros = np.minimum(np.round(np.asarray(seconds, dtype=np.float64) * 1e6), 0xFFFFFFFF).astype("<u4")
    return bytes([_HELD]) + np.asarray(tags, dtype="<u4").tobytes() + micros.tobytes()


def encode_drop_plan(epoch: int) -> bytes:
    """Receiver -> writer: the plan of ``epoch`` will not be granted again."""
    return bytes([_DROP_PLAN]) + _DROP.pack(epoch)


def encode_truncate_plan(epoch: int, batch: int) -> bytes:
    """Receiver -> writer: the plan of ``epoch`` will not be granted from ``batch`` on."""
    return bytes([_TRUNCATE_PLAN]) + _TRUNCATE.pack(epoch, batch)


def decode(message: bytes) -> Message:
    """The message as its record; grants as a read-only :data:`GRANT_DTYPE` array.

    Raises:
        ProtocolError: an empty, unknown or truncated message, or a grant naming a ring offset
            beyond :data:`MAX_RING_OFFSET`.
    """
    if not message:
        raise ProtocolError("empty feed message")
    kind, body = message[0], memoryview(message)[1:]
    try:
        if kind == _HELLO:
            fields = json.loads(bytes(body))
            return Hello(str(fields["feed"]), str(fields["server"]), int(fields["generation"]))
        if kind == _GRANTS:
            if len(body) % GRANT_DTYPE.itemsize:
                raise ProtocolError(f"grant message of {len(body)} bytes is not whole grants")
            rows = np.frombuffer(body, dtype=GRANT_DTYPE)
            far = np.flatnonzero(rows["ring_offset"] > MAX_RING_OFFSET)
            if len(far):
                grant = rows[far[0]]
                raise ProtocolError(
                    f"grant tagged {int(grant['tag'])} (epoch {int(grant['epoch'])}, batch {int(grant['batch'])}) "
                    f"names ring offset {int(grant['ring_offset'])}, beyond {MAX_RING_OFFSET}: no ring is that large"
                )
            return rows
        if kind == _ERROR:
            epoch, batch, tag, sample = _ERROR_HEAD.unpack_from(body)
            text = bytes(body[_ERROR_HEAD.size :]).decode(errors="replace")
            return GrantError(epoch, batch, tag, text, sample)
        if kind == _DROP_PLAN:
            return DropPlan(_DROP.unpack_from(body)[0])
        if kind == _TRUNCATE_PLAN:
            return TruncatePlan(*_TRUNCATE.unpack_from(body))
        if kind == _CLOSING:
            return Closing(bytes(body).decode(errors="replace"))
        if kind == _HELD:
            if len(body) % 8:
                raise ProtocolError(f"held message of {len(body)} bytes is not whole (tag, microseconds) pairs")
            n = len(body) // 8
            tags = np.frombuffer(body, dtype="<u4", count=n)
            micros = np.frombuffer(body, dtype="<u4", offset=4 * n)
            return Held(tags, micros.astype(np.float64) / 1e6)
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise ProtocolError(f"malformed feed message of kind {kind}: {exc}") from exc
    raise ProtocolError(f"unknown feed message kind {kind}")
