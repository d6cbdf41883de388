"""The simulated fabric's wire: where a NIC listens and the frames NICs exchange.

Every simulated port listens on an abstract Unix stream socket named after each of its RoCEv2
GIDs (:func:`socket_name`); a requester QP opens one connection to the NIC that owns the
destination GID of its address vector and sends its requests down it in PSN order, so the RC
ordering of one QP (IBA 9.5) is the stream's order, while different QPs travel on different
connections that the responder's NIC serves in a shuffled order.

A request frame is a :data:`REQUEST` header followed by ``length`` payload bytes. Like an IB
packet it carries the source GID and QPN, the destination QPN, the PSN (and how many PSNs the
message spans at the requester's path MTU), the opcode, the RETH (rkey, remote address, length)
and, for ``RDMA_WRITE_WITH_IMM``, the 4-byte ImmDt exactly as IBA 9.3.2 puts it on the wire:
big-endian (network order). One frame is one message, not one MTU-sized packet.

Responses are :data:`RESPONSE` frames: an ACK (IBA 9.7.5.1: coalesced; it acknowledges every PSN
before ``psn``), a NAK with its syndrome (IBA 9.7.5.2: RNR with its timer code, PSN sequence
error, remote access error, invalid request) or ``DROP``. ``DROP`` is not an IB packet: it is the
simulated fabric telling the requester that a request vanished (dropped by the responder, as IBA
says silent drops happen: unknown QP, QP not ready), so that the requester's retransmission timer
runs exactly when something was lost and never just because this machine is slow.

The generation (not an IB field either) counts the requester's rewinds (go-back-N retransmissions):
DROPs and NAKs echo the generation of the request they answer, so the requester can ignore those
about transmissions that a retransmission already superseded.
"""

from __future__ import annotations

import struct

__all__ = [
    "ACK",
    "DROP",
    "KIND_REQUEST",
    "NAK_INV_REQ",
    "NAK_PSN_SEQ",
    "NAK_REM_ACCESS",
    "NAK_RNR",
    "OP_WRITE",
    "OP_WRITE_IMM",
    "REQUEST",
    "RESPONSE",
    "gid_bytes",
    "socket_name",
]

#: kind, opcode, path MTU code, (pad), source QPN, destination QPN, PSN, PSN count, rkey,
#: remote address, length, ImmDt (4 raw big-endian bytes), source GID (16 raw bytes), generation.
REQUEST = struct.Struct("<BBBxIIIIIQQ4s16sI")
#: kind (ACK, NAK syndrome or DROP), RNR timer code, (pad), requester QPN, PSN, generation.
RESPONSE = struct.Struct("<BBxxIII")

KIND_REQUEST = 1

OP_WRITE = 1
OP_WRITE_IMM = 2

# Response kinds.
ACK = 1
NAK_RNR = 2
NAK_PSN_SEQ = 3
NAK_REM_ACCESS = 4
NAK_INV_REQ = 5
DROP = 6

_PREFIX = b"\0kspeed-verbs-double/"


def socket_name(gid: str) -> bytes:
    """The abstract socket address of the NIC that owns RoCEv2 GID ``gid`` (text form)."""
    return _PREFIX + gid.encode()


def gid_bytes(gid: str) -> bytes:
    """The 16 raw bytes of a GID in pyverbs' text form ``xxxx:xxxx:...``."""
    return bytes.fromhex(gid.replace(":", ""))
