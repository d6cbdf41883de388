"""The manager's hard state in one SQLite file under its state directory.

Only durable facts live here: the cluster id, the server registry (identity, addresses, inventory,
last known state), the datasets with their shares, the leases, the names of removed datasets, and
the offload decisions jobs settled on (:mod:`kspeed.manager.tunings`).
Liveness timers are soft state and restart with the manager.

The file is the registry's owner, not its only copy: every server keeps the assignments of the
shares it holds, each with the dataset as the registry recorded it. A missing or empty file starts a
registry whose cluster id is **provisional** until a server that holds data brings the cluster's own
(the registry is then rebuilt from what the servers report, :mod:`kspeed.manager.datasets`) or this
manager registers a dataset itself. A damaged file is refused with the command that rebuilds it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator

from kspeed.control.daemon import free_bytes
from kspeed.control.status import human_bytes
from kspeed.errors import ConfigError, StateFileError
from kspeed.proto import kspeed_pb2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS servers (
    id TEXT PRIMARY KEY,
    record BLOB NOT NULL          -- a serialized kspeed.v1.ServerRecord
);
CREATE TABLE IF NOT EXISTS datasets (
    name TEXT PRIMARY KEY,
    info BLOB NOT NULL            -- a serialized kspeed.v1.DatasetInfo (spec, owner, fingerprint, shares)
);
CREATE TABLE IF NOT EXISTS leases (
    id TEXT PRIMARY KEY,
    lease BLOB NOT NULL           -- a serialized kspeed.v1.Lease
);
CREATE TABLE IF NOT EXISTS removed (
    name TEXT PRIMARY KEY,
    removed_unix REAL NOT NULL    -- when the dataset was removed: a server's older copy is not taken back
);
CREATE TABLE IF NOT EXISTS tunings (
    key TEXT PRIMARY KEY,         -- pipeline, model and servers (kspeed.manager.tunings)
    record BLOB NOT NULL,         -- a serialized kspeed.v1.TuningRecord
    updated_unix REAL NOT NULL
);
"""
SCHEMA_VERSION = "1"
STATE_FILE = "manager.sqlite3"
MAX_REMOVED = 10_000  # names of removed datasets remembered (the oldest are forgotten first)
UNSAVED_LOG_EVERY = 60.0  # seconds between two log lines about registry writes that fail

log = logging.getLogger(__name__)


class Store:
    """SQLite-backed registry storage (one writer: the manager's event loop).

    Args:
        state_dir: the manager's state directory.
        rebuild: a damaged state file is moved aside (``<file>.damaged-<time>``) and a fresh
            registry started, to be rebuilt from the servers, instead of refusing to start.

    Raises:
        ConfigError: the file cannot be opened, is damaged (with the command that rebuilds it) or
            has another schema.
    """

    def __init__(self, state_dir: str, *, rebuild: bool = False) -> None:
        self.path = os.path.join(state_dir, STATE_FILE)
        try:
            self._db = self._open()
        except sqlite3.OperationalError as exc:  # not there to be opened (a directory, permissions, a full disk)
            raise ConfigError(
                f"manager.state_dir: cannot open {self.path!r}: {exc}", field="manager.state_dir", value=state_dir
            ) from exc
        except sqlite3.DatabaseError as exc:  # opened, and not a sound registry
            if not rebuild:
                raise ConfigError(
                    f"manager.state_dir: {self.path!r} is damaged ({exc}). The servers keep the assignments of what "
                    "they hold: start the manager once with --rebuild-state true (KSPEED_REBUILD_STATE=true) to move "
                    "the damaged file aside and rebuild the registry from them",
                    field="manager.state_dir",
                    value=state_dir,
                ) from exc
            aside = f"{self.path}.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(self.path + suffix):
                    os.replace(self.path + suffix, aside + suffix)
            log.warning(
                "state file %s was damaged (%s); moved aside to %s, rebuilding from the servers", self.path, exc, aside
            )
            try:
                self._db = self._open()
            except sqlite3.Error as again:
                raise ConfigError(
                    f"manager.state_dir: cannot open {self.path!r}: {again}", field="manager.state_dir", value=state_dir
                ) from again
        version = self._get("schema_version")
        if version is None:
            self._put("schema_version", SCHEMA_VERSION)
        elif version != SCHEMA_VERSION:
            raise ConfigError(
                f"manager.state_dir: {self.path!r} has schema {version}, this build reads {SCHEMA_VERSION}",
                field="manager.state_dir",
                value=state_dir,
            )
        cluster_id = self._get("cluster_id")
        if cluster_id is None:
            cluster_id = self._put("cluster_id", uuid.uuid4().hex[:12])
            self._put("cluster_id_provisional", "1")
        self.cluster_id = cluster_id
        self.write_failures = 0  # registry writes that failed (a full disk): the manager went on from memory
        self._failure_logged = -UNSAVED_LOG_EVERY

    def keep(self, write: Callable[[], None]) -> bool:
        """Run ``write``, whose failure must not stop the manager: it goes on from what it holds in
        memory (the servers keep their records too), and the failure is counted and logged (at most
        once a minute). Returns whether it was written."""
        try:
            write()
        except StateFileError as exc:
            self.write_failures += 1
            if time.monotonic() - self._failure_logged >= UNSAVED_LOG_EVERY:
                self._failure_logged = time.monotonic()
                log.error("%s (%d write(s) failed so far)", exc, self.write_failures)
            return False
        return True

    def _open(self) -> sqlite3.Connection:
        """Connect, check the file's integrity and create the tables.

        Raises:
            sqlite3.DatabaseError: the file is not a database, or a damaged one.
        """
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            (verdict,) = db.execute("PRAGMA quick_check").fetchone()
            if verdict != "ok":
                raise sqlite3.DatabaseError(f"integrity check: {verdict}")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
        except sqlite3.Error:
            db.close()
            raise
        return db

    @property
    def provisional(self) -> bool:
        """Whether the cluster id was made up by this registry and may still give way to the
        cluster id of servers that hold data (the registry was empty or missing at start)."""
        return self._get("cluster_id_provisional") == "1"

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Turn a failed write of the registry into :class:`~kspeed.errors.StateFileError` naming
        the file and the space left (SQLite keeps the file whole: the transaction is undone)."""
        try:
            yield
        except sqlite3.Error as exc:
            free = free_bytes(self.path)
            left = f"{human_bytes(free)} free there" if free is not None else "free space unknown"
            raise StateFileError(
                f"cannot write the registry {self.path}: {exc} ({left}); free space there (the manager goes on from "
                "what it holds in memory and records it at the next change that fits)",
                path=self.path,
                free_bytes=free,
            ) from exc

    def take_cluster_id(self, cluster_id: str) -> None:
        """Make ``cluster_id`` (brought by a server that holds data) the registry's, for good."""
        with self._writing(), self._db:
            self._db.execute("BEGIN")
            self._put("cluster_id", cluster_id)
            self._db.execute("DELETE FROM meta WHERE key = 'cluster_id_provisional'")
        self.cluster_id = cluster_id

    def confirm_cluster_id(self) -> None:
        """Keep the registry's own cluster id for good (it registered a dataset)."""
        with self._writing():
            self._db.execute("DELETE FROM meta WHERE key = 'cluster_id_provisional'")

    def _get(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def _put(self, key: str, value: str) -> str:
        self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))
        return value

    def servers(self) -> Iterator[kspeed_pb2.ServerRecord]:
        """Every stored server record."""
        for (blob,) in self._db.execute("SELECT record FROM servers ORDER BY id"):
            yield kspeed_pb2.ServerRecord.FromString(blob)

    def save_server(self, record: kspeed_pb2.ServerRecord) -> None:
        """Insert or replace one server record."""
        with self._writing():
            self._db.execute(
                "INSERT OR REPLACE INTO servers (id, record) VALUES (?, ?)", (record.id, record.SerializeToString())
            )

    def save_servers(self, records: list[kspeed_pb2.ServerRecord]) -> None:
        """Replace several records in one transaction."""
        with self._writing(), self._db:
            self._db.execute("BEGIN")
            self._db.executemany(
                "INSERT OR REPLACE INTO servers (id, record) VALUES (?, ?)",
                [(r.id, r.SerializeToString()) for r in records],
            )

    def datasets(self) -> Iterator[kspeed_pb2.DatasetInfo]:
        """Every stored dataset."""
        for (blob,) in self._db.execute("SELECT info FROM datasets ORDER BY name"):
            yield kspeed_pb2.DatasetInfo.FromString(blob)

    def save_dataset(self, info: kspeed_pb2.DatasetInfo) -> None:
        """Insert or replace one dataset."""
        with self._writing():
            self._db.execute(
                "INSERT OR REPLACE INTO datasets (name, info) VALUES (?, ?)", (info.spec.name, info.SerializeToString())
            )

    def delete_dataset(self, name: str, removed_unix: float) -> None:
        """Forget a dataset and its leases, remembering when it was removed."""
        with self._writing(), self._db:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM datasets WHERE name = ?", (name,))
            self._db.execute("DELETE FROM leases WHERE id LIKE ?", (f"{name}/%",))
            self._db.execute("INSERT OR REPLACE INTO removed (name, removed_unix) VALUES (?, ?)", (name, removed_unix))
            self._db.execute(
                "DELETE FROM removed WHERE name NOT IN (SELECT name FROM removed ORDER BY removed_unix DESC LIMIT ?)",
                (MAX_REMOVED,),
            )

    def removed_at(self, name: str) -> float | None:
        """When a dataset of this name was last removed (None: never, as far as this registry knows)."""
        row = self._db.execute("SELECT removed_unix FROM removed WHERE name = ?", (name,)).fetchone()
        return float(row[0]) if row else None

    def leases(self) -> Iterator[kspeed_pb2.Lease]:
        """Every stored lease."""
        for (blob,) in self._db.execute("SELECT lease FROM leases ORDER BY id"):
            yield kspeed_pb2.Lease.FromString(blob)

    def save_lease(self, lease: kspeed_pb2.Lease) -> None:
        """Insert or replace one lease."""
        with self._writing():
            self._db.execute(
                "INSERT OR REPLACE INTO leases (id, lease) VALUES (?, ?)", (lease.id, lease.SerializeToString())
            )

    def delete_lease(self, lease_id: str) -> None:
        """Forget one lease."""
        with self._writing():
            self._db.execute("DELETE FROM leases WHERE id = ?", (lease_id,))

    def tunings(self) -> Iterator[tuple[str, kspeed_pb2.TuningRecord]]:
        """Every kept offload decision with its key, the most recent last."""
        for key, blob in self._db.execute("SELECT key, record FROM tunings ORDER BY updated_unix"):
            yield key, kspeed_pb2.TuningRecord.FromString(blob)

    def save_tuning(self, key: str, record: kspeed_pb2.TuningRecord, keep: int) -> None:
        """Insert or replace one offload decision, keeping the ``keep`` most recent."""
        with self._writing(), self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT OR REPLACE INTO tunings (key, record, updated_unix) VALUES (?, ?, ?)",
                (key, record.SerializeToString(), record.updated_unix),
            )
            self._db.execute(
                "DELETE FROM tunings WHERE key NOT IN (SELECT key FROM tunings ORDER BY updated_unix DESC LIMIT ?)",
                (keep,),
            )

    def close(self) -> None:
        """Checkpoint and close the database."""
        self._db.close()
