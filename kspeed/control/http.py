"""A small HTTP endpoint for daemons: health, readiness, Prometheus metrics and JSON status.

It serves on a daemon thread, a thread per connection, so scrapes never wait on the daemon's own
event loop; route handlers read snapshots and must not block. Each connection is one request
(HTTP/1.0) and lives inside a :class:`~kspeed.admission.Gate`: ``http_timeout`` seconds in all
for the TLS handshake, the request and the answer, at most ``http_connections`` at once and
``http_connections_per_peer`` from one address, the oldest closed to make room at a cap. Idle or
slow clients (951 idle connections gave a manager 961 threads) cost a bounded number of threads
and descriptors (``http_connections`` plus the gate's :data:`~kspeed.admission.WIND_DOWN` shut
ones not yet gone), and never keep a probe out. With TLS configured for the daemon (``tls_cert``,
``tls_key``) it serves HTTPS with the same certificate, so the bearer token of ``/v1/status``
never crosses the network in clear text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Collection, Mapping
from http.server import BaseHTTPRequestHandler, HTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kspeed.admission import Gate, Ticket
from kspeed.config import DaemonConfig, SecurityConfig, setting
from kspeed.control.rpc import token_ok
from kspeed.errors import ConfigError

log = logging.getLogger(__name__)

#: How often the serving loop looks for a shutdown request: ``close()`` waits up to this long (the
#: standard library's default, 0.5 s, made every daemon's stop half a second longer).
SHUTDOWN_POLL_S = 0.05

# A route returns (status, content type, body).
Response = tuple[int, str, bytes]
Route = Callable[[], Response]


def json_response(payload: object, status: int = 200) -> Response:
    """A JSON response."""
    return status, "application/json", (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode()


def text_response(text: str, status: int = 200) -> Response:
    """A plain-text response."""
    return status, "text/plain; charset=utf-8", (text + "\n").encode()


def metrics_route(registry: CollectorRegistry) -> Route:
    """A route serving ``registry`` in the Prometheus text format."""
    return lambda: (200, CONTENT_TYPE_LATEST, generate_latest(registry))


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """How many connections an endpoint serves at once, from one address, and for how long.

    Attributes:
        connections: connections at once (a thread each).
        per_peer: connections at once from one address.
        timeout: seconds a connection may stay open (handshake, request and answer).
    """

    connections: int = 64
    per_peer: int = 16
    timeout: float = 10.0

    @classmethod
    def of(cls, config: DaemonConfig) -> HttpLimits:
        """A daemon's limits (``http_connections``, ``http_connections_per_peer``, ``http_timeout``)."""
        return cls(config.http_connections, config.http_connections_per_peer, config.http_timeout)


def server_tls(security: SecurityConfig) -> ssl.SSLContext | None:
    """The TLS context of a daemon's HTTP endpoint: its gRPC certificate and key, or None without them.

    Raises:
        ConfigError: the certificate or the key cannot be loaded.
    """
    if not security.tls_cert:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(security.tls_cert, security.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"{setting('security.tls_cert')} and {setting('security.tls_key')}: cannot load "
            f"{security.tls_cert!r} with {security.tls_key!r} for HTTPS: {exc}",
            field="security.tls_cert",
            value=security.tls_cert,
        ) from exc
    return context


class _GatedServer(HTTPServer):
    """An HTTP server with a thread per connection, each connection inside a gate (TLS optional)."""

    request_queue_size = 128  # (the accept loop takes them at once; the gate bounds the rest)

    def __init__(
        self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], gate: Gate, tls: ssl.SSLContext | None
    ) -> None:
        super().__init__(address, handler)
        self.gate = gate
        self.tls = tls

    def process_request(self, request: socket.socket, client_address: tuple) -> None:  # type: ignore[override]
        ticket = self.gate.enter(request, str(client_address[0]))
        if ticket is None:  # (the gate logged it)
            request.close()
            return
        threading.Thread(
            target=self._serve, args=(request, client_address, ticket), name="kspeed-http-conn", daemon=True
        ).start()

    def _serve(self, request: socket.socket, client_address: tuple, ticket: Ticket) -> None:
        conn = request
        try:
            if self.tls is not None:  # the handshake runs here, inside the gate, never in the accept loop
                conn = self.tls.wrap_socket(request, server_side=True)
            self.finish_request(conn, client_address)
        except OSError as exc:  # (ssl.SSLError included) a client that left, or was shut out by the gate
            log.debug("http connection from %s ended: %s", client_address[0], ticket.ended or exc)
        finally:
            self.gate.leave(ticket)  # before the descriptor is closed (the gate may shut it down until then)
            with contextlib.suppress(OSError):
                conn.close()
            request.close()


class HttpEndpoint:
    """Serves fixed GET routes on ``address`` until :meth:`close`.

    Args:
        address: ``host:port`` to bind.
        routes: path -> route.
        token: when set, every route but the ``open_routes`` needs ``Authorization: Bearer <token>``.
        open_routes: routes served without the token (health, readiness and metrics by default).
        limits: connections at once, per address, and how long each may stay open.
        tls: serve HTTPS with this context (:func:`server_tls`).

    Raises:
        ConfigError: when the address cannot be bound.
    """

    def __init__(
        self,
        address: str,
        routes: Mapping[str, Route],
        *,
        token: str = "",
        open_routes: Collection[str] = ("/healthz", "/readyz", "/metrics"),
        limits: HttpLimits = HttpLimits(),
        tls: ssl.SSLContext | None = None,
    ) -> None:
        host, _, port = address.rpartition(":")
        table = dict(routes)
        free = frozenset(open_routes)

        class Handler(BaseHTTPRequestHandler):
            timeout = limits.timeout  # each read (the gate bounds the whole connection)

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                route = table.get(path)
                if (
                    route is not None
                    and token
                    and path not in free
                    and not token_ok(self.headers.get("Authorization"), token)
                ):
                    self._answer(*text_response("missing or wrong bearer token", 401))
                    return
                if route is None:
                    status, ctype, body = text_response(f"no route {self.path}; try {', '.join(sorted(table))}", 404)
                else:
                    try:
                        status, ctype, body = route()
                    except Exception:
                        log.exception("HTTP route %s failed", self.path)
                        status, ctype, body = text_response("internal error", 500)
                self._answer(status, ctype, body)

            def _answer(self, status: int, ctype: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                if status == 401:
                    self.send_header("WWW-Authenticate", "Bearer")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("http %s " + format, self.address_string(), *args)

        self.gate = Gate("HTTP connection", total=limits.connections, per_peer=limits.per_peer, deadline=limits.timeout)
        try:
            self._server = _GatedServer((host, int(port)), Handler, self.gate, tls)
        except OSError as exc:
            raise ConfigError(
                f"cannot listen for HTTP on {address}: {exc.strerror}", field="http_listen", value=address
            ) from exc
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(SHUTDOWN_POLL_S,), name="kspeed-http", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop serving and release the socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        self.gate.close()
