"""Job leases on datasets: a job's dataset lives while some lease on it does.

A lease expires unless renewed (every third of its TTL by the client's keeper), so a killed job
frees the servers' memory on its own. A lease this registry does not know on a dataset it does is
taken up again when its job renews it (the registry was rebuilt from the servers, or the lease
expired while its job was stalled: the job that renews it is alive). A dataset taken back from the
servers' records holds itself for one lease period, for its jobs to renew.
"""

from __future__ import annotations

import functools
import logging
import re
import secrets
from collections.abc import Callable

from kspeed.errors import NotFoundError
from kspeed.manager.store import Store
from kspeed.proto import kspeed_pb2

__all__ = ["LOST_LEASE_HOLDER", "Leases"]

log = logging.getLogger(__name__)

LEASE_ID = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}/[0-9a-f]{16}"  # "<dataset>/<16 hex digits>"
LOST_LEASE_HOLDER = "a job whose lease the manager took up again after losing it"


class Leases:
    """The leases of every dataset, persisted through a :class:`Store`.

    Args:
        store: where leases are kept.
        ttl: the default time to live, in seconds.
        known: whether a dataset of that name is registered (a lease names its dataset).
        wall: the wall clock.
    """

    def __init__(self, store: Store, *, ttl: float, known: Callable[[str], bool], wall: Callable[[], float]) -> None:
        self._store = store
        self._ttl = ttl
        self._known = known
        self._wall = wall
        self._leases: dict[str, kspeed_pb2.Lease] = {}
        self._held_until: dict[str, float] = {}  # datasets that need no lease until then
        now = wall()
        for lease in store.leases():
            # The manager was down: give every lease one full period to be renewed.
            lease.expires_unix = max(lease.expires_unix, now + lease.ttl_s)
            self._leases[lease.id] = lease

    def of(self, dataset: str) -> list[kspeed_pb2.Lease]:
        """The leases on ``dataset``."""
        return [lease for lease in self._leases.values() if lease.dataset == dataset]

    def held(self) -> set[str]:
        """The datasets some lease holds now (or that wait for their jobs to renew one)."""
        now = self._wall()
        return {lease.dataset for lease in self._leases.values()} | {
            name for name, until in self._held_until.items() if until > now
        }

    def hold_for_renewal(self, dataset: str) -> None:
        """Keep ``dataset`` for one lease period without a lease (taken back from the servers'
        records: its jobs' leases were lost with the registry and come back as they renew them)."""
        self._held_until[dataset] = self._wall() + self._ttl

    def new(self, dataset: str, holder: str, ttl: float) -> kspeed_pb2.Lease:
        """A new lease on ``dataset`` for ``holder`` (``ttl`` 0: the default)."""
        ttl = ttl or self._ttl
        lease = kspeed_pb2.Lease(
            id=f"{dataset}/{secrets.token_hex(8)}",
            dataset=dataset,
            holder=holder,
            ttl_s=ttl,
            expires_unix=self._wall() + ttl,
        )
        self._leases[lease.id] = lease
        self._store.keep(functools.partial(self._store.save_lease, lease))
        return lease

    def _get(self, lease_id: str) -> kspeed_pb2.Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            dataset = lease_id.partition("/")[0]
            why = "it expired or was released; attach again" if self._known(dataset) else "the dataset was removed"
            raise NotFoundError(f"lease {lease_id!r} on dataset {dataset!r} is unknown: {why}")
        return lease

    def renew(self, lease_id: str) -> kspeed_pb2.Lease:
        """Extend a lease by its TTL, taking up one this registry does not know on a dataset it does.

        Raises:
            NotFoundError: neither the lease nor its dataset is known.
        """
        dataset = lease_id.partition("/")[0]
        if lease_id not in self._leases and self._known(dataset) and re.fullmatch(LEASE_ID, lease_id):
            self._leases[lease_id] = kspeed_pb2.Lease(
                id=lease_id, dataset=dataset, holder=LOST_LEASE_HOLDER, ttl_s=self._ttl
            )
            log.warning(
                "lease %s on dataset %s was unknown here; taken up again for the job renewing it", lease_id, dataset
            )
        lease = self._get(lease_id)
        lease.expires_unix = self._wall() + lease.ttl_s
        self._store.keep(functools.partial(self._store.save_lease, lease))
        return lease

    def release(self, lease_id: str) -> None:
        """End a lease now.

        Raises:
            NotFoundError: the lease is not known.
        """
        self._get(lease_id)
        del self._leases[lease_id]
        self._store.keep(functools.partial(self._store.delete_lease, lease_id))

    def expire(self) -> None:
        """Drop the leases past their time."""
        now = self._wall()
        for lease_id, lease in list(self._leases.items()):
            if lease.expires_unix <= now:
                log.info("lease %s of %r expired", lease_id, lease.holder)
                del self._leases[lease_id]
                self._store.keep(functools.partial(self._store.delete_lease, lease_id))

    def forget(self, dataset: str) -> None:
        """Drop every lease on ``dataset`` (it was removed; the store drops them with it)."""
        self._held_until.pop(dataset, None)
        for lease_id in [k for k, v in self._leases.items() if v.dataset == dataset]:
            del self._leases[lease_id]
