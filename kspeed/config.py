"""Typed configuration of every KSpeed process, read in this one module.

Each process has a dataclass whose fields carry their own help text, environment variable, parser
and check. Values are merged in a fixed order: defaults, then the YAML file (``--config`` or
``KSPEED_CONFIG``; the section named after the component plus a shared ``security`` section), then
``KSPEED_*`` environment variables, then command-line flags. A bad value raises
:class:`~kspeed.errors.ConfigError` naming the field, the value and where it came from; a rule
across fields (checked once all are merged) names where each of its fields came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from kspeed import names
from kspeed.errors import ConfigError

__all__ = [
    "ClientConfig",
    "DaemonConfig",
    "ManagerConfig",
    "SecurityConfig",
    "ServerConfig",
    "add_arguments",
    "format_bytes",
    "format_duration",
    "gpu_environment",
    "launcher_environment",
    "launcher_run_id",
    "load_config",
    "parse_address",
    "parse_bytes",
    "parse_duration",
    "preprocess_environment",
    "process_cpu_seconds",
    "setting",
    "usable_cores",
]

C = TypeVar("C")

_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4,
}  # fmt: skip
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0, "h": 3600.0}


# ---------------------------------------------------------------------------------------------
# Parsers: each takes the raw value (a string from env/flags, or a YAML scalar) and returns the
# typed value or raises ValueError with a short reason.


def parse_bytes(raw: object) -> int:
    """Parse a byte size such as ``134217728``, ``128MiB`` or ``64G`` (SI and IEC units)."""
    if isinstance(raw, bool):
        raise ValueError("expected a byte size")
    if isinstance(raw, int):
        value = raw
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(raw))
        if not match or match.group(2).lower() not in _BYTE_UNITS:
            raise ValueError("expected a byte size like 512MiB, 64G or 1048576")
        value = int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])
    if value < 0:
        raise ValueError("must not be negative")
    return value


def parse_duration(raw: object) -> float:
    """Parse a duration such as ``2.5``, ``500ms``, ``10s`` or ``1m`` into seconds."""
    if isinstance(raw, bool):
        raise ValueError("expected a duration")
    if isinstance(raw, (int, float)):
        value = float(raw)
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", str(raw))
        if not match or match.group(2) not in _DURATION_UNITS:
            raise ValueError("expected a duration like 500ms, 10s or 2m")
        value = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if value <= 0:
        raise ValueError("must be positive")
    return value


def parse_address(raw: object) -> str:
    """Check a ``host:port`` address (port 0 means any free port) and return it normalized."""
    text = str(raw).strip()
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("expected host:port with a port between 0 and 65535")
    return f"{host}:{int(port)}"


def _parse_optional_address(raw: object) -> str:
    return "" if raw in (None, "") else parse_address(raw)


def _parse_bool(raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _parse_int(raw: object) -> int:
    if isinstance(raw, bool):
        raise ValueError("expected an integer")
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ValueError("expected an integer") from None
    if value < 0:
        raise ValueError("must not be negative")
    return value


def _parse_str(raw: object) -> str:
    return "" if raw is None else str(raw)


def _parse_list(raw: object) -> tuple[str, ...]:
    if isinstance(raw, (list, tuple)):
        items = [str(item).strip() for item in raw]
    else:
        items = [item.strip() for item in str(raw).split(",")]
    return tuple(item for item in items if item)


def _parse_mapping(raw: object) -> dict[str, dict[str, Any]]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise ValueError("expected a JSON object of protocol -> options") from None
    if not isinstance(raw, Mapping) or not all(isinstance(v, Mapping) for v in raw.values()):
        raise ValueError("expected a mapping of protocol -> mapping of options")
    return {str(k): dict(v) for k, v in raw.items()}


def _parse_name(raw: object) -> str:
    return str(raw).strip().lower()


def _choice(*choices: str) -> Callable[[object], str]:
    def parse(raw: object) -> str:
        text = str(raw).strip().lower()
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return text

    parse.choices = choices  # type: ignore[attr-defined]
    return parse


def format_bytes(value: int) -> str:
    """A byte size as :func:`parse_bytes` reads it back: the largest IEC unit that divides it."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if value and value % size == 0:
            return f"{value // size}{unit}"
    return str(value)


def format_duration(seconds: float) -> str:
    """A duration as :func:`parse_duration` reads it back (``300ms``, ``5s``, ``10m``, ``1h``)."""
    for unit, size in (("h", 3600.0), ("m", 60.0)):
        if seconds >= size and (seconds / size).is_integer():
            return f"{seconds / size:.0f}{unit}"
    if seconds < 1:
        return f"{seconds * 1e3:g}ms"
    return f"{seconds:g}s"


# How each parser's values are named and shown on the command line: (metavar, formatter).
_FLAG_STYLE: dict[Callable[[object], Any], tuple[str, Callable[[Any], str]]] = {
    parse_bytes: ("SIZE", format_bytes),
    parse_duration: ("DURATION", format_duration),
    parse_address: ("HOST:PORT", str),
    _parse_optional_address: ("HOST:PORT", str),
    _parse_int: ("N", str),
    _parse_bool: ("BOOL", lambda v: "true" if v else "false"),
    _parse_list: ("A,B,...", ",".join),
    _parse_mapping: ("JSON", json.dumps),
    _parse_name: ("NAME", str),
    _parse_str: ("TEXT", str),
}


def option(
    default: Any,
    help: str,
    *,
    parse: Callable[[object], Any] = _parse_str,
    env: str = "",
    metavar: str = "",
    secret: bool = False,
) -> Any:
    """Declare a configuration field with its help text, parser and environment variable.

    ``metavar`` names the value in ``--help`` (default: from the parser, e.g. SIZE or DURATION);
    ``secret``: the value holds credentials, so an error about it never shows it.
    """
    kwargs: dict[str, Any] = {
        "metadata": {"help": help, "parse": parse, "env": env, "metavar": metavar, "secret": secret}
    }
    if isinstance(default, (list, dict, set)):
        kwargs["default_factory"] = lambda: type(default)(default)
    else:
        kwargs["default"] = default
    return dataclasses.field(**kwargs)


# ---------------------------------------------------------------------------------------------
# The configurations


@dataclasses.dataclass
class SecurityConfig:
    """Credentials shared by every process: bearer token and optional TLS."""

    auth: str = option(
        "token",
        "token: every RPC must carry the bearer token; none: no auth (only for loopback-only clusters)",
        parse=_choice("token", "none"),
        env="KSPEED_AUTH",
    )
    token_file: str = option("", "file holding the bearer token", env="KSPEED_TOKEN_FILE", metavar="FILE")
    token: str = option(
        "", "the bearer token itself (prefer token_file)", env="KSPEED_TOKEN", metavar="TOKEN", secret=True
    )
    tls_cert: str = option("", "PEM certificate of this daemon's gRPC server", env="KSPEED_TLS_CERT", metavar="FILE")
    tls_key: str = option("", "PEM private key of this daemon's gRPC server", env="KSPEED_TLS_KEY", metavar="FILE")
    tls_ca: str = option(
        "", "PEM CA bundle to verify daemons with (enables TLS on channels)", env="KSPEED_TLS_CA", metavar="FILE"
    )

    def validate(self) -> None:
        """Resolve the token from its file and check that the settings fit together (without auth,
        a token file is not read)."""
        if self.token_file and self.auth == "token":
            try:
                with open(self.token_file, encoding="utf-8") as fh:
                    self.token = fh.read().strip()
            except OSError as exc:
                raise ConfigError(
                    f"security.token_file: cannot read {self.token_file!r}: {exc.strerror}",
                    field="security.token_file",
                    value=self.token_file,
                ) from exc
            if not self.token:
                raise ConfigError(
                    f"security.token_file: {self.token_file!r} is empty",
                    field="security.token_file",
                    value=self.token_file,
                )
        if self.auth == "token" and not self.token:
            raise ConfigError(
                "security.auth is 'token' but no token is configured: set token_file (KSPEED_TOKEN_FILE) "
                "or KSPEED_TOKEN, or run with auth none explicitly (loopback-only clusters)",
                field="security.auth",
                value=self.auth,
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError(
                "security.tls_cert and security.tls_key must be given together",
                field="security.tls_cert",
                value=self.tls_cert or self.tls_key,
            )
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path and not os.access(path, os.R_OK):
                raise ConfigError(f"security.{name}: cannot read {path!r}", field=f"security.{name}", value=path)

    def data_plane_token(self) -> bytes | None:
        """The secret of data-plane handshakes, derived from the bearer token (None without auth).

        A separate derived key keeps the bearer token itself off the data plane.
        """
        if self.auth != "token" or not self.token:
            return None
        return hashlib.sha256(b"kspeed data plane v1\0" + self.token.encode()).digest()

    def read_pem(self, name: str) -> bytes | None:
        """The bytes of one of the TLS files (``tls_cert``, ``tls_key``, ``tls_ca``), or None."""
        path = getattr(self, name)
        if not path:
            return None
        with open(path, "rb") as fh:
            return fh.read()


@dataclasses.dataclass
class DaemonConfig:
    """What every daemon configures: its listeners, state, request limit, logging and credentials.

    ``{SECTION}`` in a variable's name stands for the daemon's section (``KSPEED_SERVER_LISTEN``);
    a daemon's class gives the fields their own defaults with :func:`default_of`.
    """

    listen: str = option("", "gRPC listen address", parse=parse_address, env="KSPEED_{SECTION}_LISTEN")
    http_listen: str = option(
        "",
        "HTTP listen address (/healthz, /readyz, /metrics; the manager also /v1/status)",
        parse=parse_address,
        env="KSPEED_{SECTION}_HTTP_LISTEN",
    )
    state_dir: str = option(
        "",
        "state directory (manager: its database; server: its identity and assignments)",
        env="KSPEED_{SECTION}_STATE_DIR",
        metavar="DIR",
    )
    max_request_bytes: int = option(
        0, "largest accepted gRPC request", parse=parse_bytes, env="KSPEED_MAX_REQUEST_BYTES"
    )
    log_level: str = option(
        "info", "log level", parse=_choice("debug", "info", "warning", "error"), env="KSPEED_LOG_LEVEL"
    )
    log_format: str = option(
        "text",
        "log format: text, or json (one object per line, for log collectors)",
        parse=_choice("text", "json"),
        env="KSPEED_LOG_FORMAT",
    )
    ready_file: str = option(
        "",
        "write the bound addresses as JSON to this file once ready",
        env="KSPEED_{SECTION}_READY_FILE",
        metavar="FILE",
    )
    parent_pid: int = option(
        0,
        "stop (as on SIGTERM) when this process exits; set by supervisors such as kspeed up",
        parse=_parse_int,
        env="KSPEED_PARENT_PID",
    )
    http_open: tuple[str, ...] = option(
        ("/healthz", "/readyz", "/metrics"),
        "HTTP routes served without the bearer token when auth is on (the others, such as the manager's "
        "/v1/status, need it)",
        parse=_parse_list,
        env="KSPEED_HTTP_OPEN",
        metavar="PATH,...",
    )
    max_connections: int = option(
        16384,
        "gRPC connections at once (every client process holds one to the manager and one to each server); more "
        "are closed as they come. Each holds a file descriptor: keep the unit's LimitNOFILE above this plus "
        "http_connections",
        parse=_parse_int,
        env="KSPEED_MAX_CONNECTIONS",
    )
    handshake_timeout: float = option(
        10.0,
        "longest a new gRPC connection may take to finish its TLS and HTTP/2 handshake, however it trickles, and a "
        "call to a server to send its request (each waits on one of the server's rpc_threads)",
        parse=parse_duration,
        env="KSPEED_HANDSHAKE_TIMEOUT",
    )
    connection_idle_timeout: float = option(
        300.0,
        "a gRPC connection that carries no call for this long is closed (a client reconnects at its next call)",
        parse=parse_duration,
        env="KSPEED_CONNECTION_IDLE_TIMEOUT",
    )
    stream_idle_timeout: float = option(
        30.0,
        "longest a gRPC stream may wait for its caller's next message (a health Watch: for a change of status) "
        "before it is cancelled",
        parse=parse_duration,
        env="KSPEED_STREAM_IDLE_TIMEOUT",
    )
    health_watches: int = option(
        16,
        "grpc.health.v1 Watch streams at once, a quarter of them from one address: they need no token, so they get "
        "a share of their own and never take a stream that token holders need",
        parse=_parse_int,
        env="KSPEED_HEALTH_WATCHES",
    )
    http_connections: int = option(
        64,
        "HTTP connections at once (a thread each); past it, or past http_connections_per_peer from one address, "
        "the oldest connection is closed to make room",
        parse=_parse_int,
        env="KSPEED_HTTP_CONNECTIONS",
    )
    http_connections_per_peer: int = option(
        16, "HTTP connections at once from one address", parse=_parse_int, env="KSPEED_HTTP_CONNECTIONS_PER_PEER"
    )
    http_timeout: float = option(
        10.0,
        "longest an HTTP connection stays open (TLS handshake, request and answer): a slow or idle client is dropped",
        parse=parse_duration,
        env="KSPEED_HTTP_TIMEOUT",
    )
    security: SecurityConfig = dataclasses.field(default_factory=SecurityConfig)

    def http_token(self) -> str:
        """The token HTTP routes other than :attr:`http_open` require ("" when auth is off)."""
        return self.security.token if self.security.auth == "token" else ""

    def validate_listeners(self, section: str) -> None:
        """Check the listeners' caps (``section`` names the daemon in messages)."""
        for name, low, high in (
            ("max_connections", 16, 1 << 20),
            ("health_watches", 1, 1 << 16),
            ("http_connections", 1, 1 << 16),
            ("http_connections_per_peer", 1, 1 << 16),
        ):
            value = getattr(self, name)
            if not low <= value <= high:
                raise ConfigError(
                    f"{section}.{name}: {value} is not between {low} and {high}", field=f"{section}.{name}", value=value
                )
        if self.http_connections_per_peer > self.http_connections:
            raise ConfigError(
                f"{section}.http_connections_per_peer ({self.http_connections_per_peer}) exceeds "
                f"{section}.http_connections ({self.http_connections})",
                field=f"{section}.http_connections_per_peer",
                value=self.http_connections_per_peer,
            )


def default_of(name: str, value: Any) -> Any:
    """Declare :class:`DaemonConfig` field ``name`` again with the default ``value`` (help, parser, variable kept)."""
    return dataclasses.field(default=value, metadata=DaemonConfig.__dataclass_fields__[name].metadata)


@dataclasses.dataclass
class ManagerConfig(DaemonConfig):
    """Configuration of ``kspeed-manager``."""

    listen: str = default_of("listen", "127.0.0.1:7070")
    http_listen: str = default_of("http_listen", "127.0.0.1:7080")
    state_dir: str = default_of("state_dir", "/var/lib/kspeed/manager")
    max_request_bytes: int = default_of("max_request_bytes", 4 * 1024**2)
    heartbeat_interval: float = option(
        1.0, "how often servers heartbeat", parse=parse_duration, env="KSPEED_HEARTBEAT_INTERVAL"
    )
    suspect_after: float = option(
        3.0, "silence after which a server is suspect", parse=parse_duration, env="KSPEED_SUSPECT_AFTER"
    )
    fail_after: float = option(
        10.0, "silence after which a server is failed", parse=parse_duration, env="KSPEED_FAIL_AFTER"
    )
    probe_interval: float = option(
        2.0, "period of the manager's active health probes", parse=parse_duration, env="KSPEED_PROBE_INTERVAL"
    )
    probe_timeout: float = option(1.0, "deadline of one health probe", parse=parse_duration, env="KSPEED_PROBE_TIMEOUT")
    lease_ttl: float = option(
        30.0, "lifetime of a job's dataset lease unless renewed", parse=parse_duration, env="KSPEED_LEASE_TTL"
    )
    verify_on_attach: bool = option(
        True,
        "compare a dataset's files with the backend when a job attaches to it (at most once a minute: a stat "
        "per local file, one listing of an object store, a manifest's stamp) and refuse it when they changed "
        "since registration",
        parse=_parse_bool,
        env="KSPEED_VERIFY_ON_ATTACH",
    )
    join_wait: float = option(
        30.0,
        "longest a new dataset waits for servers that are still joining (registered, not yet probed)",
        parse=parse_duration,
        env="KSPEED_JOIN_WAIT",
    )
    server_call_timeout: float = option(
        120.0,
        "deadline of the manager's calls to servers (listing a large backend takes time)",
        parse=parse_duration,
        env="KSPEED_SERVER_CALL_TIMEOUT",
    )
    restart_grace: float = option(
        30.0,
        "how long a server stopped cleanly with its pool kept (SIGTERM, systemctl stop) is waited for before its "
        "shares move to other servers: one back within it re-adopts its pool and nothing moves (0: move at once)",
        parse=parse_duration,
        env="KSPEED_RESTART_GRACE",
    )
    max_streams: int = option(
        1024,
        "gRPC streams at once (membership watches of clients), at most half of them from one address; one more "
        "is refused with BusyError (the caller retries)",
        parse=_parse_int,
        env="KSPEED_MANAGER_MAX_STREAMS",
    )
    rebuild_state: bool = option(
        False,
        "move a damaged state file aside and rebuild the registry from the servers' assignment files (once, "
        "after the manager refused to start on that file)",
        parse=_parse_bool,
        env="KSPEED_REBUILD_STATE",
    )

    def validate(self) -> None:
        """Check cross-field rules."""
        if not self.suspect_after < self.fail_after:
            raise ConfigError(
                f"manager.suspect_after ({self.suspect_after}s) must be shorter than "
                f"manager.fail_after ({self.fail_after}s)",
                field="manager.suspect_after",
                value=self.suspect_after,
            )
        if not self.heartbeat_interval < self.suspect_after:
            raise ConfigError(
                f"manager.heartbeat_interval ({self.heartbeat_interval}s) must be shorter than "
                f"manager.suspect_after ({self.suspect_after}s)",
                field="manager.heartbeat_interval",
                value=self.heartbeat_interval,
            )
        if not 2 <= self.max_streams <= 1 << 16:
            raise ConfigError(
                f"manager.max_streams: {self.max_streams} is not between 2 and {1 << 16}",
                field="manager.max_streams",
                value=self.max_streams,
            )
        self.validate_listeners("manager")
        self.security.validate()


@dataclasses.dataclass
class ServerConfig(DaemonConfig):
    """Configuration of ``kspeed-server``."""

    listen: str = default_of("listen", "0.0.0.0:7071")
    http_listen: str = default_of("http_listen", "0.0.0.0:7081")
    state_dir: str = default_of("state_dir", "/var/lib/kspeed/server")
    max_request_bytes: int = default_of("max_request_bytes", 64 * 1024**2)
    manager: str = option("127.0.0.1:7070", "the manager's gRPC address", parse=parse_address, env="KSPEED_MANAGER")
    advertise: str = option(
        "",
        "address the manager probes and clients dial (default: listen; for a wildcard host, the address this "
        "host reaches the manager from)",
        parse=_parse_optional_address,
        env="KSPEED_SERVER_ADVERTISE",
    )
    server_id: str = option(
        "",
        "stable server id (default: generated once and kept in state_dir)",
        env="KSPEED_SERVER_ID",
        metavar="ID",
    )
    memory: int = option(1024**3, "memory this server may pool", parse=parse_bytes, env="KSPEED_SERVER_MEMORY")
    region_size: int = option(128 * 1024**2, "bytes per registered region", parse=parse_bytes, env="KSPEED_REGION_SIZE")
    cores: int = option(
        0, "CPU cores this server may use (0: all it is allowed to run on)", parse=_parse_int, env="KSPEED_SERVER_CORES"
    )
    verbs_api: str = option(
        "pyverbs",
        "what the verbs rail drives: pyverbs, or module:attribute of another implementation of "
        "kspeed.rdma.verbs.api.VerbsApi (the tests' software double)",
        env="KSPEED_VERBS_API",
        metavar="API",
    )
    nic: str = option(
        "",
        "RDMA device the feeders write from, e.g. mlx5_0 (an unknown device is an error; default: the first)",
        env="KSPEED_SERVER_NIC",
        metavar="NIC",
    )
    transports: tuple[str, ...] = option(
        (),
        "data-plane rails to offer (default: every rail usable on this host)",
        parse=_parse_list,
        env="KSPEED_SERVER_TRANSPORTS",
        metavar="RAIL,...",
    )
    pool_dir: str = option(
        "",
        "directory of the pool's region files (default: /dev/shm/kspeed-pool-<id> if "
        "/dev/shm exists, else <state_dir>/pool); re-adopted after a restart",
        env="KSPEED_SERVER_POOL_DIR",
        metavar="DIR",
    )
    keep_pool_on_exit: bool = option(
        True,
        "keep the pool's files on a clean exit so a restart re-adopts the loaded data (false: remove them)",
        parse=_parse_bool,
        env="KSPEED_SERVER_KEEP_POOL",
    )
    backend_allow: tuple[str, ...] = option(
        (),
        "backend URIs this server may open: protocols and path "
        "prefixes such as /data,s3://bucket/prefix (default: none)",
        parse=_parse_list,
        env="KSPEED_BACKEND_ALLOW",
        metavar="PREFIX,...",
    )
    backend_options: dict = option(
        {},
        "per protocol, options (credentials) of its fsspec file system; YAML mapping or JSON",
        parse=_parse_mapping,
        env="KSPEED_BACKEND_OPTIONS",
        secret=True,
    )
    preload_threads: int = option(
        16, "backend reads in flight per preload", parse=_parse_int, env="KSPEED_PRELOAD_THREADS"
    )
    scrub_interval: float = option(
        3600.0, "time between integrity scrubs of loaded data", parse=parse_duration, env="KSPEED_SCRUB_INTERVAL"
    )
    change_check_interval: float = option(
        300.0,
        "how often each share's backend files are compared with the listing (size and mtime/etag)",
        parse=parse_duration,
        env="KSPEED_CHANGE_CHECK_INTERVAL",
    )
    change_check_budget: int = option(
        1000,
        "backend files compared per share and interval, round robin (on an object store each is a request; "
        "0: only at attach and on every backend read)",
        parse=_parse_int,
        env="KSPEED_CHANGE_CHECK_BUDGET",
    )
    feeders: int = option(
        0,
        "feeder processes that write samples to clients (0: one per usable core, at most 4)",
        parse=_parse_int,
        env="KSPEED_SERVER_FEEDERS",
    )
    data_io_timeout: float = option(
        10.0,
        "time without progress after which a client's data-plane path is declared lost",
        parse=parse_duration,
        env="KSPEED_DATA_IO_TIMEOUT",
    )
    rpc_threads: int = option(
        64,
        "threads serving gRPC calls; streams (plans too large for one message) get all but 8, kept for health and info "
        "calls, and one caller at most half",
        parse=_parse_int,
        env="KSPEED_RPC_THREADS",
    )
    max_plan_bytes: int = option(
        1024**3,
        "largest plan part one client may send this server in one call (about 24 bytes a sample); a stream "
        "past it is refused as its chunks arrive",
        parse=parse_bytes,
        env="KSPEED_MAX_PLAN_BYTES",
    )
    production_window: int = option(
        0,
        "pool memory reserved for samples produced ahead of the plans that are not at home yet "
        "(whole regions; 0: an eighth of memory, at least one region)",
        parse=parse_bytes,
        env="KSPEED_PRODUCTION_WINDOW",
    )
    production_depth: int = option(
        1024,
        "samples of each feed's plan made resident ahead of the first one not written yet",
        parse=_parse_int,
        env="KSPEED_PRODUCTION_DEPTH",
    )
    production_threads: int = option(
        8,
        "backend reads in flight for production (beside the preload's)",
        parse=_parse_int,
        env="KSPEED_PRODUCTION_THREADS",
    )
    production_timeout: float = option(
        60.0,
        "longest a feed may go without writing a grant while a grant of it waits for samples to be "
        "produced, before the client gets an error naming them",
        parse=parse_duration,
        env="KSPEED_PRODUCTION_TIMEOUT",
    )
    preprocess_workers: int = option(
        0,
        "worker processes that run the server stages of datasets' pipelines, started on first use "
        "(0: one per usable core)",
        parse=_parse_int,
        env="KSPEED_PREPROCESS_WORKERS",
    )
    preprocess_allow: tuple[str, ...] = option(
        ("torchvision.transforms",),
        "modules whose functions pipelines may name as stages (packages admit their submodules); "
        "torchvision.transforms lets the servers re-create torchvision's common transforms",
        parse=_parse_list,
        env="KSPEED_PREPROCESS_ALLOW",
        metavar="MODULE,...",
    )
    preprocess_sandbox: str = option(
        "required",
        "how the preprocessing workers are confined (docs/preprocessing.md): required (a worker that could "
        "reach the token, the state directory, the pool, the network or a shell runs no pipeline), "
        "best-effort (it runs them, and the server logs what it could reach) or off",
        parse=_choice("required", "best-effort", "off"),
        env="KSPEED_PREPROCESS_SANDBOX",
    )
    preprocess_user: str = option(
        "",
        "user the preprocessing workers run as when the server runs as root: a name or uid[:gid], never root "
        "(default: nobody; a dedicated user such as kspeed-prep is better). An unprivileged server's workers "
        "keep its user and are confined by Landlock",
        env="KSPEED_PREPROCESS_USER",
        metavar="USER",
    )
    preprocess_network: bool = option(
        False,
        "let the preprocessing workers open network sockets (default: no network namespace interface "
        "and no socket but AF_UNIX)",
        parse=_parse_bool,
        env="KSPEED_PREPROCESS_NETWORK",
    )
    preprocess_read_paths: tuple[str, ...] = option(
        (),
        "files or directories the preprocessing workers may read besides the Python installation and "
        "the modules they import (e.g. a model's weights a user function loads)",
        parse=_parse_list,
        env="KSPEED_PREPROCESS_READ_PATHS",
        metavar="PATH,...",
    )
    preprocess_write_paths: tuple[str, ...] = option(
        (),
        "files or directories the preprocessing workers may also write (default: none; their results "
        "go back to the server, which copies them)",
        parse=_parse_list,
        env="KSPEED_PREPROCESS_WRITE_PATHS",
        metavar="PATH,...",
    )
    preprocess_env: tuple[str, ...] = option(
        (),
        "environment variables the preprocessing workers are started with besides PATH, the locale, TZ "
        "and LD_LIBRARY_PATH (names; a KSPEED_ variable is never passed)",
        parse=_parse_list,
        env="KSPEED_PREPROCESS_ENV",
        metavar="NAME,...",
    )
    preprocess_weights: tuple[str, ...] = option(
        (),
        "the preprocessing workers' share of each job that uses them at once, as JOB=WEIGHT (the job "
        "name its clients give, KSPEED_JOB; a job not named weighs 1): workers go to the job with the "
        "fewest busy worker-seconds over its weight",
        parse=_parse_list,
        env="KSPEED_PREPROCESS_WEIGHTS",
        metavar="JOB=WEIGHT,...",
    )
    verify_served: str = option(
        "first",
        "which stored samples a feeder checks against their crc32c before it writes them to a client (a mismatch "
        "is re-read from the backend and counted): first (each the first time it serves it from where it is "
        "now; only the server can write the pool meanwhile), always (every time: about a second copy of the "
        "bytes), off (only the scrub finds corrupted memory)",
        parse=_choice("first", "always", "off"),
        env="KSPEED_VERIFY_SERVED",
    )
    data_networks: tuple[str, ...] = option(
        (),
        "networks (CIDR) whose addresses a feed's receiver may have besides the address its client "
        "called from: a server dials no other (e.g. a separate data network of multi-homed hosts)",
        parse=_parse_list,
        env="KSPEED_DATA_NETWORKS",
        metavar="CIDR,...",
    )
    drain_timeout: float = option(
        10.0, "longest wait for in-flight work on SIGTERM", parse=parse_duration, env="KSPEED_DRAIN_TIMEOUT"
    )

    def window_bytes(self) -> int:
        """The production window: :attr:`production_window`, or an eighth of memory; whole regions, at least one."""
        wanted = self.production_window or self.memory // 8
        return max(self.region_size, wanted - wanted % self.region_size)

    def validate(self) -> None:
        """Check cross-field rules."""
        page = os.sysconf("SC_PAGE_SIZE")
        if self.region_size < page or self.region_size % page:
            raise ConfigError(
                f"server.region_size: {self.region_size} is not a positive multiple of the page size ({page})",
                field="server.region_size",
                value=self.region_size,
            )
        if self.memory and self.memory < self.region_size:
            raise ConfigError(
                f"server.memory: {self.memory} bytes is less than one region ({self.region_size})",
                field="server.memory",
                value=self.memory,
            )
        if not 10 <= self.rpc_threads <= 4096:
            raise ConfigError(
                f"server.rpc_threads: {self.rpc_threads} is not between 10 and 4096 (8 are kept for unary calls)",
                field="server.rpc_threads",
                value=self.rpc_threads,
            )
        if self.max_plan_bytes < 1024**2:
            raise ConfigError(
                f"server.max_plan_bytes: {format_bytes(self.max_plan_bytes)} is less than 1MiB",
                field="server.max_plan_bytes",
                value=self.max_plan_bytes,
            )
        self.validate_listeners("server")
        unknown = sorted(set(self.transports) - set(_rail_names()))
        if unknown:
            raise ConfigError(
                f"server.transports: unknown rail(s) {', '.join(unknown)}; known: {', '.join(_rail_names())}",
                field="server.transports",
                value=",".join(self.transports),
            )
        if self.memory and self.production_window >= self.memory:
            raise ConfigError(
                f"server.production_window: {format_bytes(self.production_window)} leaves nothing of "
                f"server.memory ({format_bytes(self.memory)}) for datasets: make it smaller than memory, or leave "
                "it out (the default is an eighth of memory)",
                field="server.production_window",
                value=self.production_window,
            )
        if self.server_id:
            names.SERVER_ID.check(
                self.server_id, ConfigError, what="server.server_id", field="server.server_id", value=self.server_id
            )
        for field in ("preprocess_read_paths", "preprocess_write_paths"):
            relative = [p for p in getattr(self, field) if not os.path.isabs(p)]
            if relative:
                raise ConfigError(
                    f"server.{field}: {relative[0]!r} is not an absolute path",
                    field=f"server.{field}",
                    value=relative[0],
                )
        for name in self.preprocess_env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or name.upper().startswith("KSPEED_"):
                raise ConfigError(
                    f"server.preprocess_env: {name!r} is not a variable the preprocessing workers may get (a name; "
                    "KSPEED_ variables hold the server's secrets and are never passed)",
                    field="server.preprocess_env",
                    value=name,
                )
        self.weight_map()
        self.security.validate()

    def weight_map(self) -> dict[str, float]:
        """``preprocess_weights`` as job name -> weight.

        Raises:
            ConfigError: an entry that is not ``JOB=WEIGHT`` with a positive number.
        """
        weights = {}
        for entry in self.preprocess_weights:
            job, _, raw = entry.rpartition("=")
            try:
                weight = float(raw)
            except ValueError:
                weight = -1.0
            if not job or not math.isfinite(weight) or weight <= 0:
                raise ConfigError(
                    f"server.preprocess_weights: {entry!r} is not JOB=WEIGHT with a positive weight",
                    field="server.preprocess_weights",
                    value=entry,
                )
            weights[job] = weight
        return weights


@dataclasses.dataclass
class ClientConfig:
    """Configuration of the client library and the ``kspeed`` command."""

    manager: str = option("127.0.0.1:7070", "the manager's gRPC address", parse=parse_address, env="KSPEED_MANAGER")
    timeout: float = option(5.0, "deadline of control-plane calls", parse=parse_duration, env="KSPEED_TIMEOUT")
    security: SecurityConfig = dataclasses.field(default_factory=SecurityConfig)
    verbs_api: str = option(
        "pyverbs",
        "what the verbs rail drives: pyverbs, or module:attribute of another implementation of "
        "kspeed.rdma.verbs.api.VerbsApi (the tests' software double)",
        env="KSPEED_VERBS_API",
        metavar="API",
    )
    rail: str = option(
        "auto",
        "data-plane rail of the receive ring: auto (the most preferred rail that reaches every server: a "
        "shared-memory rail for co-located servers, a network rail otherwise) or a rail's name",
        parse=_parse_name,
        env="KSPEED_RAIL",
        metavar="RAIL",
    )
    ring_bytes: int = option(
        0, "size of each dataset's receive ring (0: max(256MiB, 4 batches))", parse=parse_bytes, env="KSPEED_RING_BYTES"
    )
    ring_max_bytes: int = option(
        0,
        "largest receive ring a dataset may allocate (0: a quarter of the memory available when it is made)",
        parse=parse_bytes,
        env="KSPEED_RING_MAX_BYTES",
    )
    completion_timeout: float = option(
        60.0,
        "longest a batch waits for a silent server before it counts as lost (failover reconnects it, "
        "or it is named in an error)",
        parse=parse_duration,
        env="KSPEED_COMPLETION_TIMEOUT",
    )
    failover_timeout: float = option(
        120.0,
        "longest the training loop waits, when a server is lost, for its share to move to another server",
        parse=parse_duration,
        env="KSPEED_FAILOVER_TIMEOUT",
    )
    data_host: str = option(
        "",
        "address the tcp receiver listens on and advertises (default: loopback when every "
        "server is local, else the local address that routes to the servers)",
        env="KSPEED_DATA_HOST",
        metavar="HOST",
    )
    nic: str = option(
        "",
        "force the data plane onto this NIC, e.g. mlx5_2 (an unknown NIC is an error; default: "
        "the NIC nearest this process's GPU)",
        env="KSPEED_NIC",
        metavar="NIC",
    )
    pin_threads: bool = option(
        True,
        "pin the client's helper threads to the cores of the NUMA node nearest the GPU",
        parse=_parse_bool,
        env="KSPEED_PIN_THREADS",
    )
    gpudirect: bool = option(
        True,
        "with device='cuda' on a rail that can (verbs), receive into GPU memory the NIC writes "
        "(GPUDirect RDMA); false: through the pinned host ring and one copy",
        parse=_parse_bool,
        env="KSPEED_GPUDIRECT",
    )
    job: str = option(
        "",
        "name of the training job, shared by its ranks, under which per-rank statistics are "
        "reported to the manager (e.g. $TORCHELASTIC_RUN_ID; empty: user@host)",
        env="KSPEED_JOB",
        metavar="NAME",
    )
    stats_interval: float = option(
        5.0,
        "how often each rank reports its statistics to the manager",
        parse=parse_duration,
        env="KSPEED_STATS_INTERVAL",
    )
    pacing: str = option(
        "auto",
        "keep the bytes in flight towards this node within a window measured from transfer "
        "latency and drain rate, granting in sub-batches: auto (on for network rails, off for shm), "
        "on or off",
        parse=_choice("auto", "on", "off"),
        env="KSPEED_PACING",
    )
    credit: str = option(
        "adaptive",
        "how the pacing window is shared between servers: adaptive (a server that is "
        "slower to complete is granted further ahead) or equal",
        parse=_choice("adaptive", "equal"),
        env="KSPEED_CREDIT",
    )
    node_loaders: int = option(
        0,
        "processes on this node loading data at once, which share its link (0: $LOCAL_WORLD_SIZE, else 1)",
        parse=_parse_int,
        env="KSPEED_NODE_LOADERS",
    )
    pace_round: float = option(
        0.003,
        "time one round of sub-batches over all servers should take at the measured "
        "drain rate (sets the sub-batch size)",
        parse=parse_duration,
        env="KSPEED_PACE_ROUND",
    )

    def loaders_on_node(self, environ: Mapping[str, str] | None = None) -> int:
        """:attr:`node_loaders`, or the launcher's ``LOCAL_WORLD_SIZE`` when it is 0."""
        if self.node_loaders > 0:
            return self.node_loaders
        environ = os.environ if environ is None else environ
        raw = environ.get("LOCAL_WORLD_SIZE", "")
        return int(raw) if raw.isdigit() and int(raw) > 0 else 1

    def validate(self) -> None:
        """Check cross-field rules. Clients send no token when none is configured."""
        if self.security.auth == "token" and not (self.security.token or self.security.token_file):
            self.security.auth = "none"
        if self.rail != "auto" and self.rail not in _rail_names():
            raise ConfigError(
                f"client.rail: unknown rail {self.rail!r}; use auto or one of {', '.join(_rail_names())}",
                field="client.rail",
                value=self.rail,
            )
        if not 0 < self.pace_round <= 1:
            raise ConfigError(
                f"client.pace_round must be between 0 and 1s, got {self.pace_round:g}s",
                field="client.pace_round",
                value=self.pace_round,
            )
        self.security.validate()


def _rail_names() -> list[str]:
    from kspeed.rdma.rails import rail_names  # the rails' registry is the one list of rail names

    return rail_names()


#: The variables :func:`launcher_environment` reads.
LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS",
)


def launcher_run_id(environ: Mapping[str, str] | None = None) -> str:
    """torchrun's ID of this run (``TORCHELASTIC_RUN_ID``), the same for every rank and across its
    restarts; empty outside torchrun."""
    environ = os.environ if environ is None else environ
    return environ.get("TORCHELASTIC_RUN_ID", "").strip()


def launcher_environment(environ: Mapping[str, str] | None = None) -> dict[str, int]:
    """The rank and world size a launcher (torchrun, PyTorch Lightning, SLURM wrappers) gave this
    process, read here.

    Returns the valid ones of ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``GROUP_RANK`` (torchrun's node rank), ``NODE_RANK`` (Lightning's), and Slurm's ``SLURM_PROCID``
    and ``SLURM_STEP_NUM_TASKS`` (set in an ``srun`` step) as integers (a value that is not a
    non-negative integer is left out).
    """
    environ = os.environ if environ is None else environ
    out = {}
    for name in LAUNCHER_VARIABLES:
        raw = environ.get(name, "").strip()
        if raw.isdigit():
            out[name] = int(raw)
    return out


def gpu_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that say which GPU this process uses (CUDA's and the launcher's, read here)."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LOCAL_RANK") if k in environ}


def usable_cores() -> int:
    """CPUs this process may run on: its affinity (``taskset``, a cgroup's cpuset), else every CPU.

    Read at each call, never at import: what sizes a pool follows the process's affinity when the
    pool is made, and a test can patch it.
    """
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):  # a platform without affinity (macOS)
        return os.cpu_count() or 1


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system) another process has used, from ``/proc``; 0 for one that is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


#: What every preprocessing worker is started with from the server's environment (when set).
PREPROCESS_ENVIRONMENT = ("PATH", "LANG", "LANGUAGE", "TZ", "LD_LIBRARY_PATH")


def preprocess_environment(names: Collection[str] = (), environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole environment of a preprocessing worker: :data:`PREPROCESS_ENVIRONMENT`, the ``LC_*``
    locale variables and the variables ``names`` (``server.preprocess_env``) the server has, never a
    ``KSPEED_`` one (the token and the backends' credentials come from there)."""
    environ = os.environ if environ is None else environ
    wanted = {*PREPROCESS_ENVIRONMENT, *names}
    return {
        k: v for k, v in environ.items() if (k in wanted or k.startswith("LC_")) and not k.upper().startswith("KSPEED_")
    }


_SECTIONS = {ManagerConfig: "manager", ServerConfig: "server", ClientConfig: "client"}


def setting(name: str) -> str:
    """How an operator sets the field ``name`` (``"security.token_file"``), for messages that say what to
    change: ``security.token_file (KSPEED_TOKEN_FILE, --token-file)``."""
    section, _, leaf = name.partition(".")
    classes: dict[str, type] = {"security": SecurityConfig, **{section: cls for cls, section in _SECTIONS.items()}}
    field = next(f for f in dataclasses.fields(classes[section]) if f.name == leaf)
    return f"{name} ({_env(field, section)}, --{leaf.replace('_', '-')})"


# ---------------------------------------------------------------------------------------------
# Loading


def _env(field: dataclasses.Field, section: str) -> str:
    """The field's environment variable (``{SECTION}`` filled in with the config's section)."""
    return str(field.metadata["env"]).replace("{SECTION}", section.upper())


def _set(obj: Any, field: dataclasses.Field, raw: object, section: str, source: str, sources: dict[str, str]) -> None:
    name = f"{section}.{field.name}"
    try:
        value = field.metadata["parse"](raw)
    except ValueError as exc:
        if field.metadata.get("secret"):  # credentials: the value is never shown, nor kept in the error
            shown, raw = f"of {len(str(raw))} characters (not shown: it holds credentials)", None
        else:
            shown = repr(raw)
        raise ConfigError(
            f"{name}: invalid value {shown} (from {source}): {exc}", field=name, value=raw, source=source
        ) from None
    setattr(obj, field.name, value)
    sources[name] = source


def _naming_sources(exc: ConfigError, sources: Mapping[str, str], names: Collection[str]) -> ConfigError:
    """``exc`` (raised by a ``validate``) with where each field it names got its value: the YAML
    file, the environment variable or the flag, or the default.

    A cross-field rule names several fields; the one to change may have come from anywhere.
    """
    message = str(exc)
    named = [n for n in names if n == exc.field or re.search(rf"(?<![\w.]){re.escape(n)}(?!\w)", message)]
    if not named:
        return exc
    origins = ", ".join(f"{n} from {sources[n]}" if n in sources else f"{n} is the default" for n in named)
    return ConfigError(
        f"{message} ({origins})",
        field=exc.field,
        value=exc.value,
        source=sources.get(exc.field or "") if exc.source is None else exc.source,
    )


def _leaf_fields(cls: type) -> list[tuple[str, dataclasses.Field]]:
    """Fields of a config, with nested sections flattened as (section attribute, field)."""
    out: list[tuple[str, dataclasses.Field]] = []
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(field.type) or field.name == "security":
            out.extend(("security", sub) for sub in dataclasses.fields(SecurityConfig))
        else:
            out.append(("", field))
    return out


def _read_yaml(path: str) -> Mapping[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    except OSError as exc:
        raise ConfigError(f"config file {path!r}: cannot read: {exc.strerror}", field="config", value=path) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path!r}: not valid YAML: {exc}", field="config", value=path) from exc
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {path!r}: expected a mapping of sections", field="config", value=path)
    return data


#: The fields every ``kspeed`` command that talks to a manager takes: where, how long, credentials.
CONNECTION_FIELDS = ("manager", "timeout", "auth", "token_file", "token", "tls_ca")


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, only: Collection[str] | None = None) -> None:
    """Add one ``--flag`` per config field (dashes for underscores) plus ``--config``.

    Args:
        parser: the parser to extend; the credentials go to their own ``security`` group.
        cls: the configuration the flags set (read back by :func:`load_config`).
        only: field names to offer (``security`` for every credential); default every field.
    """
    parser.add_argument("--config", metavar="FILE", help="YAML configuration file (env KSPEED_CONFIG)")
    security = parser.add_argument_group("security", "bearer token and TLS (the shared `security` section)")
    defaults = cls()
    for holder, field in _leaf_fields(cls):
        if only is not None and field.name not in only and (holder or field.name) not in only:
            continue
        metavar, show = _flag_style(field)
        default = getattr(defaults.security if holder else defaults, field.name)
        shown = f"; default {show(default)}" if default not in ("", (), {}) else ""
        (security if holder else parser).add_argument(
            "--" + field.name.replace("_", "-"),
            dest=f"cfg_{holder}_{field.name}",
            default=None,
            metavar=metavar,
            help=f"{field.metadata['help']} (env {_env(field, _SECTIONS[cls])}{shown})",
        )


def _flag_style(field: dataclasses.Field) -> tuple[str, Callable[[Any], str]]:
    """The field's metavar (its own, its choices, or its parser's) and how its default is shown."""
    parse = field.metadata["parse"]
    choices = getattr(parse, "choices", None)
    metavar, show = _FLAG_STYLE.get(parse, ("TEXT", str))
    if choices:
        metavar = "{" + ",".join(choices) + "}"
    return field.metadata["metavar"] or metavar, show


def load_config(
    cls: type[C],
    args: argparse.Namespace | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> C:
    """Build and validate a config: defaults, YAML file, environment, then flags.

    Args:
        cls: one of the config dataclasses.
        args: parsed flags from a parser prepared with :func:`add_arguments`.
        environ: the environment to read (default ``os.environ``).
        overrides: field values set last (``"security.auth"`` style names for nested fields).

    Raises:
        ConfigError: naming the field, the value and where it came from.
    """
    environ = os.environ if environ is None else environ
    section = _SECTIONS[cls]
    config: Any = cls()
    targets = {"": config, "security": config.security}
    sources: dict[str, str] = {}  # "section.field" -> where its value came from (none: the default)
    path = (getattr(args, "config", None) if args is not None else None) or environ.get("KSPEED_CONFIG", "")
    if path:
        data = _read_yaml(path)
        known = {section, "security"}
        for key in data:
            if key not in known | set(_SECTIONS.values()):
                raise ConfigError(
                    f"config file {path!r}: unknown section {key!r} (expected {sorted(known)})",
                    field=str(key),
                    value=path,
                )
        for holder, field in _leaf_fields(cls):
            block = data.get(holder or section) or {}
            if not isinstance(block, Mapping):
                raise ConfigError(
                    f"config file {path!r}: section {holder or section!r} must be a mapping",
                    field=holder or section,
                    value=path,
                )
            if field.name in block:
                _set(targets[holder], field, block[field.name], holder or section, f"config file {path}", sources)
        for holder in {section, "security"}:
            block = data.get(holder) or {}
            known_fields = {f.name for h, f in _leaf_fields(cls) if (h or section) == holder}
            unknown = sorted(set(block) - known_fields)
            if unknown:
                raise ConfigError(
                    f"config file {path!r}: unknown field(s) {', '.join(unknown)} in section {holder!r}",
                    field=f"{holder}.{unknown[0]}",
                    value=path,
                )
    for holder, field in _leaf_fields(cls):
        env = _env(field, section)
        if env and env in environ:
            _set(targets[holder], field, environ[env], holder or section, f"environment {env}", sources)
    if args is not None:
        for holder, field in _leaf_fields(cls):
            raw = getattr(args, f"cfg_{holder}_{field.name}", None)
            if raw is not None:
                _set(targets[holder], field, raw, holder or section, "--" + field.name.replace("_", "-"), sources)
    for name, raw in (overrides or {}).items():
        holder, _, leaf = name.rpartition(".")
        found = next((f for h, f in _leaf_fields(cls) if h == holder and f.name == leaf), None)
        if found is None:
            raise ConfigError(f"unknown configuration field {name!r}", field=name, value=raw)
        _set(targets[holder], found, raw, holder or section, "override", sources)
    try:
        config.validate()
    except ConfigError as exc:
        names = [f"{holder or section}.{field.name}" for holder, field in _leaf_fields(cls)]
        raise _naming_sources(exc, sources, names) from exc
    return config
