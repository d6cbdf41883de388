"""Which data-plane rail the receive ring uses, decided from the rails' capabilities and logged with the reason.

A ring is one piece of memory registered with one rail, so one rail must reach every server of a
feed. A rail reaches a server when the server offers it (its inventory lists the rails it runs)
and, for a host-local rail, when the server runs on this host (same hostname, or a loopback gRPC
address). Among the rails usable here that reach every server, the most preferred wins
(:class:`~kspeed.rdma.base.RailCapabilities`): a host-local rail for co-located servers, a network
rail as soon as one server is elsewhere, and the log says why for each server. A rail the operator
forces must reach every server; otherwise the error names the server and what this host offers.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from kspeed.errors import RailUnavailableError
from kspeed.rdma.rails import available_rails, capabilities, get_rail

__all__ = ["AUTO", "RailChoice", "ServerPlace", "choose_rail", "is_local", "local_address_towards", "needs_pacing"]

log = logging.getLogger(__name__)

#: The rail setting that lets :func:`choose_rail` decide.
AUTO = "auto"


@dataclass(frozen=True)
class ServerPlace:
    """Where a server runs and what it offers, as the manager reports it.

    Attributes:
        address: its gRPC ``host:port``.
        hostname: the hostname it reported ("" when unknown).
        rails: the rails it offers (empty when unknown: assumed to offer every rail).
    """

    address: str
    hostname: str = ""
    rails: tuple[str, ...] = ()

    @property
    def local(self) -> tuple[bool, str]:
        """Whether it runs on this host, and why we think so."""
        return is_local(self.address, self.hostname)


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


def _unreachable(rail: str, server: ServerPlace) -> str | None:
    """Why ``rail`` cannot reach ``server`` (``None`` when it can)."""
    if server.rails and rail not in server.rails:
        return f"it offers only {', '.join(server.rails)}"
    local, why = server.local
    if capabilities(rail).host_local and not local:
        return f"{rail} only reaches servers on this host and {why}"
    return None


def choose_rail(servers: Mapping[str, ServerPlace], forced: str = AUTO) -> RailChoice:
    """Choose the ring's rail for ``servers`` (by server id).

    Args:
        servers: each server's place and offered rails.
        forced: :data:`AUTO`, or a rail name the operator insists on.

    Raises:
        RailUnavailableError: a forced rail is unusable here or cannot reach a server, or no usable
            rail reaches every server (named, with the rails this host offers).
    """
    offered = ", ".join(available_rails()) or "none"
    if forced != AUTO:
        get_rail(forced)  # raises, listing what is available
        for sid, server in servers.items():
            why = _unreachable(forced, server)
            if why is not None:
                raise RailUnavailableError(
                    f"rail {forced!r} was forced but cannot reach server {sid} at {server.address}: {why}; "
                    f"available rails: {offered}"
                )
        return RailChoice(forced, {sid: f"forced by rail={forced!r} ({s.local[1]})" for sid, s in servers.items()})
    skipped: dict[str, str] = {}
    for rail in available_rails():
        blocked = {sid: why for sid, s in servers.items() if (why := _unreachable(rail, s)) is not None}
        if not blocked:
            return RailChoice(rail, {sid: _reason(rail, s, skipped) for sid, s in servers.items()})
        sid, why = next(iter(blocked.items()))
        skipped[rail] = f"server {sid} cannot use {rail} ({why}) and one ring has one rail"
    raise RailUnavailableError(
        "no rail usable on this host reaches every server: "
        + "; ".join(f"{rail}: {why}" for rail, why in skipped.items())
        + f"; available rails: {offered}"
    )


def _reason(rail: str, server: ServerPlace, skipped: Mapping[str, str]) -> str:
    local, why = server.local
    where = "co-located" if local else "remote"
    text = f"{where}: {why}"
    better = [f"{name} skipped: {reason}" for name, reason in skipped.items() if _unreachable(name, server) is None]
    return f"{text}; {'; '.join(better)}" if better else text


def needs_pacing(rail: str, servers: Mapping[str, ServerPlace]) -> bool:
    """Whether grants on ``rail`` to ``servers`` cross a link that incast can overrun.

    Co-located servers share no link with anyone: a host-local rail needs no pacing, and neither
    does a network rail over loopback, where a window would only add round trips.
    """
    return capabilities(rail).needs_pacing and not all(s.local[0] for s in servers.values())


def local_address_towards(address: str) -> str:
    """The local IP address the kernel would use to reach ``address`` (no packet is sent)."""
    host, _, port = address.rpartition(":")
    try:
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host.strip("[]"), int(port or 9)))
            return str(probe.getsockname()[0])
    except (OSError, ValueError):
        return socket.gethostbyname(socket.gethostname())
