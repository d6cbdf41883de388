"""Start-up plumbing shared by the daemons: state directory, ready file, stop signals, fatal errors."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import select
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from kspeed.errors import ConfigError, KSpeedError, StateError

if TYPE_CHECKING:
    from kspeed.config import DaemonConfig

DaemonConfigT = TypeVar("DaemonConfigT", bound="DaemonConfig")


def ensure_state_dir(path: str, field: str) -> str:
    """Create ``path`` if needed and check that it is writable.

    Raises:
        ConfigError: naming the field and the directory when it cannot be used.
    """
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{field}: cannot use {path!r} as a state directory: {exc.strerror}", field=field, value=path
        ) from exc
    return os.path.abspath(path)


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes an unprivileged user may still write on the file system of ``path`` (``None``: unknown)."""
    try:
        stat = os.statvfs(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def write_ready_file(path: str, payload: dict) -> None:
    """Atomically write the daemon's bound addresses for supervisors (``kspeed up``, tests)."""
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(payload, fh)
    os.replace(tmp, path)


class StopSignals:
    """SIGTERM and SIGINT, turned into a stop the main thread waits for.

    A Python signal handler runs on the main thread between two bytecodes, possibly while that
    thread holds a lock, such as a :class:`threading.Event`'s own inside ``Event.wait`` or another
    handler's ``Event.set``: a handler that sets an event can deadlock the process (a server sent
    two SIGTERMs in a row hung in its second handler). These handlers only note the signal; the
    interpreter's own C handler writes to a wakeup pipe that :meth:`wait` selects on. They stay
    installed for the life of the process (a signal during the shutdown is noted, not fatal);
    :meth:`close` restores the previous ones.

    Raises:
        StateError: not on the main thread.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise StateError("stop signals are set up on the main thread (Python runs signal handlers there)")
        self.received: list[int] = []  # appended by the handlers: no lock taken
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._previous_fd = signal.set_wakeup_fd(self._write)
        self._previous = {sig: signal.signal(sig, self._note) for sig in signals}

    def _note(self, signum: int, frame: object) -> None:
        self.received.append(signum)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a signal; whether one has come."""
        if not self.received:
            select.select([self._read], [], [], timeout)
            with contextlib.suppress(BlockingIOError):
                os.read(self._read, 4096)
        return bool(self.received)

    def close(self) -> None:
        """Restore the previous handlers and wakeup descriptor (tests; a daemon keeps these)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._read)
        os.close(self._write)


PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Get ``sig`` (default SIGTERM, a clean stop) when ``parent_pid``, the process that started
    us, exits.

    Supervisors (``kspeed up``, the test fixture) ask for this instead of setting it between fork
    and exec: a ``preexec_fn`` forces a plain fork of a process that may run gRPC, whose fork
    handlers can abort the child before it execs. A server's helper processes (feeders,
    preprocessing workers) ask for SIGKILL: nothing of a dead server may keep writing.
    """
    if not parent_pid:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before we asked
        os.kill(os.getpid(), sig)


def exit_with(pid: int, before: Callable[[], object] | None = None) -> None:
    """End this process when process ``pid`` ends, whichever process is our parent.

    ``PR_SET_PDEATHSIG`` follows the parent, and a forkserver's children have the forkserver for
    one, not the process that asked for them: a training process killed outright would leave
    them (and so the forkserver, which lives while they do) running for good. A daemon thread
    waits on ``pid``'s pidfd (or, where there is none, looks each second), then runs ``before``
    (its error ignored) and ends the process at once, whatever its other threads are doing.
    """
    try:
        fd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        _end_now(before)  # gone before we asked
        return
    except (AttributeError, OSError):  # no pidfd here (an old kernel, another system)
        fd = None
    threading.Thread(target=_await_end, args=(pid, fd, before), name="kspeed-exit-with", daemon=True).start()


def _await_end(pid: int, fd: int | None, before: Callable[[], object] | None) -> None:
    if fd is not None:
        select.select([fd], [], [])  # readable once the process has ended
    else:
        while process_running(pid):
            time.sleep(1.0)
    _end_now(before)


def process_running(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _end_now(before: Callable[[], object] | None) -> None:
    if before is not None:
        with contextlib.suppress(Exception):
            before()
    os._exit(0)


def run_main(prog: str, body: Callable[[], int | None]) -> int:
    """Run a daemon's body, turning KSpeed errors into one line on stderr and exit status 2."""
    try:
        return body() or 0
    except KSpeedError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def daemon_main(
    argv: list[str] | None,
    *,
    component: str,
    config_class: type[DaemonConfigT],
    description: str,
    serve: Callable[[DaemonConfigT], None],
) -> int:
    """The whole ``main`` of a daemon: flags, configuration, logging, then ``serve(config)``.

    Args:
        argv: the command line (default ``sys.argv[1:]``).
        component: ``manager`` or ``server``; the program is ``kspeed-<component>``.
        config_class: the daemon's configuration (its fields become the flags).
        description: the first line of ``--help``.
        serve: runs the daemon until it is stopped.
    """
    from kspeed._version import version_line
    from kspeed.config import add_arguments, load_config
    from kspeed.control.logs import LogSettings

    prog = f"kspeed-{component}"
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--version", action="version", version=version_line(prog))
    add_arguments(parser, config_class)
    args = parser.parse_args(argv)

    def body() -> None:
        config = load_config(config_class, args)
        LogSettings(config.log_level, config.log_format).apply(component)
        die_with_parent(config.parent_pid)
        serve(config)

    return run_main(prog, body)
