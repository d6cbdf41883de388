"""The sandbox of the preprocessing workers, where operator-allowed user code runs.

A worker confines itself (:func:`confine`) before it imports any pipeline module, with every
mechanism the host offers, each covering for another's absence:

=========================  =====================================  ================================
what the worker must not   root server                            unprivileged server
=========================  =====================================  ================================
read the token, the state  its own user (``preprocess_user``),    Landlock: only the Python
dir, the pool, the         Landlock                               installation, the allowed
server's memory                                                   modules and the operator's paths
reach the network          a network namespace, seccomp           seccomp (and Landlock's TCP rules)
start a program (a shell)  seccomp, Landlock                      seccomp, Landlock
write anywhere             its own user, Landlock                 Landlock
=========================  =====================================  ================================

The environment is never inherited (the server starts a worker with a few named variables, see
:mod:`kspeed.server.prep.workers`) and the worker maps no pool or window memory: its inputs and
outputs pass through a scratch segment of its own, which the server copies.

What is in force is then tested, not assumed (:func:`probe`): as the worker, try to read each
protected path (the token file, the state directory, the pool), the server's environment and
memory through ``/proc``, to open a TCP connection to the manager and to start a shell. A
:class:`Confinement` reports the mechanisms in force, those missing and why, and whatever the worker
could still reach. With ``preprocess_sandbox: required`` (the default) a worker that could reach
anything refuses to run pipelines, and the error names what it reached and what to change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import socket
import sys
from collections.abc import Sequence

import kspeed
from kspeed.errors import ConfigError
from kspeed.server.prep.sandbox import identity, landlock, seccomp

__all__ = ["MODES", "Confinement", "SandboxPolicy", "check_policy", "confine", "import_paths", "probe", "worker_user"]

#: ``required``: a worker that could reach anything protected runs no pipeline; ``best-effort``:
#: it runs them, and the server logs what it could reach; ``off``: no confinement (debugging only).
MODES = ("required", "best-effort", "off")
#: What every worker may read besides its imports: shared libraries and their cache, time zones,
#: users and groups (for names in messages), what numeric libraries ask about the CPUs.
SYSTEM_READ = (
    "/usr", "/lib", "/lib64", "/lib32", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d",
    "/etc/localtime", "/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/proc/self", "/proc/cpuinfo",
    "/proc/meminfo", "/sys/devices/system/cpu", "/sys/devices/system/node", "/sys/fs/cgroup",
    "/dev/urandom", "/dev/random", "/dev/zero",
)  # fmt: skip
#: What every worker may write: nothing but the null device.
SYSTEM_WRITE = ("/dev/null",)


@dataclasses.dataclass(frozen=True)
class SandboxPolicy:
    """How the preprocessing workers of a server are confined (from the server's configuration).

    Attributes:
        mode: one of :data:`MODES`.
        user: the user the workers become when the server runs as root (a name or ``uid[:gid]``;
            empty: ``nobody``).
        network: the workers may open network sockets.
        read: paths the workers may read besides their imports and :data:`SYSTEM_READ`.
        write: paths the workers may read and write.
        protected: paths the workers must not reach (the token file, the state directory, the
            pool directory and a region file in it); each is tried by :func:`probe`.
        server_pid: the server's process (its ``/proc`` entries are tried too).
        manager: ``host:port`` of the manager, tried as the network probe.
    """

    mode: str = "required"
    user: str = ""
    network: bool = False
    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    protected: tuple[str, ...] = ()
    server_pid: int = 0
    manager: str = ""


@dataclasses.dataclass
class Confinement:
    """What a worker's confinement achieved, as it reports it to the server.

    Attributes:
        mechanisms: those in force (``"landlock ABI 7"``, ``"seccomp"``, the user, the namespaces).
        missing: those that could not be used, each with why.
        reachable: what the worker could still reach of what it must not (empty: confined).
    """

    mechanisms: list[str] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)
    reachable: list[str] = dataclasses.field(default_factory=list)

    def verdict(self, mode: str) -> str:
        """Why a worker in ``mode`` must refuse to run pipelines, or ``""``."""
        if mode != "required" or not self.reachable:
            return ""
        missing = f"; missing: {'; '.join(self.missing)}" if self.missing else ""
        return (
            f"the preprocessing sandbox is incomplete: a worker could {', '.join(self.reachable)}{missing}. "
            "Run the server as root (the workers then become server.preprocess_user), or allow Landlock and "
            "seccomp to the server (systemd: SystemCallFilter=@sandbox where the unit's filter refuses them), "
            "or accept it with server.preprocess_sandbox: best-effort"
        )

    def to_dict(self) -> dict[str, list[str]]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> Confinement:
        """Read a worker's report, keeping only lists of strings (it comes from an untrusted process).

        Raises:
            ValueError: not a report.
        """
        if not isinstance(data, dict):
            raise ValueError("not a confinement report")
        fields = {}
        for name in ("mechanisms", "missing", "reachable"):
            items = data.get(name, [])
            if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
                raise ValueError(f"confinement report: {name} is not a list of strings")
            fields[name] = [item[:500] for item in items[:64]]
        return cls(**fields)


def import_paths(path: Sequence[str], protected: Sequence[str]) -> list[str]:
    """The directories a worker imports from: absolute entries of ``path`` (``sys.path``), the
    Python prefixes and KSpeed's own package (which an editable install keeps outside them),
    without any that would open a protected path (the working directory, ``/``)."""
    package = os.path.dirname(os.path.abspath(kspeed.__file__))
    candidates = [*path, sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, os.path.dirname(package)]
    kept: list[str] = []
    for entry in candidates:
        if not entry or not os.path.isabs(entry) or entry in kept:
            continue
        real = os.path.realpath(entry)
        if any(_within(os.path.realpath(p), real) for p in protected) or real == os.sep:
            continue
        kept.append(entry)
    return kept


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def confine(policy: SandboxPolicy, imports: Sequence[str]) -> Confinement:
    """Confine this process (a preprocessing worker, before any user code) as ``policy`` says,
    reading ``imports``; then :func:`probe` it. A step that fails leaves the process as it was for
    that step and is reported missing; the identity switch is all or nothing (if it fails after
    the namespaces, the process exits rather than run as root).
    """
    report = Confinement()
    if policy.mode == "off":
        report.missing.append("sandbox: off (server.preprocess_sandbox)")
        report.reachable.extend(probe(policy))
        return report
    read = [*SYSTEM_READ, *imports, *policy.read]
    write = [*SYSTEM_WRITE, *policy.write]
    user = worker_user(policy)
    if user is not None:
        try:
            report.mechanisms.extend(identity.become(user, network=policy.network, read=read, write=write))
        except OSError as exc:
            print(f"preprocessing worker: cannot become {user}: {exc}", file=sys.stderr, flush=True)
            os._exit(70)  # (half switched: never run user code so)
    else:
        report.missing.append(f"user: the server runs as uid {os.geteuid()}, not root: the workers keep its user")
    _no_new_privs()
    try:
        abi = landlock.restrict(read, write, network=policy.network)
        report.mechanisms.append(f"landlock ABI {abi}")
    except OSError as exc:
        report.missing.append(f"landlock: {exc.strerror}")
    try:
        seccomp.install(network=policy.network)
        report.mechanisms.append("seccomp" + ("" if policy.network else " (sockets: AF_UNIX only)"))
    except OSError as exc:
        report.missing.append(f"seccomp: {exc.strerror}")
    report.reachable.extend(probe(policy))
    return report


def _no_new_privs() -> None:
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


def probe(policy: SandboxPolicy) -> list[str]:
    """Try, as this process, what a worker must not do; a description of each that succeeded."""
    reached = []
    for path in policy.protected:
        what = _reach(path)
        if what:
            reached.append(f"{what} {path}")
    if policy.server_pid:
        for name in ("environ", "mem"):
            path = f"/proc/{policy.server_pid}/{name}"
            with contextlib.suppress(OSError), open(path, "rb") as fh:
                fh.read(1)
                reached.append(f"read the server's {path}")
    if not policy.network and policy.manager and _connects(policy.manager):
        reached.append(f"connect to the manager at {policy.manager}")
    if _starts_shell():
        reached.append("start a shell (/bin/sh)")
    return reached


def _reach(path: str) -> str:
    """How ``path`` can be reached: ``"write"``, ``"read"``, ``"list"``, or ``""``."""
    if os.path.isdir(path):
        try:
            os.listdir(path)
        except OSError:
            return ""
        return "list"
    for flags, what in ((os.O_RDWR, "write"), (os.O_RDONLY, "read")):
        try:
            os.close(os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW))
        except OSError:
            continue
        return what
    return ""


def _connects(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


def _starts_shell() -> bool:
    try:
        pid = os.posix_spawn("/bin/sh", ["sh", "-c", "exit 0"], {})
    except OSError as exc:
        return exc.errno not in (errno.EPERM, errno.EACCES, errno.ENOSYS, errno.ENOENT)
    os.waitpid(pid, 0)
    return True


def worker_user(policy: SandboxPolicy) -> identity.User | None:
    """The user the workers become (``None``: they keep the server's, which is not root or unconfined).

    Raises:
        ConfigError: the preprocessing user does not exist or is root.
    """
    if policy.mode == "off" or os.geteuid() != 0:
        return None
    return identity.resolve_user(policy.user or "nobody")


def check_policy(policy: SandboxPolicy) -> None:
    """Check a policy in the server before any worker starts (a bad user is a configuration error).

    Raises:
        ConfigError: an unknown mode, or a preprocessing user that does not exist or is root.
    """
    if policy.mode not in MODES:
        raise ConfigError(
            f"server.preprocess_sandbox: {policy.mode!r} is not one of {', '.join(MODES)}",
            field="server.preprocess_sandbox",
            value=policy.mode,
        )
    worker_user(policy)
