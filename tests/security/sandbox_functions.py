"""A user function that attacks the server running it, as an allowed preprocessing stage could.

:func:`attempts` tries everything a preprocessing worker must not do and returns, as its sample,
what happened to each try (JSON in :data:`OUTPUT`): the test reads the sample and checks that every
try was refused. Servers import this module only where their ``--preprocess-allow`` admits
``tests.security``.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import pickle
import socket
import stat
import struct
import subprocess
from collections.abc import Callable

import numpy as np

from kspeed.preprocess import Output

#: The attack's sample: its outcomes as JSON, zero-padded.
OUTPUT = Output(shape=(8192,), dtype="uint8")


def _try(action: Callable[[], object]) -> str:
    """``"refused: <error>"``, or ``"DONE: <what it got>"`` (any success is a breach)."""
    try:
        got = action()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"refused: {type(exc).__name__}: {exc}"[:200]
    return f"DONE: {got!r}"[:200]


def _found(token: str) -> str:
    if any(token in value for value in os.environ.values()):
        return "the token is in os.environ"
    with open("/proc/self/environ", "rb") as fh:
        if token.encode() in fh.read():
            return "the token is in /proc/self/environ"
    raise PermissionError("the token is not in this process's environment")


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(16)


def _write(path: str) -> str:
    with open(path, "r+b") as fh:
        fh.write(b"\xff" * 16)
    return "wrote 16 bytes"


def _map(path: str) -> str:
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, 4096) as region:
            region[:16] = b"\xff" * 16
    finally:
        os.close(fd)
    return "mapped it writable"


def _connect(address: str) -> str:
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=2):
        return f"connected to {address}"


def _shell() -> str:
    return subprocess.run(["/bin/sh", "-c", "id"], capture_output=True, timeout=10, check=False).stdout.decode()


def _system() -> str:
    status = os.system("id > /dev/null")
    if status != 0:
        raise PermissionError(f"os.system exited {status}")
    return "os.system ran a shell"


def _memory(pid: int) -> bytes:
    """16 bytes of the first readable mapping of process ``pid``."""
    with open(f"/proc/{pid}/maps") as maps:
        start = next(int(line.split("-")[0], 16) for line in maps if line.split()[1].startswith("r"))
    with open(f"/proc/{pid}/mem", "rb") as mem:
        mem.seek(start)
        return mem.read(16)


def _signal(pid: int) -> str:
    os.kill(pid, 0)
    return f"may signal process {pid}"


def attempts(
    x: object,
    rng: np.random.Generator,
    *,
    token: str,
    token_file: str,
    state_dir: str,
    pool_dir: str,
    region_file: str,
    manager: str,
    server_pid: int,
) -> np.ndarray:
    """Try each attack; return the outcomes as the sample (``x`` is ignored)."""
    outcomes = {
        "read the token from the environment": _try(lambda: _found(token)),
        "read the token file": _try(lambda: _read(token_file)),
        "list the state directory": _try(lambda: os.listdir(state_dir)),
        "list the pool directory": _try(lambda: os.listdir(pool_dir)),
        "read another dataset's region file": _try(lambda: _read(region_file)),
        "write another dataset's region file": _try(lambda: _write(region_file)),
        "map another dataset's region file writable": _try(lambda: _map(region_file)),
        "read the server's environment": _try(lambda: _read(f"/proc/{server_pid}/environ")),
        "read the server's memory": _try(lambda: _memory(server_pid)),
        "signal the server": _try(lambda: _signal(server_pid)),
        "connect to the manager": _try(lambda: _connect(manager)),
        "run a shell": _try(_shell),
        "run a shell with os.system": _try(_system),
        "read /etc/shadow": _try(lambda: _read("/etc/shadow")),
    }
    data = json.dumps({"uid": os.getuid(), "outcomes": outcomes}).encode()
    out = np.zeros(OUTPUT.nbytes, dtype=np.uint8)
    out[: len(data)] = np.frombuffer(data[: OUTPUT.nbytes], dtype=np.uint8)
    return out


class _Mkdir:
    """Pickled, it makes whoever loads it create a directory (what a forged reply would do to a
    server that unpickled it)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.mkdir, (self.path,))


def forge_reply(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Write on every socket this process holds (its connection to the server), before the
    worker's own reply, a frame whose payload is a pickle that creates the directory named by the
    sample's bytes (``x``); return 16 zeros."""
    payload = pickle.dumps(_Mkdir(bytes(x).decode()))
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                os.write(int(name), struct.pack("!i", len(payload)) + payload)
    return np.zeros(16, dtype=np.uint8)


def overreport(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Return 16 zeros; from its worker's next task on, report every result as a gigabyte long."""
    from kspeed.server.prep import worker as prep_worker

    def lying(runner: object, job: prep_worker.Job, scratch: np.ndarray) -> tuple[list, dict]:
        return [(1 << 30, None) for _ in job.samples], {}

    prep_worker._run = lying  # type: ignore[assignment]
    return np.zeros(16, dtype=np.uint8)


def outcomes(sample: np.ndarray) -> dict:
    """What :func:`attempts` reported in its sample."""
    return json.loads(bytes(sample).rstrip(b"\0"))
