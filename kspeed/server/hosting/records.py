"""The shares a server holds, recorded in its state directory for a restart to re-adopt.

A record is taken as a :class:`Snapshot` under the host's lock (serializing a few requests) and
written outside it: a write syncs the file, which takes seconds on a busy disk, and the host's lock
is what heartbeats, health and status calls need meanwhile. Snapshots are numbered as they are
taken and written in that order: one older than the file's is skipped, as the newer one already
says everything it would.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from kspeed.errors import StateFileError
from kspeed.proto import kspeed_pb2
from kspeed.server.memory.statefile import write_atomic

__all__ = ["ASSIGNMENTS_FILE", "AssignmentRecords", "Snapshot"]

log = logging.getLogger(__name__)

ASSIGNMENTS_FILE = "assignments.json"


@dataclass(frozen=True)
class Snapshot:
    """The hosted shares at one moment, ready to write."""

    number: int
    data: bytes


class AssignmentRecords:
    """The assignments file of one server."""

    def __init__(self, state_dir: str) -> None:
        self.path = os.path.join(state_dir, ASSIGNMENTS_FILE)
        self._writing = threading.Lock()
        self._taken = 0  # snapshots taken (the caller's lock orders them)
        self._written = 0  # the newest snapshot in the file

    def snapshot(self, requests: Iterable[kspeed_pb2.AssignShareRequest]) -> Snapshot:
        """The record of ``requests``; called under the lock that guards what they are."""
        self._taken += 1
        data = {f"{r.spec.name}@{r.share.first_id}": base64.b64encode(r.SerializeToString()).decode() for r in requests}
        return Snapshot(self._taken, json.dumps(data).encode())

    def write(self, snapshot: Snapshot) -> None:
        """Make ``snapshot`` (or a newer one) what the file says, durably.

        Raises:
            StateFileError: it cannot be written (the previous version stays).
        """
        with self._writing:
            if snapshot.number <= self._written:
                return
            write_atomic(self.path, snapshot.data)
            self._written = snapshot.number

    def record(self, snapshot: Snapshot) -> None:
        """:meth:`write`, where a file that cannot be written still lists shares let go since, which
        costs a restart nothing but re-adopting them until the manager says otherwise: the failure
        is logged, not raised."""
        try:
            self.write(snapshot)
        except StateFileError as exc:
            log.error("%s; it still lists shares this server has let go", exc)

    def load(self) -> list[kspeed_pb2.AssignShareRequest]:
        """The assignments recorded before a restart (an unreadable file is logged and read as none)."""
        try:
            with open(self.path, encoding="utf-8") as fh:
                data = json.load(fh)
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            log.error("ignoring unreadable %s: %s", self.path, exc)
            return []
        return [kspeed_pb2.AssignShareRequest.FromString(base64.b64decode(v)) for v in data.values()]
