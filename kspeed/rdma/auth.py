"""Mutual challenge-response that authenticates a data-plane connection before anything is honoured.

Each side sends a fresh 32-byte nonce; each proves knowledge of the shared key with an HMAC-SHA256
over a role label, the dialer's hello (which names what it wants to reach) and both nonces::

    dialer                                   listener
    hello, dialer nonce        ------>
                               <------       listener nonce
    dialer MAC                 ------>
                               <------       OK + listener MAC   (or REFUSED, then close)

Neither side sends anything derived from the key before it has seen the other's nonce, so a
recorded exchange cannot be replayed. The listener proves itself only after the dialer has: a
hello names a consumer by a small number, so a listener that answered every hello with a MAC would
hand anyone who can reach its port material to test guesses of a weak token offline. A dialer
reaches a listener only through material handed over the authenticated control plane.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
from collections.abc import Sequence
from typing import Any

from kspeed.errors import AuthError, PeerLostError, TransportError

__all__ = ["NONCE_BYTES", "accept", "dial", "open_material", "recv_exact"]

log = logging.getLogger(__name__)

NONCE_BYTES = 32
#: What to check when a handshake fails: the data-plane key derives from the cluster's bearer token.
TOKEN_HINT = (
    "the client and the servers must use the same cluster token: check security.token_file "
    "(KSPEED_TOKEN_FILE) or KSPEED_TOKEN on each"
)
_MAC_BYTES = 32
_OK = b"\x01"
_REFUSED = b"\x00"


def open_material(
    material: bytes, rail: str, fields: Sequence[str], token: bytes | None
) -> tuple[dict[str, Any], bytes]:
    """A receiver's connection material for ``rail`` and the key a writer authenticates with.

    The key is the cluster's ``token`` when one is configured, else the secret the receiver drew
    and published in its material (handed over the authenticated control plane).

    Raises:
        TransportError: the material is malformed, lacks one of ``fields`` or is for another rail.
        AuthError: the receiver expects the cluster token, but none is configured here.
    """
    try:
        info = json.loads(material)
        missing = [name for name in (*fields, "secret") if name not in info]
    except (ValueError, TypeError) as exc:
        raise TransportError(f"malformed {rail} connection material: {exc}") from exc
    if not isinstance(info, dict) or missing:
        raise TransportError(f"malformed {rail} connection material: missing {', '.join(missing) or 'fields'}")
    if info.get("rail") != rail:
        raise TransportError(f"connection material is for rail {info.get('rail')!r}, not {rail!r}")
    if token is not None:
        return info, token
    if info["secret"] is None:
        raise AuthError(f"{rail} receiver expects the cluster token, but no token was configured here; {TOKEN_HINT}")
    try:
        return info, bytes.fromhex(info["secret"])
    except (ValueError, TypeError) as exc:
        raise TransportError(f"malformed {rail} connection material: bad secret: {exc}") from exc


def recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
    """Read exactly ``n`` bytes from a blocking socket (with its timeout) or raise PeerLostError."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    try:
        while got < n:
            k = sock.recv_into(view[got:])
            if k == 0:
                raise PeerLostError(f"{what}: peer closed the connection after {got} of {n} bytes")
            got += k
    except TimeoutError as exc:
        raise PeerLostError(f"{what}: no data from peer within {sock.gettimeout()} s") from exc
    except OSError as exc:
        raise PeerLostError(f"{what}: {exc}") from exc
    return bytes(buf)


def _send(sock: socket.socket, data: bytes, what: str) -> None:
    try:
        sock.sendall(data)
    except OSError as exc:
        raise PeerLostError(f"{what}: {exc}") from exc


def _mac(key: bytes, label: bytes, hello: bytes, dialer_nonce: bytes, listener_nonce: bytes) -> bytes:
    return hmac.new(key, label + hello + dialer_nonce + listener_nonce, hashlib.sha256).digest()


def dial(sock: socket.socket, key: bytes, hello: bytes) -> None:
    """Authenticate as the dialer, after ``hello`` was sent in the clear.

    Raises:
        AuthError: the listener refused our proof, or could not prove it knows the key.
        PeerLostError: the listener vanished or stalled during the exchange.
    """
    nonce = os.urandom(NONCE_BYTES)
    _send(sock, nonce, "handshake")
    listener_nonce = recv_exact(sock, NONCE_BYTES, "handshake")
    _send(sock, _mac(key, b"kspeed-dialer", hello, nonce, listener_nonce), "handshake")
    if recv_exact(sock, 1, "handshake") != _OK:
        raise AuthError(
            f"data-plane listener refused our credentials (wrong token or connection material); {TOKEN_HINT}"
        )
    listener_mac = recv_exact(sock, _MAC_BYTES, "handshake")
    if not hmac.compare_digest(listener_mac, _mac(key, b"kspeed-listener", hello, nonce, listener_nonce)):
        raise AuthError(f"data-plane listener failed authentication (wrong token or connection material); {TOKEN_HINT}")


def accept(sock: socket.socket, key: bytes, hello: bytes) -> None:
    """Authenticate a dialer whose ``hello`` has been read; prove ourselves only once it has.

    Raises:
        AuthError: the dialer could not prove it knows the key (it is told so, then dropped).
        PeerLostError: the dialer vanished or stalled during the exchange.
    """
    dialer_nonce = recv_exact(sock, NONCE_BYTES, "handshake")
    nonce = os.urandom(NONCE_BYTES)
    _send(sock, nonce, "handshake")
    dialer_mac = recv_exact(sock, _MAC_BYTES, "handshake")
    if not hmac.compare_digest(dialer_mac, _mac(key, b"kspeed-dialer", hello, dialer_nonce, nonce)):
        try:
            sock.sendall(_REFUSED)
        except OSError:
            log.debug("dialer left before hearing it was refused")
        raise AuthError(f"data-plane dialer failed authentication (wrong token or connection material); {TOKEN_HINT}")
    _send(sock, _OK + _mac(key, b"kspeed-listener", hello, dialer_nonce, nonce), "handshake")
