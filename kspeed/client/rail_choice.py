"""Which data-plane rail the receive ring uses, decided per server and logged with the reason.

``shm`` serves a server on this host (same hostname, or a loopback gRPC address); ``tcp`` serves
any other. A ring is one piece of memory registered with one rail, so when the servers of a
dataset are split between this host and others, every server is fed over ``tcp`` (which also
works on one host) and the log says so. A rail the operator forces must work for every server;
otherwise the error names the server and what this host offers.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from kspeed.errors import RailUnavailableError
from kspeed.rdma.rails import available_rails, get_rail

__all__ = ["RailChoice", "choose_rail", "is_local", "local_address_towards"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RailChoice:
    """The ring's rail and, per server, why it is used."""

    rail: str
    reasons: dict[str, str]


def _host_of(address: str) -> str:
    host = address.rpartition(":")[0] if ":" in address else address
    return host.strip("[]")


def is_local(address: str, hostname: str = "") -> tuple[bool, str]:
    """Whether a server runs on this host, and why we think so."""
    me = socket.gethostname()
    if hostname and hostname == me:
        return True, f"same hostname {me!r}"
    host = _host_of(address)
    if host == "localhost":
        return True, f"loopback address {address}"
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True, f"loopback address {address}"
    except ValueError:
        pass
    if host == me:
        return True, f"address names this host {me!r}"
    return False, f"host {hostname or host!r} is not this host {me!r}"


def choose_rail(servers: Mapping[str, tuple[str, str]], forced: str = "auto") -> RailChoice:
    """Choose the ring's rail for servers ``{id: (address, hostname)}``.

    Args:
        servers: each server's gRPC address and reported hostname ("" when unknown).
        forced: ``"auto"``, or a rail name the operator insists on.

    Raises:
        RailUnavailableError: a forced rail is unusable here or cannot reach a server (named, with
            the rails this host offers).
    """
    local = {sid: is_local(addr, host) for sid, (addr, host) in servers.items()}
    if forced != "auto":
        get_rail(forced)  # raises, listing what is available
        if forced == "shm":
            remote = [sid for sid, (yes, _) in local.items() if not yes]
            if remote:
                sid = remote[0]
                raise RailUnavailableError(
                    f"rail 'shm' was forced but server {sid} at {servers[sid][0]} is on another host "
                    f"({local[sid][1]}); shm only reaches servers on this host; available rails: "
                    f"{', '.join(available_rails())}"
                )
        return RailChoice(forced, {sid: f"forced by rail={forced!r} ({why})" for sid, (_, why) in local.items()})
    if all(yes for yes, _ in local.values()):
        if "shm" in available_rails():
            return RailChoice("shm", {sid: f"co-located: {why}" for sid, (_, why) in local.items()})
        return RailChoice(
            "tcp", {sid: f"co-located ({why}) but shm is unavailable on this host" for sid, (_, why) in local.items()}
        )
    remote = next(sid for sid, (yes, _) in local.items() if not yes)
    reasons = {}
    for sid, (yes, why) in local.items():
        reasons[sid] = (
            f"remote: {why}"
            if not yes
            else f"co-located ({why}), but server {remote} is remote and one ring has one rail"
        )
    return RailChoice("tcp", reasons)


def local_address_towards(address: str) -> str:
    """The local IP address the kernel would use to reach ``address`` (no packet is sent)."""
    host, _, port = address.rpartition(":")
    try:
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host.strip("[]"), int(port or 9)))
            return probe.getsockname()[0]
    except (OSError, ValueError):
        return socket.gethostbyname(socket.gethostname())
