"""A network lab of Linux namespaces: hosts joined by one switch, with shaped links (needs root).

::

    with NetLab(["mgr", "s0", "s1", "c0"]) as lab:
        lab.limit_rate("c0", "300mbit")            # the switch port towards c0: 300 Mbit/s, shallow queue
        lab.add_delay("s1", "10ms")                # everything s1 sends is 10 ms late
        lab.run("c0", "ping", "-c1", lab.address("s0"))
        proc = subprocess.Popen([*lab.prefix("c0"), sys.executable, "-c", "..."])

The **switch** is a namespace holding one Linux bridge; every host is a namespace joined to it by a
veth pair (``eth0`` inside the host, ``p-<host>`` on the switch), with an address on a private /24
(``10.231.9.0/24`` by default; each lab is its own layer-2 segment, so concurrent labs may use the
same subnet) and ``lo`` up. Namespace names carry the process id and a random tag so concurrent
runs never collide. Nothing is added to the root namespace: every packet stays inside the lab.

Shaping happens where a real switch would queue: :meth:`NetLab.limit_rate` puts a token bucket on
the switch port's egress, which is the direction data flows *towards* that host, with a burst of
about a millisecond at the rate and a shallow queue (see :data:`PORT_BUFFER`); packets beyond the
queue are dropped, as at a shallow-buffered switch port. :meth:`NetLab.add_delay` delays what a
host *sends*: with netem on its own ``eth0``, or, on kernels built without netem, through a delay
line (its egress redirected to a tap, and a small process passing the frames on to a tap on the
bridge after the delay).

Teardown (:meth:`NetLab.close`, also on errors while building) kills whatever still runs in the
lab's namespaces and deletes them, which deletes their veths and the bridge.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import fcntl
import os
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence

__all__ = ["PORT_BUFFER", "LabError", "NetLab", "delay_line", "netlab_unavailable", "parse_rate", "parse_time"]

#: Default queue of a shaped switch port, in bytes: 128 KiB, about the per-port share of a
#: shallow-buffered top-of-rack switch (9-12 MB shared by 64-96 ports); 3.5 ms at 300 Mbit/s.
PORT_BUFFER = 128 * 1024
#: The token bucket's burst covers this long at the rate (at least :data:`MIN_BURST`): a port sends
#: at most about a millisecond of data back to back above the shaped rate.
BURST_TIME = 1e-3
MIN_BURST = 16 * 1024
#: netem's queue, in packets: large enough that a delayed link never drops by itself.
NETEM_LIMIT = 100_000
#: The tap a delayed host's egress is redirected to when the kernel has no netem.
DELAY_TAP = "dly0"

_UNITS = {"": 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


class LabError(RuntimeError):
    """A command building or shaping the lab failed (the message holds the command and its stderr)."""


_SECONDS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}


def _quantity(raw: str | float, units: dict[str, float], what: str, example: str) -> float:
    """A number, or a number with one of ``units`` as tc writes it, scaled to the base unit."""
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return float(raw)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(raw))
    if not match or match.group(2).lower() not in units:
        raise ValueError(f"not a {what}: {raw!r} (e.g. {example})")
    return float(match.group(1)) * units[match.group(2).lower()]


def parse_rate(rate: str | float) -> int:
    """Bits per second of a rate given as a number (bit/s) or as tc writes it (``"300mbit"``).

    Raises:
        ValueError: not a positive rate.
    """
    value = _quantity(rate, _UNITS, "rate", "300mbit, 1gbit, or bits per second")
    if value <= 0:
        raise ValueError(f"rate must be positive, got {rate!r}")
    return int(value)


def parse_time(value: str | float) -> float:
    """Seconds of a duration given as a number of seconds or as tc writes it (``"10ms"``, ``"500us"``).

    Raises:
        ValueError: not a duration, or negative.
    """
    seconds = _quantity(value, _SECONDS, "duration", "10ms, 500us, or seconds")
    if seconds < 0:
        raise ValueError(f"duration must not be negative, got {value!r}")
    return seconds


def netlab_unavailable() -> str | None:
    """Why a lab cannot be built here (the reason a test skips with), or ``None`` when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    probe = f"ksl-probe-{os.getpid()}-{uuid.uuid4().hex[:4]}"
    out = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if out.returncode != 0:
        return f"ip netns add failed: {out.stderr.strip()}"
    try:
        veth = subprocess.run(
            ["ip", "-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"],
            capture_output=True,
            text=True,
        )
        if veth.returncode != 0:
            return f"cannot create a veth pair: {veth.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class NetLab:
    """Host namespaces joined by a bridge in a switch namespace; a context manager.

    Args:
        hosts: host names (letters, digits, ``-``; at most 10 characters); each becomes a namespace
            with address ``<subnet>.<10 + i>``.
        subnet: the first three octets of the lab's /24.
        tcp_congestion: the TCP congestion control every host uses (e.g. ``"cubic"``); ``None``
            keeps what a new namespace gets from the kernel.

    Raises:
        ValueError: bad or duplicate host names.
        LabError: (on entry) a command building the lab failed; what was built is removed.
    """

    def __init__(self, hosts: Sequence[str], *, subnet: str = "10.231.9", tcp_congestion: str | None = None) -> None:
        names = list(hosts)
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"host names must be distinct and at least one: {names}")
        for name in names:
            if not re.fullmatch(r"[A-Za-z0-9-]{1,10}", name):
                raise ValueError(f"host name {name!r}: 1-10 letters, digits or '-'")
        if len(names) > 200:
            raise ValueError("at most 200 hosts in one /24")
        self.hosts = names
        self.subnet = subnet
        self.tcp_congestion = tcp_congestion
        self.tag = f"{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.switch = f"ksl-{self.tag}-sw"
        self._rates: dict[str, tuple[int, int, int]] = {}
        self._delays: dict[str, subprocess.Popen | None] = {}
        self._made: list[str] = []
        self._built = False

    # -- names and addresses ---------------------------------------------------------------------

    def netns(self, host: str) -> str:
        """The namespace of ``host``."""
        self._check(host)
        return f"ksl-{self.tag}-{host}"

    def address(self, host: str) -> str:
        """The IPv4 address of ``host``."""
        self._check(host)
        return f"{self.subnet}.{10 + self.hosts.index(host)}"

    def mac(self, host: str) -> str:
        """The (locally administered) MAC address of ``host``'s ``eth0``."""
        self._check(host)
        return f"02:6b:73:00:00:{10 + self.hosts.index(host):02x}"

    def prefix(self, host: str) -> list[str]:
        """The command prefix that runs a program in ``host`` (it execs the program: same pid)."""
        return ["ip", "netns", "exec", self.netns(host)]

    def port(self, host: str) -> str:
        """The switch-side interface of ``host``'s link (in the switch namespace)."""
        self._check(host)
        return f"p-{host}"

    def _check(self, host: str) -> None:
        if host not in self.hosts:
            raise KeyError(f"no host {host!r} in the lab (hosts: {', '.join(self.hosts)})")

    # -- building and teardown -------------------------------------------------------------------

    def __enter__(self) -> NetLab:
        self.build()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def build(self) -> None:
        """Create the switch, the hosts and their links.

        Raises:
            LabError: a command failed; everything made so far is removed.
        """
        if self._built:
            return
        self._built = True
        try:
            self._add_netns(self.switch)
            self._ip(self.switch, "link", "set", "lo", "up")
            self._ip(self.switch, "link", "add", "br0", "type", "bridge", "forward_delay", "0", "stp_state", "0")
            self._ip(self.switch, "link", "set", "br0", "up")
            for host in self.hosts:
                ns = self.netns(host)
                self._add_netns(ns)
                self._ip(ns, "link", "set", "lo", "up")
                _run(
                    "ip",
                    "link",
                    "add",
                    self.port(host),
                    "netns",
                    self.switch,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "address",
                    self.mac(host),
                    "netns",
                    ns,
                )
                self._ip(self.switch, "link", "set", self.port(host), "master", "br0", "up")
                self._ip(ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
                self._ip(ns, "link", "set", "eth0", "up")
                if self.tcp_congestion:
                    self.run(host, "sysctl", "-qw", f"net.ipv4.tcp_congestion_control={self.tcp_congestion}")
            # Permanent neighbours: a shaped port that drops heavily also drops ARP, and a neighbour
            # entry that fails to refresh cuts every connection to that host for good.
            for host in self.hosts:
                for peer in self.hosts:
                    if peer != host:
                        self._ip(
                            self.netns(host),
                            "neigh",
                            "replace",
                            self.address(peer),
                            "lladdr",
                            self.mac(peer),
                            "dev",
                            "eth0",
                            "nud",
                            "permanent",
                        )
        except BaseException:
            self.close()
            raise

    def _add_netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)

    def close(self) -> None:
        """Kill every process left in the lab's namespaces and delete them (idempotent, never raises)."""
        for proc in self._delays.values():
            if proc is not None:
                _stop(proc)
        self._delays.clear()
        for ns in reversed(self._made):
            self._kill_all(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
        self._rates.clear()

    @staticmethod
    def _kill_all(ns: str) -> None:
        """SIGKILL the processes in ``ns`` and wait (up to 5 s) until none is left."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            pids = [int(p) for p in out.stdout.split() if p.isdigit()]
            if out.returncode != 0 or not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    def pids(self, host: str) -> list[int]:
        """Processes running in ``host``'s namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.netns(host)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split() if p.isdigit()]

    # -- running things --------------------------------------------------------------------------

    def run(self, host: str, *cmd: str, check: bool = True, timeout: float | None = 60) -> subprocess.CompletedProcess:
        """Run ``cmd`` in ``host`` and return its completed process (text output captured).

        Raises:
            LabError: ``check`` and the command failed.
        """
        return _run(*self.prefix(host), *cmd, check=check, timeout=timeout)

    def _ip(self, ns: str, *args: str) -> None:
        _run("ip", "-n", ns, *args)

    def _tc(self, ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run("ip", "netns", "exec", ns, "tc", *args, check=check)

    # -- shaping ---------------------------------------------------------------------------------

    def limit_rate(self, host: str, rate: str | float, *, burst: int | None = None, limit: int = PORT_BUFFER) -> None:
        """Shape the link towards ``host`` (the switch port's egress) with a token bucket.

        Args:
            host: the receiving host.
            rate: bits per second, or a tc rate such as ``"300mbit"``.
            burst: bucket size in bytes (default: :data:`BURST_TIME` at the rate, at least :data:`MIN_BURST`).
            limit: bytes that may wait in the port's queue; more are dropped (default :data:`PORT_BUFFER`).
        """
        bits = parse_rate(rate)
        burst = burst if burst is not None else _burst(bits)
        self._tc(
            self.switch,
            "qdisc",
            "replace",
            "dev",
            self.port(host),
            "root",
            "tbf",
            "rate",
            f"{bits}bit",
            "burst",
            str(burst),
            "limit",
            str(limit),
        )
        self._rates[host] = (bits, burst, limit)

    def change_rate(self, host: str, rate: str | float) -> None:
        """Change the shaped rate towards ``host`` (a new token bucket), keeping its queue limit.

        The burst follows the new rate unless :meth:`limit_rate` was given one explicitly.

        Raises:
            KeyError: the link towards ``host`` is not shaped.
        """
        if host not in self._rates:
            raise KeyError(f"the link towards {host!r} is not shaped; call limit_rate first")
        old_bits, burst, limit = self._rates[host]
        bits = parse_rate(rate)
        if burst == _burst(old_bits):
            burst = _burst(bits)
        # A new qdisc, not ``tc qdisc change`` (nor ``replace``, which changes a tbf in place): tbf splits
        # an oversized GSO packet only when it is queued, so a packet queued under the old, larger
        # burst that exceeds the new one can never be sent, and the port stops for good.
        self._tc(self.switch, "qdisc", "del", "dev", self.port(host), "root")
        self._tc(
            self.switch,
            "qdisc",
            "add",
            "dev",
            self.port(host),
            "root",
            "tbf",
            "rate",
            f"{bits}bit",
            "burst",
            str(burst),
            "limit",
            str(limit),
        )
        self._rates[host] = (bits, burst, limit)

    def add_delay(self, host: str, delay: str | float) -> str:
        """Delay everything ``host`` sends by ``delay``; returns how (``"netem"`` or ``"delay-line"``).

        With netem in the kernel this is a netem qdisc on the host's ``eth0`` (queue of
        :data:`NETEM_LIMIT` packets, so it never drops). Kernels built without netem get a delay
        line instead: the host's egress is redirected (``tc`` clsact + ``mirred``) to a tap device
        whose frames a small process (:func:`delay_line`) hands, ``delay`` later, to a second tap on
        the bridge. It keeps the kernel's large offload frames, so it carries Gbit/s; on a busy
        machine its timing may slip by a fraction of a millisecond, and it adds about 0.3 ms.
        Traffic towards the host is not delayed.

        Args:
            host: the sending host.
            delay: seconds, or a tc time such as ``"10ms"`` or ``"500us"``.

        Raises:
            LabError: the delay cannot be set up.
        """
        seconds = parse_time(delay)
        if host in self._delays:
            raise LabError(f"{host} is already delayed; clear() it first")
        done = self._tc(
            self.netns(host),
            "qdisc",
            "replace",
            "dev",
            "eth0",
            "root",
            "netem",
            "delay",
            f"{seconds * 1e6:.0f}us",
            "limit",
            str(NETEM_LIMIT),
            check=False,
        )
        if done.returncode == 0:
            self._delays[host] = None
            return "netem"
        if "unknown" not in done.stderr.lower():
            raise LabError(f"netem on {host}: {done.stderr.strip()}")
        self._delays[host] = self._start_delay_line(host, seconds)
        return "delay-line"

    def delay_method(self, host: str) -> str | None:
        """How ``host``'s egress is delayed (``"netem"``, ``"delay-line"``), or ``None`` when it is not."""
        if host not in self._delays:
            return None
        return "netem" if self._delays[host] is None else "delay-line"

    def _start_delay_line(self, host: str, seconds: float) -> subprocess.Popen:
        ns, tap, out = self.netns(host), DELAY_TAP, f"d-{host}"
        mac = _run("ip", "netns", "exec", ns, "cat", "/sys/class/net/eth0/address").stdout.strip()
        self._ip(ns, "tuntap", "add", "dev", tap, "mode", "tap", "vnet_hdr")
        self._ip(ns, "link", "set", tap, "up")
        self._ip(self.switch, "tuntap", "add", "dev", out, "mode", "tap", "vnet_hdr")
        self._ip(self.switch, "link", "set", out, "master", "br0", "up")
        # Frames from the host now enter the bridge on the tap: keep the bridge sending frames for
        # the host down its veth, and drop whatever the bridge floods to the tap.
        _run("ip", "netns", "exec", self.switch, "bridge", "link", "set", "dev", out, "learning", "off")
        _run(
            "ip",
            "netns",
            "exec",
            self.switch,
            "bridge",
            "fdb",
            "replace",
            mac,
            "dev",
            self.port(host),
            "master",
            "static",
        )
        proc = subprocess.Popen(
            [
                *self.prefix(host),
                sys.executable,
                os.path.abspath(__file__),
                "delay-line",
                tap,
                self.switch,
                out,
                repr(seconds),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        line = proc.stdout.readline().strip()
        if line != "ready":
            proc.kill()
            raise LabError(f"delay line for {host} did not start: {line} {proc.communicate()[1].strip()}")
        self._tc(ns, "qdisc", "replace", "dev", "eth0", "clsact")
        self._tc(
            ns,
            "filter",
            "add",
            "dev",
            "eth0",
            "egress",
            "protocol",
            "all",
            "u32",
            "match",
            "u32",
            "0",
            "0",
            "action",
            "mirred",
            "egress",
            "redirect",
            "dev",
            tap,
        )
        return proc

    def clear(self, host: str) -> None:
        """Remove the shaping and delay of ``host``'s link in both directions."""
        ns = self.netns(host)
        self._tc(self.switch, "qdisc", "del", "dev", self.port(host), "root", check=False)
        self._rates.pop(host, None)
        if host not in self._delays:
            return
        proc = self._delays.pop(host)
        if proc is None:
            self._tc(ns, "qdisc", "del", "dev", "eth0", "root", check=False)
            return
        self._tc(ns, "qdisc", "del", "dev", "eth0", "clsact", check=False)
        _stop(proc)
        mac = _run("ip", "netns", "exec", ns, "cat", "/sys/class/net/eth0/address", check=False).stdout.strip()
        _run(
            "ip",
            "netns",
            "exec",
            self.switch,
            "bridge",
            "fdb",
            "del",
            mac,
            "dev",
            self.port(host),
            "master",
            check=False,
        )
        _run("ip", "-n", ns, "link", "del", DELAY_TAP, check=False)
        _run("ip", "-n", self.switch, "link", "del", f"d-{host}", check=False)

    # -- what happened ---------------------------------------------------------------------------

    def port_stats(self, host: str) -> dict[str, int]:
        """Counters of the switch port towards ``host``: the qdisc's sent bytes/packets, drops,
        overlimits and requeues (``tc -s qdisc``), and the interface's tx packets and drops."""
        text = self._tc(self.switch, "-s", "qdisc", "show", "dev", self.port(host)).stdout
        out = {
            "qdisc_sent_bytes": 0,
            "qdisc_sent_packets": 0,
            "qdisc_dropped": 0,
            "qdisc_overlimits": 0,
            "qdisc_requeues": 0,
        }
        for match in re.finditer(
            r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+) requeues (\d+)\)", text
        ):
            for key, value in zip(
                ("qdisc_sent_bytes", "qdisc_sent_packets", "qdisc_dropped", "qdisc_overlimits", "qdisc_requeues"),
                match.groups(),
            ):
                out[key] += int(value)
        out.update(self._link_counters(self.switch, self.port(host)))
        return out

    @staticmethod
    def _link_counters(ns: str, dev: str) -> dict[str, int]:
        base = f"/sys/class/net/{dev}/statistics"
        out = {}
        for name in ("tx_packets", "tx_dropped", "rx_packets", "rx_dropped"):
            done = _run("ip", "netns", "exec", ns, "cat", f"{base}/{name}", check=False)
            out[name] = int(done.stdout.strip() or 0) if done.returncode == 0 else 0
        return out

    def tcp_counters(self, host: str) -> dict[str, int]:
        """The TCP counters of ``host``'s namespace since it was made (``nstat -az``): retransmits,
        timeouts, lost and out-of-order segments and the like; empty when nstat is missing."""
        if shutil.which("nstat") is None:
            return {}
        # -s: do not update nstat's history, so every call counts from the namespace's start.
        done = self.run(host, "nstat", "-azs", check=False)
        out = {}
        for line in done.stdout.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit() and parts[0].startswith(("Tcp", "TcpExt")):
                out[parts[0]] = int(parts[1])
        return out


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=5)


def _burst(bits: int) -> int:
    return max(MIN_BURST, int(bits / 8 * BURST_TIME))


def _run(*cmd: str, check: bool = True, timeout: float | None = 60) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise LabError(f"{' '.join(cmd)} exited with status {done.returncode}: {done.stderr.strip()}")
    return done


# -- the delay line (run as ``python tests/netlab.py delay-line ...`` inside the delayed host) -------

_TUNSETIFF = 0x400454CA
_TUNSETOFFLOAD = 0x400454D0
_IFF_TAP, _IFF_NO_PI, _IFF_VNET_HDR = 0x0002, 0x1000, 0x4000
_TUN_OFFLOADS = 0x1 | 0x2 | 0x4 | 0x8  # TUN_F_CSUM, TSO4, TSO6, TSO_ECN: large frames pass whole
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_FRAME = 65536 + 1024  # an offload frame, its virtio-net header and Ethernet header


def _open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI | _IFF_VNET_HDR))
    fcntl.ioctl(fd, _TUNSETOFFLOAD, _TUN_OFFLOADS)
    return fd


def delay_line(tap_in: str, switch_netns: str, tap_out: str, delay: float) -> None:
    """Forward every frame read from ``tap_in`` (in this namespace) to ``tap_out`` (in
    ``switch_netns``) ``delay`` seconds later, in order, until killed; frames arriving on
    ``tap_out`` are dropped. Prints ``ready`` once both taps are open. Dies with its parent."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    src = _open_tap(tap_in)
    ns = os.open(f"/run/netns/{switch_netns}", os.O_RDONLY)
    if libc.setns(ns, _CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), f"setns {switch_netns}")
    os.close(ns)
    dst = _open_tap(tap_out)
    print("ready", flush=True)
    queue: collections.deque[tuple[float, bytes]] = collections.deque()
    while True:
        timeout = min(max(queue[0][0] - time.monotonic(), 0.0), 1.0) if queue else 1.0
        readable, _, _ = select.select([src, dst], [], [], timeout)
        now = time.monotonic()
        if src in readable:
            with contextlib.suppress(BlockingIOError):
                while True:
                    queue.append((now + delay, os.read(src, _FRAME)))
        if dst in readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(dst, _FRAME):
                    pass
        while queue and queue[0][0] <= now:
            try:
                os.write(dst, queue[0][1])
            except BlockingIOError:
                break
            except OSError:
                pass  # a frame the kernel refuses is dropped, as a wire would
            queue.popleft()


if __name__ == "__main__":
    if len(sys.argv) != 6 or sys.argv[1] != "delay-line":
        sys.exit("usage: netlab.py delay-line TAP_IN SWITCH_NETNS TAP_OUT DELAY_SECONDS")
    delay_line(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]))
