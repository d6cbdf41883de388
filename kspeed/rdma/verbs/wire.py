"""The ``verbs`` rail's setup socket: what travels beside the RDMA writes.

A writer dials the receiver process over TCP once per connection: a hello naming the consumer,
the mutual challenge-response (:mod:`kspeed.rdma.auth`), then framed exchanges
(:mod:`kspeed.rdma.framing`) for the rest of the connection's life:

* ``SETUP`` (writer -> receiver): the writer's queue pair material and NIC;
* ``WELCOME`` (receiver -> writer): the connection id, the receiver's queue pair material, the
  rkey and address of every ring registered for this writer, and its immediate credits;
* ``KEYS`` (receiver -> writer): a ring registered later (always before any grant naming it, on
  the same socket);
* ``CREDIT`` (receiver -> writer): receive work requests the receiver has posted again for this
  writer's immediates (a writer never has more immediates in flight than its credits, so a burst
  of thousands of immediates waits for credit instead of overrunning the receive queue);
* ``MSG`` both ways: small messages (grants, replies), never behind bulk bytes, which move by RDMA;
* ``BYE``: an orderly close.

The socket also tells each side of the other's death (keepalive and ``TCP_USER_TIMEOUT``): the
passive side of an RC connection learns nothing from the NIC when its writer dies.
"""

from __future__ import annotations

import struct

__all__ = ["CREDIT", "HELLO", "KEYS", "MAGIC", "SETUP"]

MAGIC = b"KSPEEDVRB2"  # 2: the dialer proves itself first (kspeed.rdma.auth)
#: magic, consumer id.
HELLO = struct.Struct("<10s2xI")

SETUP = 32  # json: {"qp": QpMaterial, "nic": name}
KEYS = 33  # json: {"handle": {"rkey": int, "addr": int, "length": int}, ...}
CREDIT = 34  # u32 little-endian: receive work requests posted again for this writer
