"""The cluster's membership as the manager's ``WatchMembership`` stream tells it, kept current.

A client learns that a server was declared failed, or that a new one is ready, the moment the
manager decides it, without asking: one background thread follows the stream, resuming from the
last revision it saw after the stream breaks (a manager restart: at most a second between tries),
and keeps the latest record of every server. Readers never wait on the network.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from kspeed.control.lifecycle import SERVING
from kspeed.errors import KSpeedError
from kspeed.proto import kspeed_pb2

__all__ = ["MembershipWatch"]

log = logging.getLogger(__name__)

MAX_BACKOFF = 1.0  # longest pause between attempts to follow the stream again


class MembershipWatch:
    """Follows ``WatchMembership`` in a daemon thread.

    Args:
        watch: opens the stream from a revision (0: a snapshot first); returns its events and a
            function that cancels it (:meth:`ManagerClient.watch_membership
            <kspeed.control.manager_client.ManagerClient.watch_membership>`).
    """

    def __init__(self, watch: Callable[[int], tuple[Iterator[kspeed_pb2.MembershipEvent], Callable[[], Any]]]) -> None:
        self._watch = watch
        self._records: dict[str, kspeed_pb2.ServerRecord] = {}
        self.revision = 0
        self.synced = False  # a snapshot arrived (until then nothing is known)
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._cancel: Callable[[], Any] | None = None
        self._thread = threading.Thread(target=self._run, name="kspeed-membership", daemon=True)
        self._thread.start()

    def state(self, server_id: str) -> int | None:
        """The server's state (``kspeed_pb2.ServerState``), or ``None`` when it is not known."""
        with self._changed:
            record = self._records.get(server_id)
            return record.state if record is not None else None

    def incarnation(self, server_id: str) -> int | None:
        """The server's incarnation (it bumps when the server registers again), or ``None`` when it is not known."""
        with self._changed:
            record = self._records.get(server_id)
            return record.incarnation if record is not None else None

    def ready(self) -> dict[str, str]:
        """Server id -> address of every server that serves data (ready, or draining)."""
        with self._changed:
            return {r.id: r.address for r in self._records.values() if r.state in SERVING}

    def wait(self, revision: int, timeout: float) -> int:
        """Wait up to ``timeout`` for a revision after ``revision``; returns the current one."""
        with self._changed:
            self._changed.wait_for(lambda: self.revision != revision or self._stop.is_set(), timeout)
            return self.revision

    def close(self) -> None:
        """Stop following the stream."""
        self._stop.set()
        cancel = self._cancel
        if cancel is not None:
            cancel()
        with self._changed:
            self._changed.notify_all()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                events, self._cancel = self._watch(self.revision)
                for event in events:
                    self._apply(event)
                    backoff = 0.1
            except KSpeedError as exc:
                if not self._stop.is_set():
                    log.debug("membership watch broke (%s); following it again in %.1fs", exc, backoff)
            self._cancel = None
            self._stop.wait(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)

    def _apply(self, event: kspeed_pb2.MembershipEvent) -> None:
        with self._changed:
            if event.snapshot:
                self._records = {r.id: r for r in event.servers}
                self.synced = True
            else:
                for record in event.servers:
                    self._records[record.id] = record
            self.revision = event.revision
            self._changed.notify_all()
