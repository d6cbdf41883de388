"""The manager's hard state in one SQLite file under its state directory.

Only durable facts live here: the cluster id and the server registry (identity, addresses,
inventory, last known state). Liveness timers are soft state and restart with the manager.
"""

from __future__ import annotations

import os
import sqlite3
import uuid
from collections.abc import Iterator

from kspeed.errors import ConfigError
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
"""
SCHEMA_VERSION = "1"


class Store:
    """SQLite-backed registry storage (one writer: the manager's event loop)."""

    def __init__(self, state_dir: str) -> None:
        self.path = os.path.join(state_dir, "manager.sqlite3")
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise ConfigError(
                f"manager.state_dir: cannot open {self.path!r}: {exc}", field="manager.state_dir", value=state_dir
            ) from exc
        version = self._get("schema_version")
        if version is None:
            self._put("schema_version", SCHEMA_VERSION)
        elif version != SCHEMA_VERSION:
            raise ConfigError(
                f"manager.state_dir: {self.path!r} has schema {version}, this build reads {SCHEMA_VERSION}",
                field="manager.state_dir",
                value=state_dir,
            )
        self.cluster_id = self._get("cluster_id") or self._put("cluster_id", uuid.uuid4().hex[:12])

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
        self._db.execute(
            "INSERT OR REPLACE INTO servers (id, record) VALUES (?, ?)", (record.id, record.SerializeToString())
        )

    def save_servers(self, records: list[kspeed_pb2.ServerRecord]) -> None:
        """Replace several records in one transaction."""
        with self._db:
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
        self._db.execute(
            "INSERT OR REPLACE INTO datasets (name, info) VALUES (?, ?)", (info.spec.name, info.SerializeToString())
        )

    def delete_dataset(self, name: str) -> None:
        """Forget a dataset and its leases."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM datasets WHERE name = ?", (name,))
            self._db.execute("DELETE FROM leases WHERE id LIKE ?", (f"{name}/%",))

    def leases(self) -> Iterator[kspeed_pb2.Lease]:
        """Every stored lease."""
        for (blob,) in self._db.execute("SELECT lease FROM leases ORDER BY id"):
            yield kspeed_pb2.Lease.FromString(blob)

    def save_lease(self, lease: kspeed_pb2.Lease) -> None:
        """Insert or replace one lease."""
        self._db.execute(
            "INSERT OR REPLACE INTO leases (id, lease) VALUES (?, ?)", (lease.id, lease.SerializeToString())
        )

    def delete_lease(self, lease_id: str) -> None:
        """Forget one lease."""
        self._db.execute("DELETE FROM leases WHERE id = ?", (lease_id,))

    def close(self) -> None:
        """Checkpoint and close the database."""
        self._db.close()
