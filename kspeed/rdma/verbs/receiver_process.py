"""The ``verbs`` receiver process: queue pairs, receive queue and completions off the training process.

Started by :class:`kspeed.rdma.verbs.receiver.VerbsReceiver` as ``python -m
kspeed.rdma.verbs.receiver_process CONFIG_JSON``. Consumers attach and hand over their rings as on
``tcp`` (the control protocol of :mod:`kspeed.rdma.tcp.receiver_process`, which this extends).
Writers dial its TCP port, authenticate and send their queue pair's material; for each one it
creates an RC queue pair on its NIC (remote writes allowed, receives from the NIC's shared receive
queue), registers every ring of the consumer for that writer alone (``LOCAL_WRITE |
REMOTE_WRITE``; disconnecting the writer deregisters them, so its rkeys stop working at the NIC),
and answers with its own material, the rkeys and the writer's immediate credits.

The loop drains the completion queue in bulk (``ntohl`` on every immediate: ``imm_data`` is in
network order), maps each completion's queue pair to its connection, refills the shared receive
queue and gives the writers their credits back. The completion queue holds as many entries as the
receive queue, so it cannot overrun. A completion in error, or the end of a writer's setup
connection (keepalive and ``TCP_USER_TIMEOUT`` tell a dead peer, which an RC responder never
learns from the NIC), drops that writer and reports it to the consumer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import socket
import struct
import sys
import time
from typing import Any

from kspeed.errors import KSpeedError, TransportError
from kspeed.rdma import auth, framing
from kspeed.rdma.memory import MemfdSegment
from kspeed.rdma.tcp import receiver_process as tcp_process
from kspeed.rdma.tcp import wire as tcp_wire

from . import wire
from .api import load_api
from .nic import Nic, QpMaterial, choose_nic, new_psn, open_nic
from .writer import wc_status

log = logging.getLogger(__name__)

#: Receive work requests kept posted on the shared receive queue (clamped to the device's limit).
SRQ_DEPTH = 8192
#: Immediates a writer may have in flight (given back as the receiver reposts their receives).
CREDITS = 256
_U32 = struct.Struct("<I")


class _Peer:
    """One writer: its setup socket (messages, credits), queue pair and registrations."""

    def __init__(self, sock: socket.socket, consumer: tcp_process._Consumer, conn: int, qp: Any, origin: str) -> None:
        self.sock = sock
        self.consumer = consumer
        self.conn = conn
        self.qp = qp
        self.origin = origin  # the dialer's address
        self.mrs: dict[int, Any] = {}
        self.credit = 0  # receives consumed since the last credit frame
        # (what the tcp loop's message and stall handling use)
        self.msg_sock: socket.socket | None = sock
        self.msg_reader = framing.FrameReader(1 << 16)
        self.msg_out = bytearray()
        self.msg_stalled_since: float | None = None
        self.dst = None
        self.hdr_got = 0
        self.last = time.monotonic()


class DmabufRegion:
    """A consumer's device ring as this process holds it: the dma-buf its memory was exported as
    (registered with the NIC for each writer; the bytes are never mapped here)."""

    def __init__(self, fd: int, nbytes: int) -> None:
        self.fd, self.nbytes = fd, nbytes

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


class VerbsReceiverProcess(tcp_process.ReceiverProcess):
    """The loop of the ``verbs`` receiver process."""

    def __init__(self, config: dict) -> None:
        self.api = load_api(config.get("verbs_api"))
        self.nic: Nic = open_nic(self.api, choose_nic(self.api, config.get("nic")))
        super().__init__(config)
        #: the writers by connection id (the tcp loop's ``bulks``, which its shared code walks)
        self.peers: dict[int, _Peer] = self.bulks  # type: ignore[assignment]
        api, nic = self.api, self.nic
        self.srq_depth = SRQ_DEPTH
        self.srq = api.create_srq(nic.pd, self.srq_depth, 1)
        self.cq = api.create_cq(nic.context, self.srq_depth + 64)
        self.send_cq = api.create_cq(nic.context, 64)  # responders post nothing
        self.recv_wr = api.RecvWR(wr_id=0, num_sge=1, sg=[api.SGE(0, 0, 0)])
        self.recv_wr.num_sge = 0  # a write with immediate places no data through the receive
        self._post_receives(self.srq_depth)
        self.by_qpn: dict[int, _Peer] = {}
        self.idle_polls = 0

    # ------------------------------------------------------------------------------- verbs parts

    def _post_receives(self, count: int) -> None:
        for _ in range(count):
            self.srq.post_recv(self.recv_wr)

    def _region_address(self, segment: MemfdSegment) -> int:
        return int(segment.array().ctypes.data)

    def _register(self, peer: _Peer, handle: int, segment: MemfdSegment | DmabufRegion) -> dict:
        e = self.api.e
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        if isinstance(segment, DmabufRegion):  # addressed by IOVA: its offset, from 0
            mr = self.api.reg_dmabuf_mr(self.nic.pd, segment.fd, segment.nbytes, access)
            address = 0
        else:
            address = self._region_address(segment)
            mr = self.api.reg_mr(self.nic.pd, address, segment.nbytes, access)
        peer.mrs[handle] = mr
        return {"rkey": int(mr.rkey), "addr": address, "length": segment.nbytes}

    # ------------------------------------------------------------------------------- consumers

    def _attach_reply(self, c: tcp_process._Consumer) -> bytes:
        return json.dumps({"consumer": c.cid, "port": self.port, "nic": self.nic.name, "gid": self.nic.gid}).encode()

    def _consumer_frame(self, c: tcp_process._Consumer, kind: int, payload: bytes) -> None:
        if kind == framing.CALL and json.loads(payload).get("op") == "attach":
            c.key = bytes.fromhex(json.loads(payload)["key"])
            self._to_consumer(c, framing.REPLY, self._attach_reply(c))
            return
        if kind == framing.REGION:
            desc = json.loads(payload)
            handle = int(desc["handle"])
            if desc.get("dmabuf"):  # a device ring: its dma-buf is registered, never mapped here
                if not c.reader.fds:
                    raise TransportError("device ring announced without its dma-buf")
                c.regions[handle] = DmabufRegion(c.reader.fds.popleft(), int(desc["length"]))  # type: ignore[assignment]
                self._to_consumer(c, framing.REPLY, payload)
            else:
                super()._consumer_frame(c, kind, payload)
            for peer in [p for p in self.peers.values() if p.consumer is c]:
                keys = {str(handle): self._register(peer, handle, c.regions[handle])}
                self._to_peer(peer, wire.KEYS, json.dumps(keys).encode())
            return
        super()._consumer_frame(c, kind, payload)

    # --------------------------------------------------------------------------------- writers

    def _authenticate(self, sock: socket.socket, addr: tuple) -> tuple:
        """Read the hello, authenticate the dialer and read its queue pair's setup (all inside the
        handshake gate); returns what :meth:`_admit` takes.

        Raises:
            KSpeedError, OSError, struct.error, ValueError, KeyError: the dialer is refused.
        """
        sock.settimeout(self.options.connect_timeout)  # per read; the gate bounds the whole handshake
        hello = auth.recv_exact(sock, wire.HELLO.size, "verbs hello")
        magic, cid = wire.HELLO.unpack(hello)
        consumer = self.consumers.get(cid)
        if magic != wire.MAGIC:
            raise TransportError(f"unknown hello from {addr}")
        if consumer is None or consumer.key is None:
            raise TransportError(f"dialer {addr} asked for consumer {cid}, which is not attached")
        auth.accept(sock, consumer.key, hello)
        tcp_wire.tune(sock, self.options, nodelay=True)
        reader = framing.FrameReader(4096)
        setup = None
        while setup is None:
            if reader.recv(sock) == 0:
                raise TransportError(f"dialer {addr} left before its setup")
            for kind, payload in reader.frames():
                if kind == wire.SETUP:
                    setup = json.loads(payload)
        return sock, consumer, QpMaterial.from_dict(setup["qp"]), str(setup.get("nic", "?")), str(addr[0])

    def _admit(self) -> None:
        with contextlib.suppress(BlockingIOError):
            self.wake_r.recv(4096)
        while not self.admitted.empty():
            sock, consumer, material, writer_nic, origin = self.admitted.get()
            if consumer.cid not in self.consumers:
                sock.close()
                continue
            try:
                peer = self._connect(sock, consumer, material, origin)
            except Exception as exc:  # the device refused: tell the writer, keep serving the others
                log.warning("could not connect verbs writer from NIC %s: %s", writer_nic, exc)
                with contextlib.suppress(OSError):
                    sock.sendall(framing.frame(framing.ERROR, str(exc).encode()))
                sock.close()
                continue
            log.debug(
                "verbs: writer %d (NIC %s) -> consumer %d over NIC %s",
                peer.conn,
                writer_nic,
                consumer.cid,
                self.nic.name,
            )

    def _connect(
        self, sock: socket.socket, consumer: tcp_process._Consumer, material: QpMaterial, origin: str
    ) -> _Peer:
        nic = self.nic
        qp = nic.create_qp(self.send_cq, self.cq, self.srq, 1)
        try:
            nic.to_init(qp, remote_write=True)
            psn = new_psn()
            nic.to_rtr(qp, material, material.psn)
            nic.to_rts(qp, psn)
        except BaseException:
            qp.close()
            raise
        peer = _Peer(sock, consumer, next(self.conns), qp, origin)
        keys = {str(h): self._register(peer, h, seg) for h, seg in consumer.regions.items()}
        welcome = {"conn": peer.conn, "qp": nic.material(qp, psn).to_dict(), "keys": keys, "credits": CREDITS}
        sock.sendall(framing.frame(framing.WELCOME, json.dumps(welcome).encode()))
        sock.setblocking(False)
        self.peers[peer.conn] = peer
        self.by_qpn[int(qp.qp_num)] = peer
        self.sel.register(sock, selectors.EVENT_READ, ("msg", peer))
        self._to_consumer(consumer, framing.WELCOME, _U32.pack(peer.conn))
        return peer

    def _to_peer(self, peer: _Peer, kind: int, payload: bytes) -> None:
        peer.msg_out += framing.frame(kind, payload)
        self._flush_messages(peer)  # type: ignore[arg-type]  # (a _Peer has what it uses of a _Bulk)

    def _msg_readable(self, bulk: Any) -> None:
        peer: _Peer = bulk
        try:
            n = peer.msg_reader.recv(peer.sock, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            self._drop_bulk(peer, f"setup connection failed: {exc}")
            return
        try:
            for kind, payload in peer.msg_reader.frames():
                if kind == framing.MSG:
                    self._to_consumer(peer.consumer, framing.MSG, _U32.pack(peer.conn) + payload)
                elif kind == framing.BYE:
                    self._drain_cq()  # its last completions first
                    self._drop_bulk(peer, None)
                    return
                else:
                    raise TransportError(f"unknown frame type {kind} from verbs writer")
        except TransportError as exc:
            self._drop_bulk(peer, str(exc))
            return
        if n == 0:
            self._drain_cq()
            self._drop_bulk(peer, "writer closed the connection without saying bye")

    def _drop_bulk(self, bulk: Any, reason: str | None) -> None:
        peer: _Peer = bulk
        if self.peers.pop(peer.conn, None) is None:
            return
        self.by_qpn.pop(int(peer.qp.qp_num), None)
        try:
            self.nic.to_error(peer.qp)
        except Exception as exc:
            log.debug("moving writer %d's queue pair to error: %s", peer.conn, exc)
        for mr in peer.mrs.values():  # its rkeys stop working at the NIC
            mr.close()
        peer.mrs.clear()
        peer.qp.close()
        self.sel.unregister(peer.sock)
        peer.sock.close()
        c = peer.consumer
        if c.cid in self.consumers:
            self._flush_consumer(c)
            if reason is None:
                self._to_consumer(c, framing.BYE, _U32.pack(peer.conn))
            else:
                log.warning("verbs writer %d of consumer %d lost: %s", peer.conn, c.cid, reason)
                self._to_consumer(c, framing.LOST, _U32.pack(peer.conn) + reason.encode())

    # ---------------------------------------------------------------------------- completions

    def _drain_cq(self) -> int:
        """Take every completion in: immediates to their consumers, errors drop their writer;
        repost the receives they used and give their writers the credit back."""
        e = self.api.e
        ntohl = socket.ntohl
        got = 0
        touched: set[int] = set()
        while True:
            n, wcs = self.cq.poll(1024)
            if not n:
                break
            got += n
            for wc in wcs[:n]:
                peer = self.by_qpn.get(int(wc.qp_num))
                if wc.status != e.IBV_WC_SUCCESS:
                    if peer is not None:
                        status = wc_status(e, wc.status)
                        self._drop_bulk(peer, f"its queue pair failed: {status}")
                    continue
                if peer is None:  # a writer dropped meanwhile: its receive is reposted, nothing told
                    continue
                peer.consumer.pending.append(peer.conn)
                peer.consumer.pending.append(ntohl(int(wc.imm_data)))
                peer.credit += 1
                touched.add(peer.conn)
            if n < 1024:
                break
        if got:
            self._post_receives(got)
        for conn in touched:
            peer = self.peers.get(conn)
            if peer is not None and peer.credit:
                self._to_peer(peer, wire.CREDIT, _U32.pack(peer.credit))
                peer.credit = 0
        return got

    def run(self) -> None:
        tick = min(0.5, self.options.io_timeout / 4)
        while True:
            # completions arrive without a descriptor turning readable: poll the CQ between waits,
            # briefly while writes come in, longer once idle
            wait = 0.0 if self.idle_polls < 16 else min(tick, 0.0002 * self.idle_polls)
            if not self.peers:
                wait = tick
            for key, events in self.sel.select(wait):
                data = key.data
                if isinstance(data, tcp_process._Consumer):
                    if data.cid in self.consumers:
                        self._consumer_readable(data)
                elif isinstance(data, tuple):
                    peer = data[1]
                    if events & selectors.EVENT_WRITE and peer.conn in self.bulks:
                        self._flush_messages(peer)
                    if events & selectors.EVENT_READ and peer.conn in self.bulks:
                        self._msg_readable(peer)
                elif data == "listen":
                    self._accept_writer()
                elif data == "control":
                    self._accept_consumer()
                else:
                    self._admit()
            try:
                got = self._drain_cq()
            except Exception as exc:  # the CQ itself failed: every writer is lost
                log.error("verbs completion queue failed: %s", exc)
                for peer in list(self.peers.values()):
                    self._drop_bulk(peer, f"the completion queue failed: {exc}")
                got = 0
            self.idle_polls = 0 if got else min(self.idle_polls + 1, 10_000)
            for c in list(self.consumers.values()):
                if c.pending or c.out:
                    self._flush_consumer(c)
            now = time.monotonic()
            self._check_stalls(now)
            if self._should_exit(now):
                return


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m kspeed.rdma.verbs.receiver_process CONFIG_JSON``; prints ``ready PORT``."""
    config = json.loads((argv if argv is not None else sys.argv[1:])[0])
    logging.basicConfig(level=config.get("log_level", "WARNING"), format="kspeed-verbs-receiver: %(message)s")
    if not config["shared"]:
        tcp_process._die_with_parent(config["parent"])
    try:
        proc = VerbsReceiverProcess(config)
    except (OSError, KSpeedError) as exc:
        print(f"error {exc}", flush=True)
        return 3
    except Exception as exc:  # the device failed to open
        print(f"error {exc}", flush=True)
        return 3
    print(f"ready {proc.port}", flush=True)
    sys.stdout.close()
    proc.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
