"""Options of the data-plane rails, passed in by the caller (never read from the environment)."""

from __future__ import annotations

import ipaddress
import math
import socket
from dataclasses import dataclass

from kspeed.errors import AccessDeniedError, ConfigError

__all__ = ["RailOptions"]


@dataclass(frozen=True)
class RailOptions:
    """How a rail authenticates peers and how quickly it gives up on them.

    Attributes:
        token: shared secret of the cluster. When set, both ends of every data-plane connection prove
            they know it (HMAC-SHA256 challenge-response over both nonces). When ``None``, each
            receiver draws a fresh secret and publishes it inside its connection material, so only a
            peer that was handed the material over the authenticated control plane can connect.
        io_timeout: seconds without progress after which a peer is declared lost: a send that
            cannot proceed, a frame that stops arriving mid-way, a handshake that stalls. Also used
            as ``TCP_USER_TIMEOUT`` so a cut link fails a pending send in that time.
        connect_timeout: seconds allowed to establish and authenticate one connection.
        keepalive_idle: seconds of silence before TCP keepalive probes start (detects a cut link on
            an idle connection).
        keepalive_interval: seconds between keepalive probes.
        keepalive_count: unanswered probes before the connection is dropped.
        bind_host: address the ``tcp`` receiver listens on.
        advertise_host: address written into the connection material (default: ``bind_host``).
        receiver_name: ``tcp`` only. When set, consuming processes of this user on this host that
            use the same name share one receiver process; when ``None`` each receiver gets its own.
        allowed_uids: users besides our own whose processes may connect over Unix sockets.
        socket_buffer: bytes requested for ``SO_SNDBUF``/``SO_RCVBUF`` of bulk sockets; ``None``
            leaves the kernel's autotuning in charge (usually the faster choice).
        dial_allow: networks (CIDR, or single addresses) a network writer may dial; a receiver
            elsewhere is refused before any packet is sent. Empty: any (a server always sets it,
            per feed, to the address its client called from and its ``data_networks``).
    """

    token: bytes | None = None
    io_timeout: float = 10.0
    connect_timeout: float = 5.0
    keepalive_idle: float = 5.0
    keepalive_interval: float = 1.0
    keepalive_count: int = 3
    bind_host: str = "127.0.0.1"
    advertise_host: str | None = None
    receiver_name: str | None = None
    allowed_uids: tuple[int, ...] = ()
    socket_buffer: int | None = None
    dial_allow: tuple[str, ...] = ()
    nic: str | None = None
    verbs_api: str | None = None

    def __post_init__(self) -> None:
        if self.token is not None and (not isinstance(self.token, bytes) or len(self.token) < 16):
            raise ConfigError("rail token must be bytes of at least 16 bytes", field="rdma.token", value="<redacted>")
        for name in ("io_timeout", "connect_timeout", "keepalive_idle", "keepalive_interval"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive number of seconds", field=f"rdma.{name}", value=value)
        if not isinstance(self.keepalive_count, int) or self.keepalive_count < 1:
            raise ConfigError(
                "keepalive_count must be a positive integer", field="rdma.keepalive_count", value=self.keepalive_count
            )
        if self.socket_buffer is not None and (not isinstance(self.socket_buffer, int) or self.socket_buffer < 65536):
            raise ConfigError(
                "socket_buffer must be an integer >= 65536", field="rdma.socket_buffer", value=self.socket_buffer
            )
        if self.receiver_name is not None and (
            not self.receiver_name or not self.receiver_name.replace("-", "").replace("_", "").isalnum()
        ):
            raise ConfigError(
                "receiver_name may hold only letters, digits, '-' and '_'",
                field="rdma.receiver_name",
                value=self.receiver_name,
            )

        for network in self.dial_allow:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError as exc:
                raise ConfigError(
                    f"server.data_networks: {network!r} is no network: {exc}",
                    field="server.data_networks",
                    value=network,
                ) from exc

    def check_dial(self, host: str, port: int) -> None:
        """Refuse to dial ``host`` unless every address it resolves to lies in :attr:`dial_allow`.

        Raises:
            AccessDeniedError: it does not (or it does not resolve); the message names it and the rule.
        """
        if not self.dial_allow:
            return
        try:
            found = {str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
        except OSError as exc:
            raise AccessDeniedError(f"receiver {host}:{port} does not resolve ({exc}); not dialled") from exc
        networks = [ipaddress.ip_network(n, strict=False) for n in self.dial_allow]
        outside = sorted(a for a in found if not any(ipaddress.ip_address(a.split("%")[0]) in n for n in networks))
        if outside:
            raise AccessDeniedError(
                f"receiver {host}:{port} ({', '.join(outside)}) is neither where the client called from nor in "
                f"the server's data_networks ({', '.join(self.dial_allow)}); not dialled"
            )

    @property
    def public_host(self) -> str:
        """The address peers should dial."""
        return self.advertise_host or self.bind_host
