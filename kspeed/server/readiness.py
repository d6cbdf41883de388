"""Why a registered server is not becoming ready, told in the server's own log.

The manager moves a server from JOINING to READY once its health probe of the announced address
succeeds, and to SUSPECT when probes keep failing. A manager that cannot reach that address keeps
answering the server's heartbeats, so the server would serve on, never ready, and say nothing. The
state comes back in every heartbeat reply, and the server sees the probes that do reach it: when
it stays short of READY for a while, :class:`ReadinessWatch` logs what the server knows (whether
any probe arrived, the address it announced and why) and the setting that changes it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from grpc_health.v1 import health

from kspeed.control.status import state_name
from kspeed.proto import kspeed_pb2
from kspeed.server.announce import ADVERTISE, Announced

__all__ = ["PATIENCE_BEATS", "ProbedHealth", "ReadinessWatch"]

log = logging.getLogger(__name__)

READY = kspeed_pb2.ServerState.SERVER_STATE_READY
#: Heartbeat intervals a server may stay short of READY before it says why: the manager probes a
#: server as soon as it registers and then every probe interval (twice the heartbeat by default).
PATIENCE_BEATS = 10


class ReadinessWatch:
    """Follows the state the manager reports in heartbeat replies and the health probes received.

    Args:
        manager: the manager's address, for messages.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, manager: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._manager = manager
        self._clock = clock
        self._lock = threading.Lock()
        self.announced: Announced | None = None
        self._probes = 0
        self._last_probe: float | None = None
        self._since: float | None = None  # first reply short of READY since the last READY one
        self._probes_then = 0
        self._warned = False

    def probed(self) -> None:
        """A health check arrived (the manager's probe, or anyone's)."""
        with self._lock:
            self._probes += 1
            self._last_probe = self._clock()

    def observe(self, state: kspeed_pb2.ServerState, interval: float) -> None:
        """A heartbeat reply said the manager has this server in ``state``; heartbeats go every ``interval`` s."""
        now = self._clock()
        with self._lock:
            if state == READY:
                if self._warned:
                    log.info("the manager at %s has this server ready now", self._manager)
                self._since, self._warned = None, False
                return
            if self._since is None:
                self._since, self._probes_then = now, self._probes
            waited = now - self._since
            if self._warned or waited < PATIENCE_BEATS * interval:
                return
            self._warned = True
            log.warning("%s", self._explain(state_name(state), waited))

    def _explain(self, state: str, waited: float) -> str:
        announced = self.announced
        where = f"{announced.address} ({announced.how})" if announced is not None else "its announced address"
        head = (
            f"the manager at {self._manager} has had this server {state} for {waited:.0f}s although it answers "
            "its heartbeats"
        )
        if self._probes == self._probes_then:
            return (
                f"{head}: no health probe has reached this server since, so the manager cannot connect to "
                f"{where}. Make that address reachable from the manager's host, or set {ADVERTISE} to one "
                "that is (the clients dial it too)"
            )
        ago = self._clock() - self._last_probe if self._last_probe is not None else 0.0
        return (
            f"{head}: {self._probes - self._probes_then} health probe(s) reached this server since (the last "
            f"{ago:.0f}s ago) at {where}; `kspeed status` shows the manager's reason"
        )


class ProbedHealth(health.HealthServicer):
    """``grpc.health.v1`` that tells ``on_check`` of every ``Check`` it answers."""

    def __init__(self, on_check: Callable[[], None]) -> None:
        super().__init__()
        self._on_check = on_check

    def Check(self, request: Any, context: Any) -> Any:
        self._on_check()
        return super().Check(request, context)
