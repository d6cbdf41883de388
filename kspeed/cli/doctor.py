"""``kspeed doctor``: check a server's or a client's configuration against the cluster before it bites.

What operators get wrong, each checked the way the cluster will use it, each finding saying what to
change:

- **server**: the manager is reachable with this token and these TLS settings; the address the
  server will announce (chosen as the server chooses it, :mod:`kspeed.server.announce`) is one the
  manager can dial, and the manager does reach it (it
  dials the running server, or a stand-in that listens where the server will, with its TLS
  certificate); ``memory`` fits the file system of the pool (``/dev/shm``) and leaves room besides
  the production window; the state directory is writable; every backend allow-list entry names a
  tree that exists (and says where a symlink leads) or a protocol this host can open.
- **client**: the manager is reachable with this token and TLS; every server the manager lists
  answers from this host at the address it announces; a data-plane rail is shared with them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
from collections.abc import Iterator
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kspeed.cli.args import say, subcommand
from kspeed.config import ClientConfig, SecurityConfig, ServerConfig, add_arguments, load_config
from kspeed.control import rpc
from kspeed.control.lifecycle import SERVING, state_name
from kspeed.control.manager_client import ManagerClient
from kspeed.control.status import human_bytes
from kspeed.errors import AuthError, ConfigError, KSpeedError
from kspeed.proto import kspeed_pb2
from kspeed.rdma.rails import available_rails

PROBE_TIMEOUT = 5.0  # seconds for one reachability check
STATE_ROOM = 64 * 1024**2  # free bytes a state directory should keep (assignments, index files)


@dataclasses.dataclass
class Finding:
    """One check: what was looked at, whether it is fine, and what to change when it is not."""

    check: str
    ok: bool
    detail: str
    fix: str = ""


class Report:
    """The findings of one run, in order."""

    def __init__(self) -> None:
        self.findings: list[Finding] = []

    def ok(self, check: str, detail: str) -> None:
        self.findings.append(Finding(check, True, detail))

    def problem(self, check: str, detail: str, fix: str) -> None:
        self.findings.append(Finding(check, False, detail, fix))

    @property
    def problems(self) -> int:
        return sum(not f.ok for f in self.findings)


# -- what both sides check ---------------------------------------------------------------------------


def check_manager(report: Report, config: ClientConfig) -> kspeed_pb2.ClusterStatus | None:
    """The manager answers with this token and these TLS settings; returns the cluster's status."""
    where = f"manager {config.manager}"
    security = config.security
    try:
        with ManagerClient(config, peer_name="kspeed-doctor") as client:
            hello = client.handshake()
            status = client.status()
    except AuthError as exc:
        source = f"token_file {security.token_file}" if security.token_file else "KSPEED_TOKEN / token"
        report.problem(
            "token",
            f"{where} refused the token: {exc}",
            f"put the manager's token in {source} (the same on every daemon and client of the cluster)",
        )
        return None
    except KSpeedError as exc:
        host, _, port = config.manager.rpartition(":")
        tls = rpc.speaks_tls(host.strip("[]"), int(port)) if _listens(config.manager) else None
        if tls is None:
            report.problem(
                "manager",
                f"{where} cannot be reached: {exc}",
                "check `manager` (host:port of kspeed-manager's listen address) and that the manager runs",
            )
        elif tls and not security.tls_ca:
            report.problem(
                "tls",
                f"{where} speaks TLS and this configuration does not: {exc}",
                "set tls_ca (KSPEED_TLS_CA) to the CA bundle that signed the daemons' certificates",
            )
        elif not tls and security.tls_ca:
            report.problem(
                "tls",
                f"{where} does not speak TLS, and tls_ca is set: {exc}",
                "remove tls_ca, or give the manager tls_cert and tls_key",
            )
        else:
            report.problem("manager", f"{where}: {exc}", "see the manager's log for why it refused")
        return None
    report.ok("manager", f"{where} answers (cluster {hello.cluster_id}, version {hello.manager_version})")
    report.ok("token", "accepted" if security.auth == "token" else "auth is off (loopback-only clusters)")
    return status


def health_of(address: str, security: SecurityConfig, timeout: float = PROBE_TIMEOUT) -> str:
    """ "" when ``address`` reports SERVING on grpc.health.v1 from this host, else why not."""
    channel = rpc.open_channel(address, security)
    try:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        reply = check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.RpcError as exc:
        return f"{exc.code().name.lower()}: {exc.details()}"
    finally:
        channel.close()
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status).lower()
    return ""


# -- server ----------------------------------------------------------------------------------------


def _listens(address: str) -> bool:
    """Whether something accepts TCP connections at ``address`` from this host."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT):
            return True
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def standing_in(config: ServerConfig) -> Iterator[bool]:
    """Listen where the server will (its ``listen`` address and TLS certificate) with a health
    service that says SERVING, while the manager is asked to reach it; yields False when the address
    is taken (the server itself runs there: the manager then dials it)."""
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    try:
        rpc.bind(server, config.listen, config.security)
    except ConfigError:
        yield False
        return
    server.start()
    try:
        yield True
    finally:
        server.stop(None).wait()


def check_advertised(report: Report, config: ServerConfig, client: ManagerClient | None) -> None:
    """The address the server will announce (chosen as the server chooses it) is one the manager
    can dial, and the manager does reach it."""
    from kspeed.server.announce import ADVERTISE, announce

    announced = announce(config.listen, config.advertise, config.manager)
    address = announced.address
    if announced.doubt:
        report.problem(
            "advertise",
            f"the server would announce {address} ({announced.how}): {announced.doubt}",
            f"set {ADVERTISE} to host:port that the manager and the clients can dial",
        )
        return
    if client is None:
        return
    if address.endswith(":0"):
        report.ok("advertise", f"the server listens on any free port ({address}): nothing to check before it runs")
        return
    with standing_in(config) as stand_in:
        try:
            reply = client.call("ProbeAddress", kspeed_pb2.ProbeAddressRequest(address=address), timeout=30)
        except KSpeedError as exc:
            report.problem("advertise", f"the manager could not be asked to dial {address}: {exc}", "see above")
            return
    who = "a stand-in listening where the server will" if stand_in else "the server running there"
    if reply.serving:
        report.ok("advertise", f"the manager reaches {address}, {announced.how} ({who})")
        return
    fix = f"set {ADVERTISE} to an address the manager can dial, and open the port between them"
    if rpc.tls_mismatch(reply.detail, probe=False):
        fix = "give the server tls_cert/tls_key signed by the manager's tls_ca (or turn TLS off on both)"
    report.problem("advertise", f"the manager cannot reach {address}, {announced.how} ({who}): {reply.detail}", fix)


def check_memory(report: Report, config: ServerConfig) -> None:
    """``memory`` fits the pool's file system and leaves room besides the production window."""
    from kspeed.server.local_state import pool_dir, stored_id

    server_id = config.server_id or stored_id(config.state_dir)
    where = pool_dir(config, server_id or "<id>", config.state_dir)
    existing = os.path.dirname(where.rstrip("/")) if not os.path.isdir(where) else where
    while existing and not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    stats = os.statvfs(existing or "/")
    free = stats.f_bavail * stats.f_frsize
    held = _size_of(where)  # a pool already there is reused, not added
    if config.memory > free + held:
        report.problem(
            "memory",
            f"memory {human_bytes(config.memory)} does not fit {existing}: {human_bytes(free)} free there"
            + (f" besides this server's pool of {human_bytes(held)}" if held else ""),
            f"lower memory to at most {human_bytes(free + held)}, or enlarge {existing} (for /dev/shm: mount -o "
            "remount,size=...; in a container --shm-size, or an emptyDir with medium Memory on Kubernetes)",
        )
    else:
        report.ok("memory", f"{human_bytes(config.memory)} fits {existing} ({human_bytes(free)} free)")
    window = config.window_bytes()
    if window * 2 > config.memory:
        report.problem(
            "production_window",
            f"the production window takes {human_bytes(window)} of memory {human_bytes(config.memory)}",
            "lower production_window (default: an eighth of memory) or raise memory: datasets get what is left",
        )


def _size_of(directory: str) -> int:
    if not os.path.isdir(directory):
        return 0
    return sum(entry.stat().st_blocks * 512 for entry in os.scandir(directory) if entry.is_file())


def check_state_dir(report: Report, config: ServerConfig) -> None:
    """The state directory can be written and has room for the assignments and indexes."""
    from kspeed.control.daemon import ensure_state_dir

    try:
        path = ensure_state_dir(config.state_dir, "server.state_dir")
    except ConfigError as exc:
        report.problem("state_dir", str(exc), "create it for the server's user, or set state_dir elsewhere")
        return
    stats = os.statvfs(path)
    free = stats.f_bavail * stats.f_frsize
    if free < STATE_ROOM:
        report.problem(
            "state_dir",
            f"{path} has {human_bytes(free)} free",
            f"free at least {human_bytes(STATE_ROOM)} there: a server that cannot save what it holds refuses "
            "new shares",
        )
    else:
        report.ok("state_dir", f"{path} writable, {human_bytes(free)} free")


def check_allow_list(report: Report, config: ServerConfig) -> None:
    """Each backend allow-list entry names an existing tree, or a protocol this host can open."""
    from kspeed.server.backend.allowlist import LOCAL_PROTOCOLS, split_uri

    if not config.backend_allow:
        report.problem(
            "backend_allow",
            "no backend is allowed: every dataset will be refused",
            "set backend_allow (KSPEED_BACKEND_ALLOW) to the trees and buckets datasets come from, e.g. /data,s3://bucket",
        )
        return
    for entry in config.backend_allow:
        protocol, path = split_uri(entry)
        if protocol in LOCAL_PROTOCOLS:
            real = os.path.realpath(path or "/")
            if not os.path.exists(real):
                report.problem(
                    "backend_allow", f"{entry}: {real} does not exist on this host", "fix the path, or mount it here"
                )
            elif real != os.path.abspath(path):
                report.ok("backend_allow", f"{entry} resolves to {real}: datasets must lie under {real}")
            else:
                report.ok("backend_allow", f"{entry}: a {'directory' if os.path.isdir(real) else 'file'}")
            continue
        try:
            import fsspec

            fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as exc:
            report.problem(
                "backend_allow",
                f"{entry}: protocol {protocol!r} cannot be opened on this host ({exc})",
                f"install the fsspec implementation of {protocol}:// (the error names it) where the server runs",
            )
        else:
            report.ok("backend_allow", f"{entry}: protocol {protocol} available")


def check_server(config: ServerConfig) -> Report:
    """Every check of a server's configuration."""
    report = Report()
    client_config = dataclasses.replace(ClientConfig(), manager=config.manager, security=config.security)
    if check_manager(report, client_config) is None:
        check_advertised(report, config, None)
    else:
        with ManagerClient(client_config, peer_name="kspeed-doctor") as client:
            check_advertised(report, config, client)
    check_memory(report, config)
    check_state_dir(report, config)
    check_allow_list(report, config)
    return report


# -- client ----------------------------------------------------------------------------------------


def check_client(config: ClientConfig) -> Report:
    """Every check of a client's configuration."""
    report = Report()
    status = check_manager(report, config)
    if status is None:
        return report
    serving = [r for r in status.servers if r.state in SERVING]
    if not serving:
        report.problem(
            "servers",
            "the manager lists no serving server ("
            + (", ".join(f"{r.id} {state_name(r.state)}" for r in status.servers) or "none registered")
            + ")",
            "start kspeed-server on the spare nodes (kspeed status shows why one is not ready)",
        )
    mine = set(available_rails())
    for record in serving:
        why = health_of(record.address, config.security)
        if why:
            report.problem(
                "servers",
                f"server {record.id} announces {record.address}, which this host cannot reach: {why}",
                "set advertise on that server to an address this host can dial, and open the port",
            )
        else:
            report.ok("servers", f"server {record.id} reachable at {record.address}")
        shared = mine & set(record.inventory.transports)
        if not shared:
            report.problem(
                "rails",
                f"server {record.id} offers {', '.join(record.inventory.transports) or 'no rail'}; this host has "
                f"{', '.join(sorted(mine))}",
                "offer a common rail (the server's transports setting), tcp at least",
            )
    return report


# -- the command -----------------------------------------------------------------------------------


def print_report(report: Report, *, as_json: bool) -> int:
    """Print the findings; the exit status is 1 when any needs a change."""
    if as_json:
        say(json.dumps([dataclasses.asdict(f) for f in report.findings], indent=2))
    else:
        for f in report.findings:
            say(
                f"{'ok ' if f.ok else 'FIX'}  {f.check:<17} {f.detail}"
                + (f"\n     {'':<17} -> {f.fix}" if f.fix else "")
            )
        say(f"{report.problems} problem(s)" if report.problems else "no problems found")
    return 1 if report.problems else 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Check a server's (``kspeed doctor server``) or a client's (``kspeed doctor client``) configuration."""
    try:
        if args.role == "server":
            report = check_server(load_config(ServerConfig, args))
        else:
            report = check_client(load_config(ClientConfig, args))
    except ConfigError as exc:
        report = Report()
        report.problem("config", str(exc), "fix the value named (its source is named with it)")
    return print_report(report, as_json=args.json)


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``kspeed doctor server`` and ``kspeed doctor client``."""
    doctor = sub.add_parser(
        "doctor",
        help="check a server's or a client's configuration against the cluster",
        description="Check a configuration against the running cluster; each finding says what to change.",
    )
    roles = doctor.add_subparsers(dest="role", required=True, metavar="ROLE")
    server = subcommand(
        roles,
        "server",
        "check a server's configuration (run it on the server's host)",
        "  kspeed doctor server --config /etc/kspeed/kspeed.yaml\n",
        manager=False,
    )
    add_arguments(server, ServerConfig)
    client = subcommand(
        roles,
        "client",
        "check a client's configuration (run it where training runs)",
        "  kspeed doctor client --manager 10.0.0.5:7070 --token-file ~/.kspeed-token\n",
    )
    for parser in (server, client):
        parser.add_argument("--json", action="store_true", help="print the findings as JSON")
        parser.set_defaults(func=cmd_doctor)
