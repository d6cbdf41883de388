"""A small HTTP endpoint for daemons: health, readiness, Prometheus metrics and JSON status.

It runs a ``ThreadingHTTPServer`` on a daemon thread so scrapes never wait on the daemon's own
event loop; route handlers read snapshots and must not block.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Collection, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

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


class HttpEndpoint:
    """Serves fixed GET routes on ``address`` until :meth:`close`.

    Args:
        address: ``host:port`` to bind.
        routes: path -> route.
        token: when set, every route but the ``open_routes`` needs ``Authorization: Bearer <token>``.
        open_routes: routes served without the token (health, readiness and metrics by default).

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
    ) -> None:
        host, _, port = address.rpartition(":")
        table = dict(routes)
        free = frozenset(open_routes)

        class Handler(BaseHTTPRequestHandler):
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

        try:
            self._server = ThreadingHTTPServer((host, int(port)), Handler)
        except OSError as exc:
            raise ConfigError(
                f"cannot listen for HTTP on {address}: {exc.strerror}", field="http_listen", value=address
            ) from exc
        self._server.daemon_threads = True
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
