"""The ``shm`` rail: writer and receiver on one host, writes are memcpy into a shared memfd ring.

Receiver side: :class:`~kspeed.rdma.shm.receiver.ShmReceiver`; writer side:
:class:`~kspeed.rdma.shm.writer.ShmWriter`.
"""

from __future__ import annotations

import os
import socket

from kspeed.rdma.base import Rail, RailCapabilities

from .receiver import ShmReceiver
from .writer import ShmWriter

__all__ = ["ShmRail", "ShmReceiver", "ShmWriter"]


class ShmRail(Rail):
    """Same-host rail over memfd rings."""

    name = "shm"
    receiver = ShmReceiver
    writer = ShmWriter
    capabilities = RailCapabilities(
        host_local=True, needs_pacing=False, revokes_writer=False, device_memory=False, preference=20
    )

    def unavailable_reason(self) -> str | None:
        if not hasattr(os, "memfd_create"):
            return "os.memfd_create is missing (Linux >= 3.17 with Python >= 3.8 needed)"
        if not hasattr(socket, "send_fds") or not hasattr(socket, "SO_PEERCRED"):
            return "Unix sockets with SCM_RIGHTS and SO_PEERCRED are missing on this platform"
        return None
