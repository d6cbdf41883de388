"""Exhaustion attacks on KSpeed's listeners, as functions a test or a benchmark can run.

Each attack runs against one address for a bounded time (or until ``stop`` is set), with a
bounded number of connections, and returns a report of what the target did to it: a test asserts
containment from the report (connections closed by their deadline, streams refused or ended), a
benchmark measures a legitimate job's throughput while the attack runs. Run one pinned to its own
core, so that defence is measured and not CPU contention, with
``taskset -c N python -m tests.security.attacks NAME HOST:PORT [--option value ...]`` (prints
the report as JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import selectors
import socket
import sys
import threading
import time
from collections.abc import Sequence

__all__ = ["HeldReport", "drip_handshakes", "split_address"]


@dataclasses.dataclass
class HeldReport:
    """What a listener did to the connections an attack held open.

    Attributes:
        opened: connections the attack opened (a closed one is opened again while the attack runs).
        closed_by_target: connections the target closed (or reset).
        longest_held: the longest any connection stayed open before the target closed it, or, for
            those still open when the attack ended, their age then (seconds).
        still_open: connections open when the attack ended.
        refused: connections that could not even be opened.
    """

    opened: int = 0
    closed_by_target: int = 0
    longest_held: float = 0.0
    still_open: int = 0
    refused: int = 0

    def as_dict(self) -> dict:
        """The report as a JSON-ready dict."""
        return dataclasses.asdict(self)


def split_address(address: str | tuple[str, int]) -> tuple[str, int]:
    """``host:port`` (or a ``(host, port)`` pair) as a pair."""
    if isinstance(address, tuple):
        return address
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _dial(address: str | tuple[str, int], source: str = "", timeout: float = 2.0) -> socket.socket:
    """A connection to ``host:port``, or to an abstract Unix socket given as ``"\\0name"``."""
    if isinstance(address, str) and address.startswith("\0"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target: str | tuple[str, int] = address
    else:
        host, port = split_address(address)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        target = (host, port)
    try:
        if source:
            sock.bind((source, 0))
        sock.settimeout(timeout)
        sock.connect(target)
    except OSError:
        sock.close()
        raise
    return sock


def drip_handshakes(
    address: str | tuple[str, int],
    n: int,
    *,
    payload: bytes,
    interval: float = 1.5,
    duration: float = 30.0,
    sources: Sequence[str] = ("",),
    stop: threading.Event | None = None,
    started: threading.Event | None = None,
) -> HeldReport:
    """Hold ``n`` handshakes open by sending ``payload`` one byte every ``interval`` seconds.

    A listener whose timeout applies to each read, not to the whole handshake, keeps such a
    connection for as long as the payload lasts: ``n`` of them can hold every handshake slot. A
    connection the target closes is opened again at once, so the slots stay taken unless the
    target makes room for others.

    Args:
        address: the listener (``host:port``, or ``"\\0name"`` for an abstract Unix socket).
        n: connections held at once (bounded: tens, not thousands).
        payload: the bytes dripped, e.g. a plausible hello (the whole handshake never completes).
        interval: seconds between two bytes on one connection.
        duration: seconds the attack lasts at most.
        sources: local addresses the connections are bound to, round robin ("" for any): several
            loopback addresses (127.0.0.2, ...) look like several peers.
        stop: ends the attack early when set.
        started: set once the ``n`` connections are open and have sent their first byte.
    """
    report = HeldReport()
    sel = selectors.DefaultSelector()
    born: dict[socket.socket, tuple[float, int]] = {}  # socket -> (opened at, bytes sent)
    end = time.monotonic() + duration

    def open_one(k: int) -> None:
        try:
            sock = _dial(address, sources[k % len(sources)])
        except OSError:
            report.refused += 1
            return
        sock.setblocking(False)
        report.opened += 1
        born[sock] = (time.monotonic(), 0)
        sel.register(sock, selectors.EVENT_READ, k)

    def closed(sock: socket.socket) -> None:
        opened, _ = born.pop(sock)
        report.closed_by_target += 1
        report.longest_held = max(report.longest_held, time.monotonic() - opened)
        sel.unregister(sock)
        sock.close()

    for k in range(n):
        open_one(k)
    next_drip = time.monotonic()
    try:
        while time.monotonic() < end and not (stop is not None and stop.is_set()):
            for key, _ in sel.select(max(0.0, min(next_drip, end) - time.monotonic())):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:  # (what the target says before closing is of no interest)
                    k = key.data
                    closed(sock)
                    open_one(k)
            if time.monotonic() >= next_drip:
                next_drip = time.monotonic() + interval
                for sock, (opened, sent) in list(born.items()):
                    if sent < len(payload):
                        try:
                            sock.send(payload[sent : sent + 1])
                            born[sock] = (opened, sent + 1)
                        except OSError:
                            pass  # closed under us: the read side sees it
                if started is not None:
                    started.set()
    finally:
        now = time.monotonic()
        report.still_open = len(born)
        for sock, (opened, _) in born.items():
            report.longest_held = max(report.longest_held, now - opened)
            sock.close()
        sel.close()
    return report


_ATTACKS = {"drip-handshakes": drip_handshakes}


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.security.attacks NAME HOST:PORT [--key value ...]``: run one attack, print its report."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("attack", choices=sorted(_ATTACKS))
    parser.add_argument("address")
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--interval", type=float, default=1.5)
    parser.add_argument("--payload", default="KSPEEDTCP2", help="drip-handshakes: the bytes dripped")
    parser.add_argument("--sources", default="", help="local addresses to bind, comma-separated")
    args = parser.parse_args(argv)
    report = drip_handshakes(
        args.address,
        args.n,
        payload=args.payload.encode(),
        interval=args.interval,
        duration=args.duration,
        sources=args.sources.split(",") if args.sources else ("",),
    )
    json.dump(report.as_dict(), sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
