"""The shares a server holds, recorded in its state directory for a restart to re-adopt.

A record is taken as a :class:`~kspeed.server.memory.statefile.Snapshot` under the host's lock
(serializing a few requests) and written outside it, in the order taken
(:class:`~kspeed.server.memory.statefile.OrderedFile`): a write syncs the file, and the host's lock
is what heartbeats, health and status calls need meanwhile.
"""

from __future__ import annotations

import base64
import json
import logging
import os
from collections.abc import Iterable

from kspeed.errors import StateFileError
from kspeed.proto import kspeed_pb2
from kspeed.server.memory.statefile import OrderedFile, Snapshot

__all__ = ["ASSIGNMENTS_FILE", "AssignmentRecords"]

log = logging.getLogger(__name__)

ASSIGNMENTS_FILE = "assignments.json"


class AssignmentRecords:
    """The assignments file of one server."""

    def __init__(self, state_dir: str) -> None:
        self.path = os.path.join(state_dir, ASSIGNMENTS_FILE)
        self._file = OrderedFile(self.path)

    def snapshot(self, requests: Iterable[kspeed_pb2.AssignShareRequest]) -> Snapshot:
        """The record of ``requests``; called under the lock that guards what they are."""
        data = {f"{r.spec.name}@{r.share.first_id}": base64.b64encode(r.SerializeToString()).decode() for r in requests}
        return self._file.snapshot(json.dumps(data).encode())

    def write(self, snapshot: Snapshot) -> None:
        """Make ``snapshot`` (or a newer one) what the file says, durably.

        Raises:
            StateFileError: it cannot be written (the previous version stays).
        """
        self._file.write(snapshot)

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
