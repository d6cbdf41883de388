"""Keeps a job's dataset lease alive from a small daemon thread, and ends it on close.

A job's dataset lives while some lease on it does; the lease expires unless renewed, so a crashed
job frees the servers' memory on its own. Renewal runs every third of the TTL; a manager that is
down for a while is tolerated (training keeps going, the data plane does not need it) and the
failure is logged, not raised.
"""

from __future__ import annotations

import logging
import threading

from kspeed.errors import KSpeedError, NotFoundError

__all__ = ["LeaseKeeper"]

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Renews one lease every ``ttl / 3`` seconds until :meth:`close`.

    Args:
        manager: a ``kspeed.control.manager_client.ManagerClient``.
        lease_id: the lease to keep.
        ttl: its time to live in seconds.
    """

    def __init__(self, manager, lease_id: str, ttl: float) -> None:
        self.lease_id = lease_id
        self.renewals = 0
        self._manager = manager
        self._interval = max(ttl / 3.0, 0.05)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kspeed-lease-{lease_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._manager.renew_lease(self.lease_id)
                self.renewals += 1
            except NotFoundError as exc:
                log.error(
                    "lease %s is gone (%s); the dataset may be removed while this job uses it", self.lease_id, exc
                )
                return
            except KSpeedError as exc:
                log.warning("lease %s: renewal failed, will retry in %.1fs: %s", self.lease_id, self._interval, exc)

    def close(self) -> None:
        """Stop renewing and release the lease (a manager that is down is logged, not raised)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self._manager.release_lease(self.lease_id)
        except KSpeedError as exc:
            log.warning("lease %s: release failed (it will expire on its own): %s", self.lease_id, exc)
