"""A local cluster of real daemons (one manager, N servers) as child processes on loopback.

Used by ``kspeed up`` and by the integration-test fixture, so both exercise exactly what an
operator runs. Each daemon writes its bound addresses to a ready file; ports may be 0 (any free
port) so nothing races for ports. Children run in their own session (Ctrl-C reaches only the
supervisor, which stops servers first so they deregister) and stop with the supervisor
(``--parent-pid``, a ``PR_SET_PDEATHSIG`` the daemon sets itself) if it is killed.

Tests may place each daemon elsewhere than loopback: ``manager_host``/``server_hosts`` choose the
addresses they bind, and ``launch_prefix`` a command each one is started under, such as
``ip netns exec <namespace>`` (which execs the daemon, so the child is still the daemon itself and
``--parent-pid`` and the stop signals reach it unchanged).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kspeed.config import ClientConfig, load_config
from kspeed.control.manager_client import ManagerClient
from kspeed.control.status import state_name
from kspeed.errors import KSpeedError, UnavailableError
from kspeed.proto import kspeed_pb2

READY = kspeed_pb2.ServerState.SERVER_STATE_READY

STOP_TIMEOUT = 15.0
#: Manager flags for a local cluster whose servers' failures must show within seconds (tests,
#: benchmarks that kill a server): heartbeats every 200 ms, a silent server failed after 2 s
#: rather than the defaults' 10 s.
QUICK_FAILURE_DETECTION = [
    "--heartbeat-interval",
    "200ms",
    "--suspect-after",
    "1s",
    "--fail-after",
    "2s",
    "--probe-interval",
    "300ms",
    "--probe-timeout",
    "500ms",
]


@dataclass
class Daemon:
    """One daemon child process and what it reported when ready."""

    name: str
    argv: list[str]
    ready_file: str
    log_file: str
    env: dict[str, str]
    prefix: list[str] = field(default_factory=list)
    process: subprocess.Popen | None = None
    ready: dict = field(default_factory=dict)

    def start(self) -> None:
        """Start the process under ``prefix`` (its stderr and stdout go to ``log_file``).

        A prefix must exec the daemon in the end (as ``ip netns exec`` does), so the child process
        is the daemon and its parent is this process.
        """
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.ready_file)
        with open(self.log_file, "ab") as log:
            # No preexec_fn: it would force a plain fork of this process, which may run gRPC; the
            # daemon arranges to die with us itself (--parent-pid).
            self.process = subprocess.Popen(
                [*self.prefix, *self.argv, "--parent-pid", str(os.getpid())],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )

    def wait_ready(self, timeout: float) -> dict:
        """Wait for the ready file.

        Raises:
            UnavailableError: the daemon exited or did not get ready in time (with its last log lines).
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(self.ready_file):
                with open(self.ready_file, encoding="utf-8") as fh:
                    self.ready = json.load(fh)
                return self.ready
            if self.process is not None and self.process.poll() is not None:
                raise UnavailableError(f"{self.name} exited with status {self.process.returncode}: {self.log_tail()}")
            time.sleep(0.05)
        raise UnavailableError(f"{self.name} not ready after {timeout:.0f}s: {self.log_tail()}")

    def log_tail(self, lines: int = 5) -> str:
        """The last lines of the daemon's log, joined on one line."""
        try:
            with open(self.log_file, encoding="utf-8", errors="replace") as fh:
                tail = fh.read().splitlines()[-lines:]
        except OSError:
            return "(no log)"
        return " | ".join(tail) or "(empty log)"

    @property
    def running(self) -> bool:
        """True while the process has not exited."""
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process if it still runs."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)

    def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGTERM, wait, then SIGKILL; returns the exit status."""
        if self.process is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            return self.process.wait()


class LocalCluster:
    """One manager and ``servers`` servers under ``state_dir``.

    Args:
        state_dir: root of the cluster's state (manager/, server-<i>/, logs/, run/).
        servers: number of servers.
        port: manager gRPC port on 127.0.0.1 (0: any free port).
        http_port: manager HTTP port on 127.0.0.1 (0: any free port).
        token_file: enables bearer-token auth on every daemon; without it auth is off.
        manager_args: extra flags for the manager.
        server_args: extra flags for every server.
        env: extra environment for the daemons.
        pool_root: where the servers' pools live (``<pool_root>/server-<i>``); default: in their state dirs.
        manager_host: the address the manager binds its gRPC and HTTP ports on.
        server_hosts: per server, the address it binds (and so announces); default: loopback for
            all. Servers added beyond the list bind on loopback.
        launch_prefix: given a daemon's name (``"manager"``, ``"server-<i>"``), the command it is
            started under, e.g. ``["ip", "netns", "exec", "ns0"]``; it must exec the daemon.

    Raises:
        ValueError: more ``server_hosts`` than ``servers``.
    """

    def __init__(
        self,
        state_dir: str,
        *,
        servers: int = 2,
        port: int = 0,
        http_port: int = 0,
        token_file: str = "",
        manager_args: Sequence[str] = (),
        server_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        pool_root: str = "",
        manager_host: str = "127.0.0.1",
        server_hosts: Sequence[str] | None = None,
        launch_prefix: Callable[[str], Sequence[str]] | None = None,
    ) -> None:
        if server_hosts is not None and len(server_hosts) > servers:
            raise ValueError(f"{len(server_hosts)} server_hosts for {servers} servers")
        self.state_dir = os.path.abspath(state_dir)
        self.server_hosts = list(server_hosts or ())
        self._launch_prefix = launch_prefix
        self.pool_root = os.path.abspath(pool_root) if pool_root else ""
        self.token_file = token_file
        self._env = {k: v for k, v in os.environ.items() if not k.startswith("KSPEED_")}
        self._env.update(env or {})
        for sub in ("logs", "run"):
            os.makedirs(os.path.join(self.state_dir, sub), exist_ok=True)
        auth = ["--auth", "token", "--token-file", token_file] if token_file else ["--auth", "none"]
        self._auth = auth
        self.manager = self._daemon(
            "manager",
            "kspeed.manager",
            [
                "--listen",
                _join(manager_host, port),
                "--http-listen",
                _join(manager_host, http_port),
                "--state-dir",
                os.path.join(self.state_dir, "manager"),
                *manager_args,
            ],
        )
        self._server_args = list(server_args)
        self._server_count = servers
        self.servers: list[Daemon] = []

    def _daemon(self, name: str, module: str, args: list[str]) -> Daemon:
        run = os.path.join(self.state_dir, "run")
        prefix = list(self._launch_prefix(name)) if self._launch_prefix is not None else []
        return Daemon(
            name=name,
            argv=[sys.executable, "-m", module, *self._auth, *args, "--ready-file", os.path.join(run, f"{name}.json")],
            ready_file=os.path.join(run, f"{name}.json"),
            log_file=os.path.join(self.state_dir, "logs", f"{name}.log"),
            env=self._env,
            prefix=prefix,
        )

    def _server(self, index: int) -> Daemon:
        state = os.path.join(self.state_dir, f"server-{index}")
        host = self.server_hosts[index] if index < len(self.server_hosts) else "127.0.0.1"
        return self._daemon(
            f"server-{index}",
            "kspeed.server",
            [
                "--manager",
                self.address,
                "--listen",
                _join(host, 0),
                "--http-listen",
                _join(host, 0),
                "--state-dir",
                state,
                "--pool-dir",
                os.path.join(self.pool_root or state, f"server-{index}" if self.pool_root else "pool"),
                *self._server_args,
            ],
        )

    @property
    def address(self) -> str:
        """The manager's gRPC address."""
        return self.manager.ready["grpc"]

    @property
    def http_address(self) -> str:
        """The manager's HTTP address."""
        return self.manager.ready["http"]

    def start(self, timeout: float = 30.0) -> None:
        """Start the manager, then the servers, and wait until the manager lists every server READY.

        Ready means ready: a server's own ready file only says it listens; it can hold data once
        the manager has probed it and moved it to READY.

        Raises:
            UnavailableError: a daemon did not start, or a server did not become READY in time
                (named, with its log's last lines).
        """
        try:
            self.start_manager(timeout)
            for _ in range(self._server_count):  # all at once: each spends its start importing and spawning
                server = self._server(len(self.servers))
                self.servers.append(server)
                server.start()
            for server in self.servers:
                server.wait_ready(timeout)
            self.wait_members(timeout)
        except BaseException:
            self.stop()
            raise

    def client_config(self) -> ClientConfig:
        """A client configuration for this cluster: its manager, its token when auth is on, and the ``KSPEED_*``
        settings (TLS) the daemons were started with."""
        security = (
            {"security.auth": "token", "security.token_file": self.token_file}
            if self.token_file
            else {"security.auth": "none"}
        )
        return load_config(ClientConfig, environ=self._env, overrides={"manager": self.address, **security})

    def wait_members(self, timeout: float = 30.0) -> None:
        """Wait until the manager lists every running server as READY.

        Raises:
            UnavailableError: naming the servers that are not READY, with their state and reason.
        """
        wanted = {s.ready["id"]: s for s in self.servers if s.running and s.ready}
        deadline = time.monotonic() + timeout
        while True:
            error: KSpeedError | None = None
            try:
                records = self._members()
            except KSpeedError as exc:
                records, error = {}, exc
            late = [sid for sid in wanted if records.get(sid, ("", ""))[0] != "ready"]
            if not late:
                return
            if time.monotonic() > deadline:
                detail = "; ".join(
                    f"{wanted[sid].name} ({sid}) is "
                    + (f"{records[sid][0]}: {records[sid][1]}" if sid in records else "not registered")
                    + f"; log: {wanted[sid].log_tail(2)}"
                    for sid in late
                )
                raise UnavailableError(
                    f"servers not READY after {timeout:.0f}s: {detail}" + (f" (manager: {error})" if error else "")
                )
            time.sleep(0.05)

    def _members(self) -> dict[str, tuple[str, str]]:
        """Each server the manager knows: its state and why. Asked from the manager's own network
        when it runs under a launch prefix (a network namespace the caller may not reach).

        Raises:
            KSpeedError: the manager cannot be asked.
        """
        prefix = list(self._launch_prefix("manager")) if self._launch_prefix is not None else []
        if not prefix:
            with ManagerClient(self.client_config(), peer_name="kspeed-up") as client:
                return {r.id: (state_name(r.state), r.state_reason) for r in client.servers()}
        config = self.client_config()
        argv = [*prefix, sys.executable, "-m", "kspeed.cli", "status", "--json", "--manager", self.address]
        argv += ["--auth", config.security.auth]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=self._env)
        if done.returncode != 0:
            raise UnavailableError(f"kspeed status in the manager's network failed: {done.stderr.strip()[-300:]}")
        servers = json.loads(done.stdout)["servers"]
        return {s["id"]: (s["state"], s.get("state_reason", "")) for s in servers}

    def start_manager(self, timeout: float = 30.0) -> None:
        """(Re)start the manager process; a restart binds the ports of the first start."""
        self.manager.start()
        ready = self.manager.wait_ready(timeout)
        argv = self.manager.argv
        argv[argv.index("--listen") + 1] = ready["grpc"]
        argv[argv.index("--http-listen") + 1] = ready["http"]

    def start_server(self, server: Daemon, timeout: float = 30.0) -> None:
        """(Re)start one server process."""
        server.start()
        server.wait_ready(timeout)

    def add_server(self, timeout: float = 30.0, *, member: bool = True) -> Daemon:
        """Start one more server and (with ``member``) wait until the manager lists it READY."""
        server = self._server(len(self.servers))
        self.servers.append(server)
        self.start_server(server, timeout)
        if member:
            self.wait_members(timeout)
        return server

    def stop(self) -> dict[str, int | None]:
        """Stop the servers (they deregister), then the manager; returns their exit statuses."""
        statuses = {}
        for server in self.servers:
            server.signal(signal.SIGTERM)
        for server in self.servers:
            statuses[server.name] = server.stop()
        statuses["manager"] = self.manager.stop()
        return statuses

    def pool_dir(self, server: Daemon) -> str:
        """Where ``server`` keeps its pool (``--pool-dir``)."""
        return server.argv[server.argv.index("--pool-dir") + 1]

    def discard_pools(self) -> int:
        """Delete the pool files of every server that is not running; returns the bytes freed."""
        from kspeed.server.memory.pool import discard_pool

        return sum(discard_pool(self.pool_dir(server)) for server in self.servers if not server.running)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _join(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    """Poll ``predicate`` until it returns a truthy value; raise naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except KSpeedError as exc:
            last_error = exc
        time.sleep(interval)
    raise UnavailableError(
        f"timed out after {timeout:.0f}s waiting for {what}" + (f" (last error: {last_error})" if last_error else "")
    )
