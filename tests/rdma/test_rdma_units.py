"""Unit tests of the data-plane building blocks: options, region keys, auth, memory, registry, tcp guards."""

from __future__ import annotations

import fcntl
import os
import socket
import threading
import time

import numpy as np
import pytest

from kspeed.errors import AuthError, ConfigError, PeerLostError, RailUnavailableError, RangeError, TransportError
from kspeed.rdma import auth
from kspeed.rdma.base import RegionKey
from kspeed.rdma.framing import IMMS, MSG, FrameReader, frame, send_draining
from kspeed.rdma.memory import PAGE_SIZE, HostBuffer, MemfdSegment
from kspeed.rdma.options import RailOptions
from kspeed.rdma.rails import available_rails, get_rail, rail_names, rail_status, register_rail, unregister_rail
from kspeed.rdma.tcp import TcpRail, wire

TOKEN = b"unit-test-token-0123456789"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("io_timeout", 0),
        ("token", b"short"),
        ("keepalive_count", 0),
        ("receiver_name", "bad name!"),
        ("socket_buffer", 10),
    ],
)
def test_options_name_the_bad_field(field, value):
    with pytest.raises(ConfigError) as err:
        RailOptions(**{field: value})
    assert err.value.field == f"rdma.{field}"


def test_region_key_round_trips_and_slices():
    key = RegionKey("tcp", "host-a", 3, 0, 1 << 20)
    assert RegionKey.from_bytes(key.to_bytes()) == key
    assert RegionKey.from_dict(key.to_dict()) == key
    sub = key.slice(4096, 8192)
    assert (sub.addr, sub.length, sub.handle) == (4096, 8192, 3)
    with pytest.raises(RangeError):
        sub.slice(8000, 400)
    with pytest.raises(TransportError):
        RegionKey.from_bytes(b"not json")
    with pytest.raises(TransportError):
        RegionKey.from_dict({"rail": "tcp"})


def _handshake(dial_key: bytes, accept_key: bytes):
    a, b = socket.socketpair()
    a.settimeout(2)
    b.settimeout(2)
    result = {}

    def listener():
        try:
            auth.accept(b, accept_key, b"hello")
            result["accept"] = "ok"
        except (AuthError, PeerLostError) as exc:
            result["accept"] = exc

    t = threading.Thread(target=listener)
    t.start()
    try:
        auth.dial(a, dial_key, b"hello")
        result["dial"] = "ok"
    except AuthError as exc:
        result["dial"] = exc
        a.close()  # a dialer that refuses the listener hangs up; the listener must not wait
    t.join()
    a.close()
    b.close()
    return result


def test_auth_accepts_same_key_and_refuses_other():
    assert _handshake(TOKEN, TOKEN) == {"accept": "ok", "dial": "ok"}
    result = _handshake(TOKEN, b"x" * 26)
    assert isinstance(result["dial"], AuthError)
    assert isinstance(result["accept"], (AuthError, PeerLostError))
    assert "security.token_file (KSPEED_TOKEN_FILE)" in str(result["dial"])  # the setting to check


def test_auth_listener_reveals_nothing_derived_from_the_key_to_a_dialer_that_has_not_proved_itself():
    # A hello names a consumer by a small number: a listener that answered it with a MAC gave
    # anyone who reached its port what it needs to test guesses of a weak token offline.
    a, b = socket.socketpair()
    a.settimeout(2)
    b.settimeout(2)
    outcome = []
    listener = threading.Thread(target=lambda: outcome.append(_refused(b)))
    listener.start()
    dialer_nonce = os.urandom(auth.NONCE_BYTES)
    a.sendall(dialer_nonce)
    heard = auth.recv_exact(a, auth.NONCE_BYTES, "listener nonce")
    a.sendall(bytes(32))  # a guess at the proof
    heard += a.recv(4096)
    listener.join()
    a.close()
    b.close()
    listener_nonce = heard[: auth.NONCE_BYTES]
    macs = [
        auth._mac(TOKEN, label, b"hello", dialer_nonce, listener_nonce)
        for label in (b"kspeed-listener", b"kspeed-dialer")
    ]
    assert not any(mac in heard for mac in macs)
    assert heard[auth.NONCE_BYTES :] == b"\x00"  # refused, and nothing else
    assert isinstance(outcome[0], AuthError)


def _refused(sock: socket.socket) -> BaseException | None:
    try:
        auth.accept(sock, TOKEN, b"hello")
    except (AuthError, PeerLostError) as exc:
        return exc
    return None


def test_auth_times_out_on_silent_peer():
    a, b = socket.socketpair()
    a.settimeout(0.3)
    t0 = time.monotonic()
    with pytest.raises(PeerLostError):
        auth.dial(a, TOKEN, b"hello")
    assert time.monotonic() - t0 < 2
    a.close()
    b.close()


def test_memfd_is_sealed_page_aligned_and_attachable():
    with MemfdSegment.create(10_000) as seg:
        assert len(seg.view) == 10_000
        assert os.fstat(seg.fd).st_size % PAGE_SIZE == 0
        seg.array()[:5] = [1, 2, 3, 4, 5]
        with pytest.raises(OSError):
            os.ftruncate(seg.fd, 0)  # sealed: a receiver cannot shrink the ring under a writer
        other = MemfdSegment.attach(os.dup(seg.fd), 10_000)
        assert bytes(other.view[:5]) == bytes([1, 2, 3, 4, 5])
        other.close()
        with pytest.raises(TransportError):
            MemfdSegment.attach(os.dup(seg.fd), 1 << 30)  # announces more than it holds


def test_attach_refuses_unsealed_segment():
    fd = os.memfd_create("unsealed")
    os.ftruncate(fd, 4096)
    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK == 0
    with pytest.raises(TransportError):
        MemfdSegment.attach(fd, 4096)


def test_host_buffer_close_tolerates_live_views():
    buf = HostBuffer(5000)
    arr = buf.array()
    arr[:] = 7
    buf.close()  # deferred while arr lives
    assert int(arr[-1]) == 7
    del arr


def test_frame_reader_splits_partial_frames():
    a, b = socket.socketpair()
    data = frame(IMMS, np.arange(3, dtype=np.uint32).tobytes()) + frame(MSG, b"hi")
    reader = FrameReader(16)
    a.sendall(data[:5])
    reader.recv(b)
    assert list(reader.frames()) == []
    a.sendall(data[5:])
    frames = []
    while len(frames) < 2:
        assert reader.recv(b) > 0
        frames += list(reader.frames())
    assert frames[0][0] == IMMS and np.frombuffer(frames[0][1], np.uint32).tolist() == [0, 1, 2]
    assert frames[1] == (MSG, b"hi")
    a.close()
    b.close()


def _fill(sock: socket.socket) -> int:
    """Send into ``sock`` until its buffers are full; returns how many bytes went."""
    sock.setblocking(False)
    sent = 0
    try:
        while True:
            sent += sock.send(bytes(1 << 16))
    except BlockingIOError:
        pass
    sock.settimeout(5.0)
    return sent


def test_send_draining_times_out_on_a_peer_that_stops_reading():
    a, b = socket.socketpair()
    with a, b:
        _fill(a)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="no progress"):
            send_draining(a, b"x" * 4096, 0.2, lambda: None)
        assert time.monotonic() - started >= 0.2


def test_send_draining_does_not_blame_the_peer_for_a_pause_of_its_own():
    # The buffers are full and the peer has sent something: the drain runs, and this process
    # stalls in it past the timeout (a garbage collection joining a DataLoader's workers) while
    # the peer reads everything. The send then goes on: the peer made progress all along.
    a, b = socket.socketpair()
    with a, b:
        queued = _fill(a)
        b.send(b"!")
        data = bytes(range(256)) * 64
        got = bytearray()

        def read_all() -> None:
            while len(got) < queued + len(data):
                got.extend(b.recv(1 << 16))

        reader = threading.Thread(target=read_all)

        def drain() -> None:
            assert a.recv(16) == b"!"
            reader.start()
            time.sleep(0.6)  # three timeouts

        send_draining(a, data, 0.2, drain)
        reader.join(5)
        assert not reader.is_alive() and bytes(got[queued:]) == data


def test_registry_reports_unavailable_rail_with_reason():
    class Broken(TcpRail):
        name = "broken-test-rail"

        def unavailable_reason(self):
            return "no such hardware"

    register_rail(Broken())
    try:
        assert rail_status()["broken-test-rail"] == "no such hardware"
        assert "broken-test-rail" in rail_names() and "broken-test-rail" not in available_rails()
        with pytest.raises(RailUnavailableError) as err:
            get_rail("broken-test-rail")
        assert "no such hardware" in str(err.value) and "shm" in str(err.value)
    finally:
        unregister_rail("broken-test-rail")
    assert "broken-test-rail" not in rail_names()


def test_tcp_receiver_drops_writer_stalled_mid_write_and_refuses_out_of_range():
    opts = RailOptions(token=TOKEN, io_timeout=0.5)
    rail = get_rail("tcp")
    with rail.listen(opts) as rx:
        ring = rx.register(1 << 16)
        arr = ring.array()
        arr[:] = 0
        wr = rail.connect(rx.material, opts)
        # Header promises 4096 bytes, only 100 arrive: the receiver gives up after io_timeout.
        wr._sendmsg([wire.WRITE_HEADER.pack(wire.DATA, wire.FLAG_IMM, ring.key.handle, 1, 0, 4096), b"z" * 100])
        t0 = time.monotonic()
        with pytest.raises(PeerLostError) as err:
            while time.monotonic() - t0 < 5:
                rx.poll(0.1)
        assert time.monotonic() - t0 < 3
        assert "stalled" in str(err.value)
        wr.close()
        # A header outside the region (crafted past the writer's own check) never lands.
        wr = rail.connect(rx.material, opts)
        wr._sendmsg(
            [wire.WRITE_HEADER.pack(wire.DATA, wire.FLAG_IMM, ring.key.handle, 2, (1 << 16) - 10, 64), b"q" * 64]
        )
        with pytest.raises(PeerLostError) as err:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 5:
                rx.poll(0.1)
        assert "refused" in str(err.value)
        assert int(arr[100:].max()) == 0
        wr.close()
        del arr
