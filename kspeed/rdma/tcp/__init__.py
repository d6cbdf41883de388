"""The ``tcp`` rail: writers on other hosts, no RDMA.

Writer side: :class:`~kspeed.rdma.tcp.writer.TcpWriter`. Receiver side:
:class:`~kspeed.rdma.tcp.receiver.TcpReceiver` in the consuming process and the receiver process
(:mod:`kspeed.rdma.tcp.receiver_process`) that does its TCP I/O off the training process's GIL.
"""

from __future__ import annotations

import os
import socket

from kspeed.rdma.base import Rail, RailCapabilities

from .receiver import TcpReceiver
from .writer import TcpWriter

__all__ = ["TcpRail", "TcpReceiver", "TcpWriter"]


class TcpRail(Rail):
    """Cross-host rail over TCP with a receiver process."""

    name = "tcp"
    receiver = TcpReceiver
    writer = TcpWriter
    capabilities = RailCapabilities(
        host_local=False, needs_pacing=True, revokes_writer=True, device_memory=False, preference=10
    )

    def unavailable_reason(self) -> str | None:
        if not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
            return "memfd rings and SCM_RIGHTS are needed for the receiver process (Linux only)"
        if not hasattr(socket, "TCP_USER_TIMEOUT"):
            return "TCP_USER_TIMEOUT is missing, so a cut link could not be detected in bounded time"
        return None
