"""The ``verbs`` receiver process: queue pairs, receive queue and completions off the training process.

Started by :class:`kspeed.rdma.verbs.receiver.VerbsReceiver` as ``python -m
kspeed.rdma.verbs.receiver_process CONFIG_JSON``; this process runs :class:`VerbsReceiverProcess`.
Consumers attach and hand over their rings as on ``tcp``: the receiver processes' shared skeleton
(:mod:`kspeed.rdma.receiver_process_base`) serves the control protocol, the handshakes and the
messages; device rings come as dma-bufs. Writers dial its TCP port, authenticate and send their
queue pair's material; for each one it creates an RC queue pair on its NIC (remote writes allowed,
receives from the NIC's shared receive queue), registers every ring of the consumer for that writer
alone (``LOCAL_WRITE | REMOTE_WRITE``; disconnecting the writer deregisters them, so its rkeys stop
working at the NIC), and answers with its own material, the rkeys and the writer's immediate
credits.

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
from typing import Any

from kspeed.errors import TransportError
from kspeed.rdma import framing
from kspeed.rdma.memory import MemfdSegment
from kspeed.rdma.receiver_process_base import Consumer, ReceiverProcessBase, WriterLink
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


class DmabufRegion:
    """A consumer's device ring as this process holds it: the dma-buf its memory was exported as
    (registered with the NIC for each writer; the bytes are never mapped here)."""

    def __init__(self, fd: int, nbytes: int) -> None:
        self.fd, self.nbytes = fd, nbytes

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


#: A consumer's ring as this process holds it: a mapped memfd, or a device ring's dma-buf.
_Ring = MemfdSegment | DmabufRegion


class _Peer(WriterLink[_Ring]):
    """One writer: its setup socket (messages, credits), queue pair and registrations.

    Args:
        sock: the setup connection (non-blocking); its messages travel on it too.
        consumer: the consumer it writes for.
        conn: its connection id.
        qp: its queue pair on this process's NIC.
        origin: the dialer's address.
    """

    def __init__(self, sock: socket.socket, consumer: Consumer[_Ring], conn: int, qp: Any, origin: str) -> None:
        super().__init__(consumer, conn, origin, sock)
        self.sock = sock
        self.qp = qp
        self.mrs: dict[int, Any] = {}
        self.credit = 0  # receives consumed since the last credit frame


class VerbsReceiverProcess(ReceiverProcessBase[_Ring, _Peer]):
    """The loop of the ``verbs`` receiver process."""

    rail = "verbs"
    writer_noun = "verbs writer"
    message_link = "setup connection"
    startup_errors = (Exception,)  # the device failed to open, too

    def __init__(self, config: dict) -> None:
        self.api = load_api(config.get("verbs_api"))
        self.nic: Nic = open_nic(self.api, choose_nic(self.api, config.get("nic")))
        super().__init__(config)
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

    def _register(self, peer: _Peer, handle: int, segment: _Ring) -> dict:
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

    def _attach_reply(self, c: Consumer[_Ring]) -> dict[str, Any]:
        return {**super()._attach_reply(c), "nic": self.nic.name, "gid": self.nic.gid}

    def _open_region(self, c: Consumer[_Ring], desc: dict[str, Any]) -> _Ring:
        if not desc.get("dmabuf"):
            return self._attach_memfd(c, desc)
        # a device ring: its dma-buf is registered, never mapped here
        if not c.reader.fds:
            raise TransportError("device ring announced without its dma-buf")
        return DmabufRegion(c.reader.fds.popleft(), int(desc["length"]))

    def _region_added(self, c: Consumer[_Ring], handle: int) -> None:
        # the writers already connected get the new ring's key too
        for peer in [p for p in self.writers.values() if p.consumer is c]:
            keys = {str(handle): self._register(peer, handle, c.regions[handle])}
            self._to_writer(peer, wire.KEYS, json.dumps(keys).encode())

    # --------------------------------------------------------------------------------- writers

    def _authenticate(self, sock: socket.socket, addr: tuple) -> tuple[Consumer[_Ring], tuple]:
        """Read the hello, authenticate the dialer and read its queue pair's setup (all inside the
        handshake gate).

        Returns:
            The consumer, and the writer's queue pair material and NIC.

        Raises:
            KSpeedError, OSError, struct.error, ValueError, KeyError: the dialer is refused.
        """
        hello = self._read_hello(sock, wire.HELLO.size, "verbs hello")
        magic, cid = wire.HELLO.unpack(hello)
        consumer = self._accept_hello(sock, addr, hello, cid, magic == wire.MAGIC)
        tcp_wire.tune(sock, self.options, nodelay=True)
        reader = framing.FrameReader(4096)
        setup = None
        while setup is None:
            if reader.recv(sock) == 0:
                raise TransportError(f"dialer {addr} left before its setup")
            for kind, payload in reader.frames():
                if kind == wire.SETUP:
                    setup = json.loads(payload)
        return consumer, (QpMaterial.from_dict(setup["qp"]), str(setup.get("nic", "?")))

    def _admit_writer(self, sock: socket.socket, consumer: Consumer[_Ring], origin: str, details: tuple) -> None:
        material, writer_nic = details
        try:
            peer = self._connect(sock, consumer, material, origin)
        except Exception as exc:  # the device refused: tell the writer, keep serving the others
            log.warning("could not connect verbs writer from NIC %s: %s", writer_nic, exc)
            with contextlib.suppress(OSError):
                sock.sendall(framing.frame(framing.ERROR, str(exc).encode()))
            sock.close()
            return
        log.debug(
            "verbs: writer %d (NIC %s) -> consumer %d over NIC %s",
            peer.conn,
            writer_nic,
            consumer.cid,
            self.nic.name,
        )

    def _connect(self, sock: socket.socket, consumer: Consumer[_Ring], material: QpMaterial, origin: str) -> _Peer:
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
        try:
            keys = {str(h): self._register(peer, h, seg) for h, seg in consumer.regions.items()}
            welcome = {"conn": peer.conn, "qp": nic.material(qp, psn).to_dict(), "keys": keys, "credits": CREDITS}
            sock.sendall(framing.frame(framing.WELCOME, json.dumps(welcome).encode()))
        except BaseException:  # a writer that never got its welcome: its registrations and QP go with it
            for mr in peer.mrs.values():
                mr.close()
            peer.mrs.clear()
            qp.close()
            raise
        sock.setblocking(False)
        self.by_qpn[int(qp.qp_num)] = peer
        self.sel.register(sock, selectors.EVENT_READ, ("msg", peer))
        self._add_writer(peer)
        return peer

    def _writer_frame(self, peer: _Peer, kind: int, payload: bytes) -> bool:
        if kind == framing.BYE:
            self._drain_cq()  # its last completions first
            self._drop_writer(peer, None)
            return False
        if kind != framing.MSG:
            raise TransportError(f"unknown frame type {kind} from verbs writer")
        return super()._writer_frame(peer, kind, payload)

    def _messages_ended(self, peer: _Peer) -> None:
        self._drain_cq()
        self._drop_writer(peer, "writer closed the connection without saying bye")

    def _release_writer(self, peer: _Peer) -> None:
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
                        self._drop_writer(peer, f"its queue pair failed: {status}")
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
            peer = self.writers.get(conn)
            if peer is not None and peer.credit:
                self._to_writer(peer, wire.CREDIT, _U32.pack(peer.credit))
                peer.credit = 0
        return got

    def _wait(self, tick: float) -> float:
        if not self.writers:
            return tick
        # completions arrive without a descriptor turning readable: poll the CQ between waits,
        # briefly while writes come in, longer once idle
        return 0.0 if self.idle_polls < 16 else min(tick, 0.0002 * self.idle_polls)

    def _between_waits(self) -> None:
        try:
            got = self._drain_cq()
        except Exception as exc:  # the CQ itself failed: every writer is lost
            log.error("verbs completion queue failed: %s", exc)
            for peer in list(self.writers.values()):
                self._drop_writer(peer, f"the completion queue failed: {exc}")
            got = 0
        self.idle_polls = 0 if got else min(self.idle_polls + 1, 10_000)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m kspeed.rdma.verbs.receiver_process CONFIG_JSON``; prints ``ready PORT``."""
    return VerbsReceiverProcess.main(argv)


if __name__ == "__main__":
    sys.exit(main())
