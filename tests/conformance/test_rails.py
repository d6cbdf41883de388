"""Conformance suite every data-plane rail must pass unchanged (run once per available rail)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kspeed.errors import AuthError, PeerLostError, RailUnavailableError, RangeError, TransportError
from kspeed.rdma.base import RegionKey
from kspeed.rdma.options import RailOptions
from kspeed.rdma.rails import available_rails, get_rail
from kspeed.rdma.receiver_process_base import MAX_HANDSHAKES
from kspeed.rdma.shm import writer as shm_writer
from kspeed.rdma.tcp import wire as tcp_wire
from tests.conformance.conftest import IO_TIMEOUT
from tests.conformance.rail_workers import pattern, serve_ring, stream_forever, write_patterns
from tests.security.attacks import drip_handshakes

BOUND = 4 * IO_TIMEOUT + 3.0  # detection bound asserted for every failure (timeouts plus slack)


def _children(pid: int) -> set[int]:
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.add(int(entry))
    return out


def _shm_entries() -> set[str]:
    """Entries of /dev/shm, minus the semaphores of multiprocessing queues used by the tests themselves
    (``sem.mp-*``, or ``sem.loky-<this pid>-*`` once joblib's loky has renamed them)."""
    ours = ("sem.mp-", f"sem.loky-{os.getpid()}-")
    return {name for name in os.listdir("/dev/shm") if not name.startswith(ours)}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _poll_until(receiver, count: int, timeout: float = 10.0):
    imms, conns = [], []
    deadline = time.monotonic() + timeout
    while len(imms) < count and time.monotonic() < deadline:
        done = receiver.poll(0.2)
        imms += done.imm.tolist()
        conns += done.conn.tolist()
    return imms, conns


def _expect_lost(receiver, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            receiver.poll(0.1)
        except PeerLostError:
            return time.monotonic() - t0
    pytest.fail(f"no PeerLostError within {timeout} s")


def test_unknown_rail_lists_offer():
    with pytest.raises(RailUnavailableError) as err:
        get_rail("carrier-pigeon")
    for name in available_rails():
        assert name in str(err.value)


def test_writes_land_byte_exact(rail, options):
    with get_rail(rail).listen(options) as rx:
        ring = rx.register(1 << 20)
        arr = ring.array()
        arr[:] = 0xEE
        with get_rail(rail).connect(rx.material, options) as wr:
            key = RegionKey.from_bytes(ring.key.slice(4096, 65536).to_bytes())
            wr.write(key, b"single", 3, imm=1)
            gathered = [b"head", np.arange(10, dtype=np.uint8), memoryview(b"tail")]
            wr.write(key, gathered, 100, imm=2)
            floats = np.array([1.5, -2.0], np.float32)
            wr.write_many(key, [(floats, 200, 3), (b"no-imm", 300, None), ([b"ab", b"cd"], 400, 4)])
            imms, conns = _poll_until(rx, 4)
            assert imms == [1, 2, 3, 4]
            assert set(conns) == {wr.conn}
        base = 4096
        assert bytes(arr[base + 3 : base + 9]) == b"single"
        assert bytes(arr[base + 100 : base + 118]) == b"head" + bytes(range(10)) + b"tail"
        assert arr[base + 200 : base + 208].view(np.float32).tolist() == [1.5, -2.0]
        assert bytes(arr[base + 300 : base + 306]) == b"no-imm"
        assert bytes(arr[base + 400 : base + 404]) == b"abcd"
        assert arr[: base + 3].tolist() == [0xEE] * (base + 3)  # nothing before the write
        assert arr[base + 404 :].min() == 0xEE or bytes(arr[base + 404 : base + 405]) == b"\xee"
        del arr


def test_immediates_once_and_after_data(rail, options, spawn):
    size, count = 8192, 300
    with get_rail(rail).listen(options) as rx:
        ring = rx.register(size * count)
        arr = ring.array()
        spawn(write_patterns, rail, rx.material, ring.key.to_bytes(), options, 1000, count, size)
        seen = []
        deadline = time.monotonic() + 20
        while len(seen) < count and time.monotonic() < deadline:
            done = rx.poll(0.2)
            for imm in done.imm.tolist():
                slot = imm - 1000
                # the data of a write is complete when its completion is seen
                assert np.array_equal(arr[slot * size : (slot + 1) * size], pattern(imm, size))
                seen.append(imm)
        assert sorted(seen) == list(range(1000, 1000 + count))  # each exactly once
        time.sleep(0.2)
        extra = []
        with contextlib.suppress(PeerLostError):
            extra = rx.poll(0.2).imm.tolist()
        assert extra == []
        del arr


def test_many_writer_processes_one_receiver(rail, options, spawn):
    size, count, writers = 4096, 200, 3
    with get_rail(rail).listen(options) as rx:
        ring = rx.register(size * count * writers)
        arr = ring.array()
        share = size * count
        queue = spawn.ctx.Queue()
        for n in range(writers):
            key = ring.key.slice(n * share, share)
            spawn(write_patterns, rail, rx.material, key.to_bytes(), options, n * 10000, count, size, queue)
        imms, conns = _poll_until(rx, count * writers, 30)
        assert len(imms) == count * writers
        by_conn: dict[int, list[int]] = {}
        for imm, conn in zip(imms, conns):
            by_conn.setdefault(conn, []).append(imm)
        assert len(by_conn) == writers
        for got in by_conn.values():
            first = got[0] - got[0] % 10000
            assert got == list(range(first, first + count))  # in order per writer
            n = first // 10000
            for i in (0, count - 1):
                at = n * share + i * size
                assert np.array_equal(arr[at : at + size], pattern(first + i, size))
        del arr


def test_out_of_range_refused(rail, options):
    with get_rail(rail).listen(options) as rx:
        ring = rx.register(1 << 16)
        arr = ring.array()
        arr[:] = 0
        with get_rail(rail).connect(rx.material, options) as wr:
            grant = ring.key.slice(4096, 4096)
            for offset, data in ((4090, b"x" * 10), (-1, b"x"), (0, b"x" * 4097)):
                with pytest.raises(RangeError):
                    wr.write(grant, data, offset, imm=9)
            with pytest.raises(RangeError):
                wr.write_many(grant, [(b"ok", 0, 1), (b"x" * 10, 4090, 2)])  # checked before any byte
            forged = RegionKey(rail, ring.key.node, ring.key.handle, (1 << 16) - 8, 4096)
            refused = False
            try:
                wr.write(forged, b"y" * 64, 0, imm=3)
            except RangeError:
                refused = True
            if not refused:  # the receiver must drop the connection instead
                _expect_lost(rx, BOUND)
            assert len(rx.poll(0.3)) == 0
        assert int(arr.max()) == 0  # not one byte landed
        del arr


def test_bad_token_refused(rail, options):
    with get_rail(rail).listen(options) as rx:
        wrong = RailOptions(token=b"another-token-0123456789", io_timeout=IO_TIMEOUT)
        with pytest.raises(AuthError):
            get_rail(rail).connect(rx.material, wrong)
        rx.poll(0.2)
        assert rx.connections == frozenset()
    # Without a cluster token the secret in the material is the credential: tampering fails too.
    open_options = RailOptions(io_timeout=IO_TIMEOUT)
    with get_rail(rail).listen(open_options) as rx:
        material = rx.material.replace(b'"secret": "', b'"secret": "00')[:-4] + rx.material[-2:]
        with pytest.raises((AuthError, TransportError)):
            get_rail(rail).connect(material, open_options)


def test_writer_death_detected(rail, options, spawn, caplog):
    with get_rail(rail).listen(options) as rx:
        ring = rx.register(1 << 20)
        queue = spawn.ctx.Queue()
        proc = spawn(stream_forever, rail, rx.material, ring.key.to_bytes(), options, 4096, queue)
        conn = queue.get(timeout=20)[1]
        assert len(_poll_until(rx, 10)[0]) >= 10
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(PeerLostError) as err:
            while time.monotonic() - t0 < BOUND:
                rx.poll(0.1)
        assert time.monotonic() - t0 < BOUND
        assert err.value.conn == conn
        # What was logged about it holds no error object: the raised one (with its traceback, the
        # caller's frames and the batches they hold) must not outlive its handling in a log record.
        assert not any(isinstance(arg, BaseException) for r in caplog.records for arg in (r.args or ()))


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_receiver_death_or_hang_detected(rail, options, spawn, fault):
    queue = spawn.ctx.Queue()
    proc = spawn(serve_ring, rail, options, 1 << 22, queue, True)
    material, key_blob, _pid = queue.get(timeout=20)
    key = RegionKey.from_bytes(key_blob)
    with get_rail(rail).connect(material, options) as wr:
        src = np.ones(65536, np.uint8)
        wr.write(key, src, 0, imm=1)
        os.kill(proc.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(PeerLostError):
            i = 0
            while time.monotonic() - t0 < BOUND + 5:
                wr.write_many(key, [(src, (j % 64) * 65536, i + j) for j in range(16)])
                i += 16
        assert time.monotonic() - t0 < BOUND + 2  # the writer never hangs past the bound
    if fault == "hang":
        os.kill(proc.pid, signal.SIGKILL)


def test_messages_both_ways_beside_bulk(rail, options):
    with get_rail(rail).listen(options) as rx:
        ring = rx.register(32 << 20)
        with get_rail(rail).connect(rx.material, options) as wr:
            big = np.zeros(8 << 20, np.uint8)
            wr.write_many(ring.key, [(big, 0, 1), (big, 8 << 20, 2), (big, 16 << 20, 3)])
            wr.send(b"credit please")
            got, imms = [], []
            deadline = time.monotonic() + 10
            while not got and time.monotonic() < deadline:
                imms += rx.poll(0.1).imm.tolist()
                got = rx.messages()
            assert got == [(wr.conn, b"credit please")]
            rx.send(wr.conn, b"grant 1")
            assert wr.recv(5.0) == b"grant 1"
            assert wr.recv(0) is None
            imms += _poll_until(rx, 3 - len(imms))[0]
            assert imms == [1, 2, 3]


def test_close_leaves_nothing(rail, options):
    shm_before = _shm_entries()
    fds_before = set(os.listdir("/proc/self/fd"))
    children_before = _children(os.getpid())  # e.g. multiprocessing's resource tracker
    rx = get_rail(rail).listen(options)
    ring = rx.register(1 << 20)
    wr = get_rail(rail).connect(rx.material, options)
    wr.write(ring.key, b"x" * 100, 0, imm=5)
    assert _poll_until(rx, 1)[0] == [5]
    wr.close()
    rx.close()
    deadline = time.monotonic() + 5
    while _children(os.getpid()) - children_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _children(os.getpid()) - children_before == set()
    assert set(os.listdir("/proc/self/fd")) <= fds_before
    assert _shm_entries() <= shm_before


def test_sigkill_both_ends_leaves_nothing(rail, options, spawn):
    shm_before = _shm_entries()
    queue = spawn.ctx.Queue()
    rx_proc = spawn(serve_ring, rail, options, 1 << 22, queue, True)
    material, key_blob, _ = queue.get(timeout=20)
    helpers = _children(rx_proc.pid)
    wq = spawn.ctx.Queue()
    wr_proc = spawn(stream_forever, rail, material, key_blob, options, 65536, wq)
    assert wq.get(timeout=20)[0] == "conn"
    time.sleep(0.3)  # mid-stream
    os.kill(wr_proc.pid, signal.SIGKILL)
    os.kill(rx_proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + BOUND
    while any(_alive(pid) for pid in helpers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in helpers)
    assert _shm_entries() <= shm_before


NETNS = "kspeed-conf"


def _netns_available() -> str | None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "needs root and iproute2 to build a network namespace"
    probe = subprocess.run(["ip", "netns", "add", NETNS + "-probe"], capture_output=True)
    if probe.returncode != 0:
        return f"ip netns add failed: {probe.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", NETNS + "-probe"], capture_output=True)
    return None


_CUT_WRITER = """
import sys, time, numpy as np
from kspeed.rdma.rails import get_rail
from kspeed.rdma.options import RailOptions
from kspeed.rdma.base import RegionKey
from kspeed.errors import PeerLostError
opts = RailOptions(token=b"conformance-token-0123456789", io_timeout=1.0, keepalive_idle=1.0,
                   keepalive_interval=1.0, keepalive_count=2)
wr = get_rail("tcp").connect(sys.argv[1].encode(), opts)
key = RegionKey.from_bytes(sys.argv[2].encode())
src = np.ones(65536, np.uint8)
print("connected", flush=True)
sys.stdin.readline()
t0 = time.monotonic()
try:
    i = 0
    while time.monotonic() - t0 < 30:
        wr.write(key, src, (i % 16) * 65536, i); i += 1
except PeerLostError as exc:
    print("lost %.2f" % (time.monotonic() - t0), flush=True)
"""


def test_link_cut_detected(rail, options):
    if rail != "tcp":
        pytest.skip(f"rail {rail} has no network link to cut")
    reason = _netns_available()
    if reason:
        pytest.skip(reason)
    run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True)  # noqa: E731
    subprocess.run(["ip", "link", "del", "kspc0"], capture_output=True)
    subprocess.run(["ip", "netns", "del", NETNS], capture_output=True)
    run("ip", "netns", "add", NETNS)
    writer = None
    try:
        run("ip", "link", "add", "kspc0", "type", "veth", "peer", "name", "kspc1")
        run("ip", "link", "set", "kspc1", "netns", NETNS)
        run("ip", "addr", "add", "10.231.7.1/24", "dev", "kspc0")
        run("ip", "link", "set", "kspc0", "up")
        run("ip", "netns", "exec", NETNS, "ip", "addr", "add", "10.231.7.2/24", "dev", "kspc1")
        run("ip", "netns", "exec", NETNS, "ip", "link", "set", "kspc1", "up")
        run("ip", "netns", "exec", NETNS, "ip", "link", "set", "lo", "up")
        opts = RailOptions(
            token=options.token,
            io_timeout=1.0,
            bind_host="10.231.7.1",
            keepalive_idle=1.0,
            keepalive_interval=1.0,
            keepalive_count=2,
        )
        with get_rail("tcp").listen(opts) as rx:
            ring = rx.register(1 << 20)
            writer = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    NETNS,
                    sys.executable,
                    "-c",
                    _CUT_WRITER,
                    rx.material.decode(),
                    ring.key.to_bytes().decode(),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=os.getcwd(),
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            )
            assert writer.stdout.readline().strip() == "connected"
            run("ip", "link", "set", "kspc0", "down")
            writer.stdin.write("go\n")
            writer.stdin.flush()
            elapsed = _expect_lost(rx, BOUND + 6)
            assert elapsed < BOUND + 6
            line = writer.stdout.readline().strip()
            assert line.startswith("lost"), line
            assert float(line.split()[1]) < BOUND
    finally:
        if writer is not None:
            writer.kill()
            writer.wait()
        subprocess.run(["ip", "link", "del", "kspc0"], capture_output=True)
        subprocess.run(["ip", "netns", "del", NETNS], capture_output=True)


def test_interrupt_wakes_a_blocked_writer_and_releases_nothing(rail, options):
    with get_rail(rail).listen(options) as rx:
        ring = rx.register(1 << 16)
        wr = get_rail(rail).connect(rx.material, options)
        try:
            wr.write(ring.key, b"before", 0, imm=1)
            assert _poll_until(rx, 1)[0] == [1]
            outcome: list[BaseException | None] = []

            def wait_for_message() -> None:
                try:
                    wr.recv(timeout=None)  # the receiver never sends: blocked until interrupted
                    outcome.append(None)
                except BaseException as exc:
                    outcome.append(exc)

            waiter = threading.Thread(target=wait_for_message)
            waiter.start()
            time.sleep(0.2)
            assert waiter.is_alive()
            t0 = time.monotonic()
            wr.interrupt()
            wr.interrupt()  # idempotent
            waiter.join(timeout=IO_TIMEOUT + 2)
            assert not waiter.is_alive() and time.monotonic() - t0 < IO_TIMEOUT + 2
            assert len(outcome) == 1 and isinstance(outcome[0], PeerLostError), outcome
            with pytest.raises(PeerLostError):  # interrupted: every later I/O fails the same way
                wr.write(ring.key, b"after", 0, imm=2)
                wr.send(b"x")
            with contextlib.suppress(PeerLostError):  # the receiver may see the writer gone
                assert 2 not in rx.poll(0.2).imm.tolist()  # a failed write is never completed
        finally:
            wr.close()  # nothing was released under the interrupted thread; closing still works


def test_both_ends_sending_at_once_never_deadlock(rail, options):
    # Completions flood one way while messages flood the other, and neither side reads until it has
    # sent everything: with plain blocking sends both socket buffers fill and each waits forever.
    count, messages = 30_000, 20_000
    with get_rail(rail).listen(options) as rx:
        ring = rx.register(1 << 16)
        with get_rail(rail).connect(rx.material, options) as wr:
            failures: list[BaseException] = []
            got: list[bytes | None] = []
            # As a feed does, the writer speaks first (HELLO): the receiver knows it before sending
            # to it (a send racing the connection's set-up is refused as "no such writer").
            wr.send(b"hello")
            deadline = time.monotonic() + 10
            while not any(m == b"hello" for _, m in rx.messages()):
                assert time.monotonic() < deadline, "the writer's first message never came"
                rx.poll(0.01)

            def serve() -> None:  # as a server's feed thread: write everything, then read
                try:
                    for i in range(count):
                        wr.write(ring.key, b"", 0, imm=i + 1)
                    got.extend(wr.recv(10.0) for _ in range(messages))
                except BaseException as exc:
                    failures.append(exc)

            writer = threading.Thread(target=serve)
            writer.start()
            for i in range(messages):
                rx.send(wr.conn, i.to_bytes(4, "little") + bytes(1020))
            imms = _poll_until(rx, count, 30)[0]  # the receiver reads once it has sent everything
            writer.join(timeout=30)
            assert not writer.is_alive() and failures == []
            assert sorted(imms) == list(range(1, count + 1))  # every completion, once
            assert [int.from_bytes(m[:4], "little") for m in got if m] == list(range(messages))


@pytest.mark.skipif("tcp" not in available_rails(), reason="the tcp rail is unavailable here")
def test_dripping_dialers_neither_grow_the_tcp_receivers_threads_nor_keep_a_writer_out():
    # One byte of a hello every 0.2 s renewed a per-read timeout forever: 32 such dialers held
    # every handshake slot. Each handshake now has connect_timeout in all, and at the cap the
    # oldest makes room for the newcomer.
    options = RailOptions(io_timeout=5.0, connect_timeout=1.0)
    with get_rail("tcp").listen(options) as rx:
        ring = rx.register(1 << 16)
        (pid,) = rx.helper_pids
        material = json.loads(rx.material)
        before = len(os.listdir(f"/proc/{pid}/task"))
        stop = threading.Event()
        hello = tcp_wire.HELLO.pack(tcp_wire.MAGIC, tcp_wire.BULK, material["consumer"], 0) + bytes(32)
        reports = []
        attack = threading.Thread(
            target=lambda: reports.append(
                drip_handshakes(
                    ("127.0.0.1", material["port"]), 40, payload=hello, interval=0.2, duration=30, stop=stop
                )
            )
        )
        attack.start()
        try:
            peak = 0
            deadline = time.monotonic() + 3 * options.connect_timeout
            while time.monotonic() < deadline:  # the attack's connections come and go: watch the threads
                peak = max(peak, len(os.listdir(f"/proc/{pid}/task")))
                time.sleep(0.05)
            with get_rail("tcp").connect(rx.material, options) as writer:  # while the drip goes on
                writer.write(RegionKey.from_bytes(ring.key.to_bytes()), b"during the drip", 0, imm=7)
                assert _poll_until(rx, 1)[0] == [7]
                assert ring.array()[:15].tobytes() == b"during the drip"
        finally:
            stop.set()
            attack.join(timeout=10)
        (report,) = reports
        assert peak <= before + MAX_HANDSHAKES + 1  # (+1: the gate's deadline thread)
        assert report.closed_by_target >= 40 and report.refused == 0, report
        assert report.longest_held < options.connect_timeout + 1.5, report  # whole handshakes, not per read


def test_a_stalled_shm_dialer_keeps_no_writer_waiting():
    # The shm receiver authenticated its dialers one after another, each read given the whole
    # connect_timeout: one dialer dripping its hello held every writer out.
    options = RailOptions(io_timeout=5.0, connect_timeout=1.0)
    with get_rail("shm").listen(options) as rx:
        ring = rx.register(1 << 16)
        stop, started = threading.Event(), threading.Event()
        reports = []
        name = "\0" + json.loads(rx.material)["socket"]
        hello = shm_writer.HELLO + bytes(32)
        attack = threading.Thread(
            target=lambda: reports.append(
                drip_handshakes(name, 12, payload=hello, interval=0.2, duration=30, stop=stop, started=started)
            )
        )
        attack.start()
        try:
            assert started.wait(10)  # the dialers are in their handshakes (a writer that came first would pass anyway)
            with get_rail("shm").connect(rx.material, options) as writer:
                writer.write(RegionKey.from_bytes(ring.key.to_bytes()), b"during the drip", 0, imm=9)
                assert _poll_until(rx, 1)[0] == [9]
                assert ring.array()[:15].tobytes() == b"during the drip"
            wait = time.monotonic() + 3 * options.connect_timeout
            while time.monotonic() < wait:
                rx.poll(0.05)
        finally:
            stop.set()
            attack.join(timeout=10)
        (report,) = reports
        assert report.closed_by_target >= 12 and report.refused == 0, report
        assert report.longest_held < options.connect_timeout + 1.5, report  # whole handshakes, not per read
