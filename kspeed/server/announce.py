"""The address a server announces to the manager and the clients, and why it chose that one.

The manager probes a server at the address it announced and moves it to READY only once a probe
succeeds; clients dial it there too. ``server.advertise`` is announced as given. A server that
listens on one address announces it. One that listens on a wildcard (``0.0.0.0``, ``::``) announces
the address this host reaches the manager from (the manager's probes most likely come back the
same way); when the manager runs on this host, the host's name if it resolves to a routable
address here, else loopback. What cannot be known from here (a NAT, a name the manager resolves
otherwise) is why the choice is logged at start with the setting that overrides it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket

from kspeed.config import setting

__all__ = ["ADVERTISE", "WILDCARDS", "Announced", "announce", "http_address"]

WILDCARDS = ("0.0.0.0", "::", "[::]", "")
#: The setting that overrides the choice, as an operator sets it.
ADVERTISE = setting("server.advertise")


@dataclasses.dataclass(frozen=True)
class Announced:
    """An announced ``host:port`` and how it was chosen.

    Attributes:
        address: what the manager and the clients are told to dial.
        how: where it comes from, for the start-up log.
        doubt: why the manager or the clients may fail to reach it ("" when nothing is known against it).
    """

    address: str
    how: str
    doubt: str = ""

    @property
    def host(self) -> str:
        """The host part of :attr:`address` (brackets of an IPv6 address kept)."""
        return self.address.rpartition(":")[0]


def _join(host: str, port: str) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _route_to(address: str) -> str | None:
    """The local address the kernel would use to reach ``address`` (no packet is sent), or None
    when the address does not resolve or no route leads there."""
    host, _, port = address.rpartition(":")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port or 9), type=socket.SOCK_DGRAM)
        family, kind, proto, _, sockaddr = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(sockaddr)
            return str(probe.getsockname()[0])
    except (OSError, ValueError, IndexError):
        return None


def _addresses_of(name: str) -> list[str]:
    try:
        return sorted({str(info[4][0]) for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)})
    except OSError:
        return []


def announce(bound: str, configured: str, manager: str, *, hostname: str | None = None) -> Announced:
    """What a server bound at ``bound`` announces (see the module's docstring).

    Args:
        bound: the bound gRPC ``host:port`` (the listen address with its port filled in).
        configured: ``server.advertise`` ("" when not set).
        manager: the manager's ``host:port``.
        hostname: this host's name (default: :func:`socket.gethostname`).
    """
    if configured:
        return Announced(configured, "server.advertise")
    host, _, port = bound.rpartition(":")
    route = _route_to(manager)
    if host not in WILDCARDS:
        doubt = ""
        if _loopback(host) and route is not None and not _loopback(route):
            doubt = f"it is a loopback address and the manager at {manager} is on another host"
        return Announced(bound, "the listen address", doubt)
    if route is not None and not _loopback(route):
        return Announced(_join(route, port), f"this host's address on its route to the manager at {manager}")
    name = hostname if hostname is not None else socket.gethostname()
    addresses = _addresses_of(name)
    if any(not _loopback(a) for a in addresses):
        return Announced(_join(name, port), f"this host's name ({', '.join(addresses)} here)")
    said = f"resolves only to {', '.join(addresses)}" if addresses else "does not resolve"
    if route is not None:
        return Announced(
            _join(route, port),
            f"loopback: the manager at {manager} runs on this host and the host name {name!r} {said}",
            "processes on other hosts (clients included) cannot reach a loopback address",
        )
    return Announced(
        _join(name, port),
        "this host's name",
        f"the host name {name!r} {said} here, and the manager at {manager} does not resolve or has no route",
    )


def http_address(bound: str, grpc: Announced) -> str:
    """The HTTP endpoint's announced address: the bound one, or for a wildcard listen address the
    announced gRPC host with the bound HTTP port."""
    host, _, port = bound.rpartition(":")
    return _join(grpc.host.strip("[]"), port) if host in WILDCARDS else bound
