"""What a server keeps on its own host between runs, and how an operator discards it.

Two things outlive a server process: its **state directory** (its identity, the cluster it belongs
to, the assignments of the shares it holds) and its **pool** (the region files, in tmpfs by
default), which a clean stop keeps so that a restart re-adopts the loaded data. A running server
locks its state directory: two servers never share one, and a purge never pulls it from under a
running server. A server retired for good (drained, or stopped and its shares moved elsewhere)
leaves both behind until ``kspeed server purge`` discards them.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from dataclasses import dataclass

from kspeed.config import ServerConfig
from kspeed.errors import ConfigError, StateError
from kspeed.server import inventory as inv
from kspeed.server.hosting.records import ASSIGNMENTS_FILE
from kspeed.server.memory.pool import discard_pool

log = logging.getLogger(__name__)

LOCK_FILE = "server.lock"
CLUSTER_FILE = "cluster_id"

__all__ = ["Purged", "StateLock", "pool_dir", "purge", "read_cluster_id", "stored_id", "write_cluster_id"]


class StateLock:
    """An exclusive lock on a server's state directory, held while the server runs.

    Raises:
        StateError: another process holds it (named by its pid).
        ConfigError: the lock file cannot be opened.
    """

    def __init__(self, state_dir: str) -> None:
        path = os.path.join(state_dir, LOCK_FILE)
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ConfigError(
                f"server.state_dir: cannot open {path!r}: {exc.strerror}", field="server.state_dir", value=state_dir
            ) from exc
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            raise StateError(
                f"server.state_dir {state_dir!r} is in use by a running server (pid {holder}); stop it first, or give "
                "this one its own state directory"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        """Unlock (the file stays: removing it would race with the next server taking it)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def pool_dir(config: ServerConfig, server_id: str, state_dir: str) -> str:
    """Where the pool's region files live: ``pool_dir``, else tmpfs named by server id, else the state directory."""
    if config.pool_dir:
        return config.pool_dir
    if os.path.isdir("/dev/shm"):
        return f"/dev/shm/kspeed-pool-{server_id}"
    return os.path.join(state_dir, "pool")


def read_cluster_id(state_dir: str) -> str:
    """The cluster this server last registered with ("" when it never did)."""
    try:
        with open(os.path.join(state_dir, CLUSTER_FILE), encoding="utf-8") as fh:
            return fh.read().strip()
    except FileNotFoundError:
        return ""
    except OSError as exc:
        log.warning("cannot read the cluster id in %s: %s", state_dir, exc.strerror)
        return ""


def write_cluster_id(state_dir: str, cluster_id: str) -> None:
    """Remember the cluster this server registered with (a full disk is logged: the id is sent again)."""
    path = os.path.join(state_dir, CLUSTER_FILE)
    try:
        with open(f"{path}.tmp", "w", encoding="utf-8") as fh:
            fh.write(cluster_id + "\n")
        os.replace(f"{path}.tmp", path)
    except OSError as exc:
        log.warning("cannot record cluster id %s in %s: %s", cluster_id, path, exc.strerror)


def stored_id(state_dir: str) -> str:
    """The identity kept in ``state_dir`` ("" for a server that never started there)."""
    try:
        with open(os.path.join(state_dir, inv.ID_FILE), encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError:
        return ""


@dataclass
class Purged:
    """What a purge discarded."""

    server_id: str
    pool_dir: str
    pool_bytes: int
    state_files: list[str]


def purge(config: ServerConfig) -> Purged:
    """Discard a stopped server's data: its pool files, the assignments of what it held and the
    cluster it belonged to (its identity stays). Run on the server's host with its configuration.

    Raises:
        StateError: the server is running.
    """
    state_dir = config.state_dir
    if not os.path.isdir(state_dir):
        raise ConfigError(
            f"server.state_dir {state_dir!r} does not exist: nothing to purge (is this the server's configuration?)",
            field="server.state_dir",
            value=state_dir,
        )
    lock = StateLock(state_dir)
    try:
        server_id = config.server_id or stored_id(state_dir)
        where = pool_dir(config, server_id, state_dir) if server_id or config.pool_dir else ""
        freed = discard_pool(where) if where else 0
        removed = []
        for name in (ASSIGNMENTS_FILE, CLUSTER_FILE):
            path = os.path.join(state_dir, name)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
    finally:
        lock.release()
    log.info(
        "server %s purged: pool %s (%d bytes), %s", server_id, where, freed, ", ".join(removed) or "no state files"
    )
    return Purged(server_id, where, freed, removed)
