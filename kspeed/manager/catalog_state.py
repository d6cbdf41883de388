"""What the manager's dataset catalog holds, and how it reads it: the datasets, their shares and
where each holder stands, the leases, and the room on each server.

:class:`CatalogState` is the ground the catalog's operations stand on
(:mod:`kspeed.manager.moves` moves shares between servers; :mod:`kspeed.manager.datasets` registers,
removes and takes datasets back); it owns the state, the dataset locks and the record each
assignment carries.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from kspeed.control.lifecycle import SERVING
from kspeed.errors import NotFoundError
from kspeed.manager.calls import ServerCalls
from kspeed.manager.leases import Leases
from kspeed.manager.membership import Membership
from kspeed.manager.store import Store
from kspeed.proto import kspeed_pb2

__all__ = ["CatalogState", "held_regions", "needed_regions", "record_of"]

log = logging.getLogger(__name__)

JOB = kspeed_pb2.DatasetOwner.DATASET_OWNER_JOB
DState = kspeed_pb2.DatasetState
CHANGES_SHOWN = 5


def needed_regions(share: kspeed_pb2.Share) -> int:
    """Pool regions a holder with a copy gives a share: its window with a memory policy, none for
    a slice of a shared region (counted apart, :meth:`CatalogState._slice_room`), else all of it."""
    if share.slice_bytes:
        return 0
    return share.memory_regions if share.policy else share.num_regions


def held_regions(share: kspeed_pb2.Share) -> int:
    """Pool regions a share takes on its holder now (none while served on demand)."""
    return 0 if share.on_demand else needed_regions(share)


def record_of(info: kspeed_pb2.DatasetInfo) -> kspeed_pb2.DatasetInfo:
    """The dataset as the registry records it (no live progress, leases or addresses)."""
    out = kspeed_pb2.DatasetInfo()
    out.CopyFrom(info)
    for name in ("state", "progress", "share_status", "leases", "server_addresses", "changes"):
        out.ClearField(name)
    return out


class CatalogState:
    """The datasets, their shares, what their holders report, and the leases (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        membership: Membership,
        calls: ServerCalls,
        *,
        lease_ttl: float,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._membership = membership
        self._calls = calls
        self._wall = wall
        self._datasets: dict[str, kspeed_pb2.DatasetInfo] = {d.spec.name: d for d in store.datasets()}
        self.leases = Leases(store, ttl=lease_ttl, known=lambda name: name in self._datasets, wall=wall)
        # (dataset, server, first sample of the share) -> what that server last reported about it
        self._share_status: dict[tuple[str, str, int], kspeed_pb2.ShareStatus] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.failovers = 0  # shares moved off failed or stopped servers
        self.handoffs = 0  # shares handed off by a drain
        self._adopted: set[str] = set()  # datasets taken from a server's copy and not changed here since
        self._tasks: set[asyncio.Task[None]] = set()

    def _lock(self, name: str) -> asyncio.Lock:
        """The lock of dataset ``name``: one change of its shares at a time."""
        return self._locks.setdefault(name, asyncio.Lock())

    def get(self, name: str) -> kspeed_pb2.DatasetInfo:
        """The dataset with live progress.

        Raises:
            NotFoundError: no dataset of that name.
        """
        info = self._datasets.get(name)
        if info is None:
            known = ", ".join(sorted(self._datasets)) or "none"
            raise NotFoundError(f"unknown dataset {name!r} (registered: {known})")
        return self._live(info)

    def datasets(self) -> list[kspeed_pb2.DatasetInfo]:
        """Every dataset, by name."""
        return [self._live(self._datasets[name]) for name in sorted(self._datasets)]

    def _live(self, stored: kspeed_pb2.DatasetInfo) -> kspeed_pb2.DatasetInfo:
        info = kspeed_pb2.DatasetInfo()
        info.CopyFrom(stored)
        name = info.spec.name
        info.leases = len(self.leases.of(name))
        total = info.progress
        total.Clear()
        states = {r.id: r for r in self._membership.snapshot(include_left=True)}
        unreachable = False
        for share in info.shares:
            status = self._share_status.get((name, share.server_id, share.first_id)) or kspeed_pb2.ShareStatus(
                dataset=name, first_id=share.first_id
            )
            info.share_status.append(status)
            p = status.progress
            total.samples_loaded += p.samples_loaded
            total.bytes_loaded += p.bytes_loaded
            total.bytes_per_s += p.bytes_per_s
            total.running |= p.running
            total.error_count += p.error_count
            total.errors.extend(p.errors[: max(0, 5 - len(total.errors))])
            record = states.get(share.server_id)
            unreachable |= record is None or record.state not in SERVING or share.on_demand
            if record is not None:
                info.server_addresses[share.server_id] = record.address
        total.samples_total = info.fingerprint.count
        total.bytes_total = info.fingerprint.total_bytes
        changes = [c for status in info.share_status for c in status.changes]
        info.changes.extend(changes[:CHANGES_SHOWN])
        if info.changed_reason or changes:
            info.state = DState.DATASET_STATE_CHANGED
        elif total.running:
            info.state = DState.DATASET_STATE_LOADING
        elif unreachable or total.error_count:  # a holder away, a share read on demand, or load errors
            info.state = DState.DATASET_STATE_DEGRADED
        elif total.samples_loaded == total.samples_total or all(s.policy for s in info.shares):
            info.state = DState.DATASET_STATE_READY  # (held in part: nothing to load ahead of the jobs)
        else:
            info.state = DState.DATASET_STATE_ALLOCATED
        return info

    def assignments_for(self, server_id: str) -> list[kspeed_pb2.AssignShareRequest]:
        """The shares ``server_id`` is responsible for (sent at its registration): those it holds,
        and those it is taking over in a handoff."""
        out = []
        for info in self._datasets.values():
            for share in info.shares:
                if share.server_id == server_id:
                    out.append(self._assignment(info, share))
                elif share.handoff_to == server_id:
                    out.append(self._assignment(info, share, holder=server_id))
        return out

    def holders(self) -> set[str]:
        """Every server some share is held by or handed to."""
        return {s.server_id for d in self._datasets.values() for s in d.shares} | {
            s.handoff_to for d in self._datasets.values() for s in d.shares if s.handoff_to
        }

    def holds(self, server_id: str) -> bool:
        """Whether ``server_id`` still holds some share (a drained server may leave once it holds none)."""
        return any(s.server_id == server_id for d in self._datasets.values() for s in d.shares)

    @staticmethod
    def _assignment(
        info: kspeed_pb2.DatasetInfo,
        share: kspeed_pb2.Share,
        *,
        holder: str = "",
        record: kspeed_pb2.DatasetInfo | None = None,
    ) -> kspeed_pb2.AssignShareRequest:
        """What a server is sent to hold ``share`` (as ``holder`` when it takes it over), with the
        dataset's ``record`` (default: as the registry has it now)."""
        sent = kspeed_pb2.Share()
        sent.CopyFrom(share)
        sent.handoff_to = ""
        if holder:
            sent.server_id = holder
        return kspeed_pb2.AssignShareRequest(
            spec=info.spec,
            fingerprint=info.fingerprint,
            region_size=info.region_size,
            share=sent,
            dataset=record if record is not None else record_of(info),
        )

    def records_for(self, shares: list[kspeed_pb2.ShareStatus]) -> list[kspeed_pb2.DatasetInfo]:
        """The records of the datasets a server reported shares of with an older revision than the
        registry's (its copies, a recovery source, are kept fresh within a heartbeat of a change)."""
        stale = {
            s.dataset for s in shares if s.dataset in self._datasets and s.revision < self._datasets[s.dataset].revision
        }
        return [record_of(self._datasets[name]) for name in sorted(stale)]

    @property
    def write_failures(self) -> int:
        """Writes of the registry that failed (a full disk) since the start."""
        return self._store.write_failures

    def _addresses(self) -> dict[str, str]:
        """Server id -> address of every server on record."""
        return {r.id: r.address for r in self._membership.snapshot(include_left=True)}

    def _changed(self, info: kspeed_pb2.DatasetInfo) -> None:
        """Record a change of ``info``'s shares made here: a new revision, saved; from now on the
        registry's copy wins over any server's."""
        info.revision += 1
        self._adopted.discard(info.spec.name)
        self._store.keep(functools.partial(self._store.save_dataset, info))

    def _spawn(self, work: Coroutine[Any, Any, Any], name: str) -> None:
        """Run ``work`` in the background (its reference kept until it ends)."""
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _registering(self, name: str) -> bool:
        lock = self._locks.get(name)
        return lock is not None and lock.locked()

    def forget_progress(self, server_id: str) -> None:
        """Drop what a server reported before it (re-)registered: its new incarnation reports afresh."""
        for key in [k for k in self._share_status if k[1] == server_id]:
            del self._share_status[key]

    def _free_regions(self, record: kspeed_pb2.ServerRecord) -> int:
        """Regions of ``record`` not promised to any dataset (the manager's own bookkeeping; a
        share held on demand takes none; the slices of small datasets take the regions they fill)."""
        promised = sum(held_regions(s) for d in self._datasets.values() for s in d.shares if s.server_id == record.id)
        inv = record.inventory
        total = inv.regions_total or inv.memory_bytes // max(inv.region_size, 1)
        sliced = -(-self._sliced(record.id) // max(inv.region_size, 1))
        return max(int(total) - int(inv.regions_window) - promised - sliced, 0)

    def _sliced(self, server_id: str) -> int:
        """Bytes of shared regions the small datasets on ``server_id`` take."""
        return sum(
            s.slice_bytes
            for d in self._datasets.values()
            for s in d.shares
            if s.server_id == server_id and s.slice_bytes and not s.on_demand
        )

    def _slice_room(self, record: kspeed_pb2.ServerRecord) -> int:
        """Bytes a new slice may take on ``record``: the rest of its shared regions and its free ones."""
        size = max(record.inventory.region_size, 1)
        sliced = self._sliced(record.id)
        return (-(-sliced // size) * size - sliced) + self._free_regions(record) * size
