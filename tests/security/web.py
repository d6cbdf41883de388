"""Loopback stand-ins for a backend web server and for an address no server may reach.

:class:`Trap` listens on a loopback port standing for a link-local address (``169.254.169.254``,
a cloud's metadata service) and records every connection made to it. :class:`Web` serves a
directory over HTTP (byte ranges too, as object stores do), records every request (path and
headers), and answers chosen paths with a redirect, as a compromised or malicious backend host would.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import io
import re
import socket
import threading
from pathlib import Path


class Trap:
    """A loopback listener that records each connection, reads the request and closes it unanswered."""

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections: list[tuple[str, int]] = []
        self._thread = threading.Thread(target=self._accept, name="trap", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            self.connections.append(peer)
            with conn, contextlib.suppress(OSError):
                conn.settimeout(1.0)
                conn.recv(1 << 16)  # the request, so that closing ends it cleanly (no reset)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept (closing alone does not)
        self._sock.close()
        self._thread.join(timeout=5)


class _Handler(http.server.SimpleHTTPRequestHandler):
    web: Web

    def send_head(self):  # type: ignore[no-untyped-def]
        self.web.requests.append((self.command, self.path, dict(self.headers)))
        target = self.web.redirects.get(self.path.split("?", 1)[0])
        if target is not None:
            self.send_response(302)
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        ranged = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        path = Path(self.translate_path(self.path))
        if ranged is None or not path.is_file():
            return super().send_head()
        data = path.read_bytes()
        first = int(ranged[1])
        last = min(int(ranged[2]) if ranged[2] else len(data) - 1, len(data) - 1)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {first}-{last}/{len(data)}")
        self.send_header("Content-Length", str(max(last - first + 1, 0)))
        self.end_headers()
        return io.BytesIO(data[first : last + 1])

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the requests are recorded, not printed."""


class Web:
    """A loopback HTTP server over ``root`` that records requests and serves :attr:`redirects`.

    Attributes:
        url: ``http://127.0.0.1:<port>``.
        requests: ``(method, path, headers)`` of every request, in arrival order.
        redirects: request path -> the ``Location`` it is answered with (302).
    """

    def __init__(self, root: Path) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.redirects: dict[str, str] = {}
        handler = type("Handler", (_Handler,), {"web": self})
        self._server = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(handler, directory=str(root))
        )
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="web", daemon=True)
        self._thread.start()

    def paths(self) -> list[str]:
        """The paths requested so far."""
        return [path for _, path, _ in self.requests]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
