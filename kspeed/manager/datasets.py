"""The dataset catalog: registration, allocation to servers, leases and preload progress.

The manager owns this hard state (SQLite); servers hold the data. Registering a dataset asks one
ready server to list the backend (the manager has no backend credentials; the lister answers with
its region layout, one entry per region, never one per sample), allocates whole regions on servers
with :func:`kspeed.manager.allocator.allocate_regions` (or, for a dataset that does not fit or has a
memory policy, a window per share with :func:`~kspeed.manager.allocator.allocate_window`), and
assigns each server its share; a
failure on any server undoes the assignments already made, so nothing is left half-registered.

A dataset created by a job lives while some lease on it does (leases expire unless renewed, so a
killed job frees its memory); a dataset added by an operator lives until it is removed.

Shares move in three ways: a **failover** gives the shares of a server that failed, or stopped and
did not come back within ``restart_grace``, to another server (which reloads them in the order
the feeds consume them) or, with no room anywhere, to a survivor that serves them on demand; a
**handoff** (a drain) has the new holder load a share while the old one still serves it, and moves
it once loaded, so jobs switch to a server that already holds the data; a **rehome** gives a share
served on demand a server with room once one has it.

Every change of a dataset's shares bumps its ``revision`` and is sent to the servers with each
assignment; the servers keep it. The registry here wins over what servers report, except where it
lacks a dataset altogether (its state file was lost, or this dataset was registered with another
manager's registry): a server's copy is then taken back (:meth:`DatasetCatalog.adopt`), the newest
revision winning until this manager changes the dataset itself, unless the registry removed a
dataset of that name after the copy was made.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import re
import secrets
import time
from collections.abc import Callable, Coroutine
from typing import Any

from kspeed import names, uris, wire
from kspeed.control.lifecycle import SERVING
from kspeed.errors import (
    CapacityError,
    ChangedError,
    ConflictError,
    DatasetError,
    KSpeedError,
    NotFoundError,
    ProtocolError,
    StateError,
    StateFileError,
    UnavailableError,
)
from kspeed.manager.allocator import (
    Allocation,
    ServerCapacity,
    allocate_regions,
    allocate_slice,
    allocate_window,
    slice_size,
)
from kspeed.manager.calls import ServerCalls
from kspeed.manager.membership import JOINING, READY, Membership
from kspeed.manager.store import Store
from kspeed.policies import MEMORY_POLICIES, POLICIES
from kspeed.proto import kspeed_pb2

log = logging.getLogger(__name__)

JOB = kspeed_pb2.DatasetOwner.DATASET_OWNER_JOB
OPERATOR = kspeed_pb2.DatasetOwner.DATASET_OWNER_OPERATOR
DState = kspeed_pb2.DatasetState
_KINDS = ("", "auto", "dir", "list", "manifest", "npy", "tar")
_LABELS = ("", "dirname", "cls")
_CACHES = ("", "preprocessed")
_POLICIES = ("", *POLICIES)
VERIFY_TTL = 60.0  # seconds a successful attach-time listing holds for further attaches
CHANGES_SHOWN = 5
JOIN_POLL = 0.05  # seconds between looks at servers that are still joining
LEASE_ID = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}/[0-9a-f]{16}"
LOST_LEASE_HOLDER = "a job whose lease the manager took up again after losing it"


def validate_spec(spec: kspeed_pb2.DatasetSpec) -> None:
    """Check a dataset definition.

    Raises:
        ProtocolError: naming the field and the value.
    """
    names.DATASET.check(spec.name)
    uris.check(spec.uri, what=f"dataset {spec.name!r}: uri")
    if spec.kind not in _KINDS:
        raise ProtocolError(f"dataset {spec.name!r}: kind {spec.kind!r} is not one of {', '.join(_KINDS[1:])}")
    if spec.labels not in _LABELS:
        raise ProtocolError(f"dataset {spec.name!r}: labels {spec.labels!r} is not one of '', 'dirname', 'cls'")
    if spec.cache not in _CACHES:
        raise ProtocolError(f"dataset {spec.name!r}: cache {spec.cache!r} is not one of '', 'preprocessed'")
    if spec.cache and not spec.pipeline.stages:
        raise ProtocolError(f"dataset {spec.name!r}: cache {spec.cache!r} needs a pipeline")
    if spec.policy not in _POLICIES:
        raise ProtocolError(f"dataset {spec.name!r}: policy {spec.policy!r} is not one of {', '.join(_POLICIES[1:])}")


def needed_regions(share: kspeed_pb2.Share) -> int:
    """Pool regions a holder with a copy gives a share: its window with a memory policy, none for
    a slice of a shared region (counted apart, :meth:`DatasetCatalog._slice_room`), else all of it."""
    if share.slice_bytes:
        return 0
    return share.memory_regions if share.policy else share.num_regions


def held_regions(share: kspeed_pb2.Share) -> int:
    """Pool regions a share takes on its holder now (none while served on demand)."""
    return 0 if share.on_demand else needed_regions(share)


def _loaded(status: kspeed_pb2.ShareStatus, share: kspeed_pb2.Share) -> bool:
    """Whether a share's new holder has what the old one served: a share under a memory policy (or
    served on demand) once it is held at all, a whole one once its preload has read every sample."""
    if share.policy or share.on_demand:
        return True
    p = status.progress
    return not p.running and p.samples_total > 0 and p.samples_loaded + p.error_count >= p.samples_total


def _record(info: kspeed_pb2.DatasetInfo) -> kspeed_pb2.DatasetInfo:
    """The dataset as the registry records it (no live progress, leases or addresses)."""
    out = kspeed_pb2.DatasetInfo()
    out.CopyFrom(info)
    for name in ("state", "progress", "share_status", "leases", "server_addresses", "changes"):
        out.ClearField(name)
    return out


def _same_definition(a: kspeed_pb2.DatasetSpec, b: kspeed_pb2.DatasetSpec) -> bool:
    return (a.uri, a.kind or "auto", a.labels, a.quota_bytes, a.pipeline, a.cache, a.policy or "auto") == (
        b.uri,
        b.kind or "auto",
        b.labels,
        b.quota_bytes,
        b.pipeline,
        b.cache,
        b.policy or "auto",
    )


class DatasetCatalog:
    """Datasets, their allocations and leases."""

    def __init__(
        self,
        store: Store,
        membership: Membership,
        calls: ServerCalls,
        *,
        lease_ttl: float,
        join_wait: float = 30.0,
        verify_on_attach: bool = True,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._verify_on_attach = verify_on_attach
        self._verified: dict[str, float] = {}
        self._store = store
        self._join_wait = join_wait
        self._membership = membership
        self._calls = calls
        self._lease_ttl = lease_ttl
        self._wall = wall
        self._datasets: dict[str, kspeed_pb2.DatasetInfo] = {d.spec.name: d for d in store.datasets()}
        self._leases: dict[str, kspeed_pb2.Lease] = {}
        now = wall()
        for lease in store.leases():
            # The manager was down: give every lease one full period to be renewed.
            lease.expires_unix = max(lease.expires_unix, now + lease.ttl_s)
            self._leases[lease.id] = lease
        # (dataset, server, first sample of the share) -> what that server last reported about it
        self._share_status: dict[tuple[str, str, int], kspeed_pb2.ShareStatus] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.failovers = 0  # shares moved off failed or stopped servers
        self.handoffs = 0  # shares handed off by a drain
        self._adopted: set[str] = set()  # datasets taken from a server's copy and not changed here since
        self._orphaned: dict[str, float] = {}  # adopted job datasets -> until when they need no lease
        self._degrade: dict[str, bool] = {}  # servers being drained -> whether a share may go on demand
        self._tasks: set[asyncio.Task[None]] = set()

    # -- reading ---------------------------------------------------------------------------------

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
        info.leases = sum(1 for lease in self._leases.values() if lease.dataset == name)
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
            dataset=record if record is not None else _record(info),
        )

    def records_for(self, shares: list[kspeed_pb2.ShareStatus]) -> list[kspeed_pb2.DatasetInfo]:
        """The records of the datasets a server reported shares of with an older revision than the
        registry's (its copies, a recovery source, are kept fresh within a heartbeat of a change)."""
        stale = {
            s.dataset for s in shares if s.dataset in self._datasets and s.revision < self._datasets[s.dataset].revision
        }
        return [_record(self._datasets[name]) for name in sorted(stale)]

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

    # -- rebuilding from the servers -------------------------------------------------------------

    def adopt(self, server_id: str, holding: list[kspeed_pb2.AssignShareRequest]) -> list[str]:
        """Take back the datasets a registering server holds that the registry lacks (see the
        module docstring): a registry whose file was lost is rebuilt from the servers' copies.
        Returns the names taken."""
        taken = []
        for request in holding:
            if not request.HasField("dataset") or request.dataset.spec.name != request.spec.name:
                continue
            reported = request.dataset
            name = reported.spec.name
            current = self._datasets.get(name)
            if current is not None and (name not in self._adopted or reported.revision <= current.revision):
                continue
            if self._registering(name):
                continue
            removed = self._store.removed_at(name)
            if current is None and removed is not None and removed >= reported.created_unix:
                continue  # removed here after that copy was made
            try:
                validate_spec(reported.spec)
            except ProtocolError as exc:
                log.warning("dataset %s: %s's copy is not taken back: %s", name, server_id, exc)
                continue
            self._datasets[name] = _record(reported)
            self._adopted.add(name)
            if reported.owner == JOB:
                self._orphaned[name] = self._wall() + self._lease_ttl
            self._store.keep(functools.partial(self._store.save_dataset, self._datasets[name]))
            taken.append(name)
            log.warning(
                "dataset %s: taken back from the copy server %s keeps (revision %d, %d share(s) on %s): the registry "
                "did not have it",
                name,
                server_id,
                reported.revision,
                len(reported.shares),
                ", ".join(sorted({s.server_id for s in reported.shares})),
            )
        if taken:
            self._store.keep(self._store.confirm_cluster_id)
        return taken

    def forget_progress(self, server_id: str) -> None:
        """Drop what a server reported before it (re-)registered: its new incarnation reports afresh."""
        for key in [k for k in self._share_status if k[1] == server_id]:
            del self._share_status[key]

    def on_heartbeat(
        self, server_id: str, shares: list[kspeed_pb2.ShareStatus]
    ) -> tuple[list[str], list[kspeed_pb2.ShareRef], list[kspeed_pb2.AssignShareRequest]]:
        """Record the progress a server reports; return the datasets it holds but should not, the
        shares of datasets it keeps that are held elsewhere now, and the shares it should hold but
        did not report (their progress is forgotten: not loaded there)."""
        stale: list[str] = []
        moved: list[kspeed_pb2.ShareRef] = []
        reported = set()
        for status in shares:
            if self._registering(status.dataset):  # not while a registration of that name is under way
                continue
            info = self._datasets.get(status.dataset)
            mine = (
                {s.first_id for s in info.shares if server_id in (s.server_id, s.handoff_to)}
                if info is not None
                else set()
            )
            if not mine:
                stale.append(status.dataset)
            elif status.first_id not in mine:
                moved.append(kspeed_pb2.ShareRef(dataset=status.dataset, first_id=status.first_id))
            else:
                reported.add((status.dataset, status.first_id))
                self._share_status[(status.dataset, server_id, status.first_id)] = status
                self._complete_handoff(status, server_id)
        missing = []
        for name, info in self._datasets.items():
            if self._registering(name):
                continue
            for share in info.shares:
                if server_id in (share.server_id, share.handoff_to) and (name, share.first_id) not in reported:
                    if self._share_status.pop((name, server_id, share.first_id), None) is not None:
                        log.warning(
                            "dataset %s: server %s no longer reports its share %d..; assigning it again",
                            name,
                            server_id,
                            share.first_id,
                        )
                    missing.append(self._assignment(info, share, holder=server_id))
        return sorted(set(stale)), moved, missing

    def _registering(self, name: str) -> bool:
        lock = self._locks.get(name)
        return lock is not None and lock.locked()

    # -- changes ---------------------------------------------------------------------------------

    async def create(self, request: kspeed_pb2.CreateDatasetRequest) -> kspeed_pb2.CreateDatasetReply:
        """Register a dataset or attach to the existing one of that name."""
        spec = request.spec
        validate_spec(spec)
        owner = request.owner or JOB
        names.HOLDER.check(request.holder)
        if request.lease_ttl_s < 0 or request.lease_ttl_s > 86400:
            raise ProtocolError(f"lease_ttl_s {request.lease_ttl_s} must be between 0 and 86400")
        async with self._locks.setdefault(spec.name, asyncio.Lock()):
            created = False
            existing = self._datasets.get(spec.name)
            if existing is not None:
                if not _same_definition(existing.spec, spec):
                    raise ConflictError(
                        f"dataset {spec.name!r} is already registered as uri={existing.spec.uri!r} "
                        f"kind={existing.spec.kind or 'auto'!r} labels={existing.spec.labels!r} "
                        f"quota={existing.spec.quota_bytes} cache={existing.spec.cache!r} "
                        f"policy={existing.spec.policy or 'auto'!r} and "
                        f"{len(existing.spec.pipeline.stages)} pipeline stage(s) (a pipeline is part of a dataset's "
                        "identity); remove it first or use another name"
                    )
                await self._verify(existing)
            else:
                info = await self._allocate(spec, owner)
                try:
                    self._store.save_dataset(info)  # a dataset the registry cannot record is not created
                    self._store.confirm_cluster_id()
                except StateFileError:
                    await asyncio.shield(self._drop_shares(spec.name, list(info.shares), self._addresses()))
                    raise
                self._datasets[spec.name] = info
                created = True
            reply = kspeed_pb2.CreateDatasetReply(created=created)
            if owner == JOB:
                reply.lease.CopyFrom(self._new_lease(spec.name, request.holder, request.lease_ttl_s))
            reply.dataset.CopyFrom(self.get(spec.name))
            return reply

    async def _verify(self, info: kspeed_pb2.DatasetInfo) -> None:
        """Before a job attaches: list the backend again and refuse a dataset whose files changed.

        One listing per :data:`VERIFY_TTL` per dataset, so the ranks of a job attaching together
        share it. A changed fingerprint makes every holder compare its whole share with its listing
        (``CheckShare``) to name the changed samples; the dataset is marked changed for good.

        Raises:
            ChangedError: the dataset's backend changed since registration (the first changes named).
        """
        name = info.spec.name
        now = time.monotonic()
        if not info.changed_reason and (
            not self._verify_on_attach or now - self._verified.get(name, -1e9) < VERIFY_TTL
        ):
            return
        if not info.changed_reason:
            ready = [r for r in self._membership.snapshot() if r.state == READY]
            holders = {s.server_id for s in info.shares}
            lister = next((r for r in ready if r.id in holders), ready[0] if ready else None)
            if lister is None:
                return  # nobody can list now; the servers' own checks still run
            try:
                described = await self._calls.call(lister.address, lister.id, "DescribeDataset", info.spec)
                fresh: kspeed_pb2.Fingerprint = described.fingerprint
            except DatasetError as exc:  # e.g. the backend root itself is gone
                fresh, why = kspeed_pb2.Fingerprint(), str(exc)
            else:
                why = ""
            if fresh == info.fingerprint:
                self._verified[name] = now
                return
            old, new = info.fingerprint, fresh
            info.changed_reason = why or (
                f"the backend's listing changed since registration ({old.count} samples, {old.total_bytes} bytes, "
                f"{old.digest[:12]} -> {new.count} samples, {new.total_bytes} bytes, {new.digest[:12]})"
            )
            self._store.keep(functools.partial(self._store.save_dataset, info))
            log.error("dataset %s: %s", name, info.changed_reason)
            await self._check_shares(info)
        live = self._live(info)
        named = "; ".join(live.changes) or "the changed samples are being determined"
        raise ChangedError(
            f"dataset {name!r}: {info.changed_reason or 'backend files changed after they were loaded'}: {named}; "
            f"its cached bytes are stale and not served: remove it (kspeed dataset rm {name} --force) and register it "
            "again",
            dataset=name,
        )

    async def _check_shares(self, info: kspeed_pb2.DatasetInfo) -> None:
        """Have every holder compare its whole share with its listing now; their reports name the changes."""
        name = info.spec.name
        states = {r.id: r for r in self._membership.snapshot()}
        for share in info.shares:
            record = states.get(share.server_id)
            if record is None or record.state != READY:
                continue
            request = kspeed_pb2.CheckShareRequest(name=name)
            try:
                status = await self._calls.call(record.address, record.id, "CheckShare", request)
            except KSpeedError as exc:
                log.warning("dataset %s: %s could not check its share: %s", name, record.id, exc)
                continue
            self._share_status[(name, share.server_id, status.first_id)] = status

    async def _allocate(self, spec: kspeed_pb2.DatasetSpec, owner: kspeed_pb2.DatasetOwner) -> kspeed_pb2.DatasetInfo:
        ready = await self._ready_servers(spec.name)
        sizes_of = {r.inventory.region_size for r in ready}
        region_size = max(sizes_of, key=lambda size: sum(r.inventory.region_size == size for r in ready))
        ready = [r for r in ready if r.inventory.region_size == region_size]
        lister = ready[0]
        described = await self._calls.call(lister.address, lister.id, "DescribeDataset", spec)
        if described.region_size != region_size:
            raise ProtocolError(
                f"dataset {spec.name!r}: {lister.id} laid it out in regions of {described.region_size} bytes, "
                f"its inventory says {region_size}"
            )
        capacities = [ServerCapacity(r.id, self._free_regions(r)) for r in ready]
        room = [(r.id, self._slice_room(r)) for r in ready]
        allocation = self._place(spec, described, region_size, capacities, room, lister.id)
        info = kspeed_pb2.DatasetInfo(
            spec=spec,
            owner=owner,
            fingerprint=described.fingerprint,
            region_size=region_size,
            class_names=described.class_names,
            created_unix=self._wall(),
            sample_dtype=described.sample_dtype,
            sample_shape=described.sample_shape,
            shard_starts=described.shard_starts,
        )
        policy = spec.policy if spec.policy in MEMORY_POLICIES else ""
        if not policy and allocation.memory_regions < allocation.num_regions:
            policy = "stream"  # "auto": the default for a dataset that does not fit
        for part in allocation.shares:
            info.shares.append(
                kspeed_pb2.Share(
                    server_id=part.server_id,
                    first_id=part.lo,
                    end_id=part.hi,
                    first_region=part.first_region,
                    num_regions=part.num_regions,
                    bytes=part.bytes,
                    policy=policy,
                    memory_regions=part.memory_regions if policy else 0,
                    slice_bytes=part.slice_bytes,
                )
            )
        info.revision = 1
        addresses = {r.id: r.address for r in ready}
        await self._assign_all(info, addresses)
        log.info(
            "dataset %s: %d samples, %d bytes in %d regions on %d server(s)%s",
            spec.name,
            allocation.num_samples,
            allocation.total_bytes,
            allocation.num_regions,
            len(info.shares),
            f"; policy {policy}, held in {allocation.memory_regions} region(s)" if policy else "",
        )
        return info

    async def _assign_all(self, info: kspeed_pb2.DatasetInfo, addresses: dict[str, str]) -> None:
        """Assign every share of a new dataset, the servers at once (each lists the backend, which
        may take long), one server's shares in turn. A failure anywhere, or the caller giving up,
        drops the share on every server it was sent to (the one whose call failed too: it may have
        taken it as the call failed), then is raised.

        Raises:
            KSpeedError: the first server's refusal, named.
        """
        name = info.spec.name
        holders: dict[str, list[kspeed_pb2.Share]] = collections.defaultdict(list)
        for share in info.shares:
            holders[share.server_id].append(share)
        sent: list[kspeed_pb2.Share] = []

        async def assign(server_id: str, shares: list[kspeed_pb2.Share]) -> None:
            for share in shares:
                sent.append(share)
                await self._calls.call(addresses[server_id], server_id, "AssignShare", self._assignment(info, share))

        tasks = [asyncio.ensure_future(assign(sid, shares)) for sid, shares in holders.items()]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((t.exception() for t in done if t.exception() is not None), None)
            if failed is not None:
                for task in pending:  # no use waiting for the others' listings
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                raise failed
        except BaseException as exc:  # an error, or the caller gave up (the calls cancelled): undo, then say so
            log.warning(
                "dataset %s: registration failed (%s); undoing the %d assignment(s) sent",
                name,
                exc if isinstance(exc, KSpeedError) else type(exc).__name__,
                len(sent),
            )
            for task in tasks:
                task.cancel()
            await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
            await asyncio.shield(self._drop_shares(name, sent, addresses))
            raise

    @staticmethod
    def _place(
        spec: kspeed_pb2.DatasetSpec,
        described: kspeed_pb2.DescribeDatasetReply,
        region_size: int,
        capacities: list[ServerCapacity],
        room: list[tuple[str, int]],
        lister: str,
    ) -> Allocation:
        """Where the dataset goes: a small one in a slice of a shared region; whole when it fits
        (policy ``auto`` or ``cache``), else (or with a memory policy) held in part, in at most its
        quota.

        Raises:
            CapacityError: with policy ``cache``, it does not fit the free regions or its quota.
        """
        name = spec.name
        starts = wire.unpack_i64(described.region_starts, f"dataset {name!r}: region starts from {lister}")
        region_bytes = wire.unpack_i64(described.region_bytes, f"dataset {name!r}: region bytes from {lister}")
        budget = spec.quota_bytes // region_size if spec.quota_bytes else None
        count, total = int(starts[-1]), int(region_bytes.sum())
        small = slice_size(count, total, region_size) if len(region_bytes) == 1 else 0
        if small and spec.policy not in MEMORY_POLICIES and (not spec.quota_bytes or small <= spec.quota_bytes):
            return allocate_slice(name, count, total, small, region_size, room)
        if spec.policy not in MEMORY_POLICIES:
            try:
                allocation = allocate_regions(name, starts, region_bytes, region_size, capacities)
            except CapacityError:
                if spec.policy == "cache":
                    raise
            else:
                need = allocation.num_regions * region_size
                if not spec.quota_bytes or need <= spec.quota_bytes:
                    return allocation
                if spec.policy == "cache":
                    raise CapacityError(
                        f"dataset {name!r} needs {allocation.num_regions} regions ({need} bytes) "
                        f"for {allocation.total_bytes} bytes of samples; its quota is {spec.quota_bytes} bytes"
                    )
        return allocate_window(name, starts, region_bytes, region_size, capacities, budget=budget)

    async def _ready_servers(self, name: str) -> list[kspeed_pb2.ServerRecord]:
        """The READY servers, once no server is still joining (or ``join_wait`` has passed).

        Servers that registered moments ago are JOINING until their first health probe; a dataset
        created right after ``kspeed up`` (or a server start) waits for them instead of failing or
        landing on fewer servers than the cluster has.

        Raises:
            UnavailableError: no server is READY after the wait (the joining ones are named).
        """
        deadline = time.monotonic() + self._join_wait
        while True:
            records = self._membership.snapshot()
            joining = [r.id for r in records if r.state == JOINING]
            if not joining or time.monotonic() >= deadline:
                break
            await asyncio.sleep(JOIN_POLL)
        ready = [r for r in records if r.state == READY]
        if not ready:
            waited = f"; still joining after {self._join_wait:g}s: {', '.join(joining)}" if joining else ""
            raise UnavailableError(f"dataset {name!r}: no ready server to hold it{waited}")
        if joining:
            log.warning(
                "dataset %s: allocating on %d ready server(s); %s still joining after %gs",
                name,
                len(ready),
                ", ".join(joining),
                self._join_wait,
            )
        return ready

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

    async def _drop_shares(self, name: str, shares: list[kspeed_pb2.Share], addresses: dict[str, str]) -> None:
        for share in shares:
            address = addresses.get(share.server_id)
            if address is None:
                continue
            try:
                await self._calls.call(address, share.server_id, "DropDataset", kspeed_pb2.DatasetRequest(name=name))
            except KSpeedError as exc:
                # The server reconciles at its next registration; the region is not lost for good.
                log.warning("dataset %s: could not drop share on %s: %s", name, share.server_id, exc)

    async def remove(self, name: str, *, force: bool = False) -> None:
        """Remove a dataset: drop its shares on the servers and forget it and its leases.

        Raises:
            StateError: jobs hold leases on it and ``force`` is not set (the holders are named).
        """
        async with self._locks.setdefault(name, asyncio.Lock()):
            info = self.get(name)
            held = [lease for lease in self._leases.values() if lease.dataset == name]
            if held and not force:
                holders = "; ".join(lease.holder or lease.id for lease in held[:5])
                raise StateError(
                    f"dataset {name!r} is in use: {len(held)} job lease(s) hold it ({holders}); stop those jobs, or "
                    f"remove it anyway with force (kspeed dataset rm {name} --force): their feeds then end with an "
                    "error naming the removal"
                )
            addresses = dict(info.server_addresses)
            await self._drop_shares(name, list(info.shares), addresses)
            del self._datasets[name]
            self._adopted.discard(name)
            self._orphaned.pop(name, None)
            for lease_id in [k for k, v in self._leases.items() if v.dataset == name]:
                del self._leases[lease_id]
            for key in [k for k in self._share_status if k[0] == name]:
                del self._share_status[key]
            self._store.keep(functools.partial(self._store.delete_dataset, name, self._wall()))
        log.info("dataset %s removed", name)

    # -- failover --------------------------------------------------------------------------------

    async def fail_over(self, server_id: str) -> int:
        """Move every share of a server that is gone (failed, or stopped past ``restart_grace``):
        one it was handing off goes to the server taking it over, the others as :meth:`_move`
        says; shares being handed *to* it go back to being held by their server alone. Returns
        the shares moved."""
        moved = 0
        for name in sorted(self._datasets):
            async with self._locks.setdefault(name, asyncio.Lock()):
                info = self._datasets.get(name)
                if info is None:
                    continue
                for share in info.shares:
                    if share.handoff_to == server_id:
                        log.warning(
                            "dataset %s: %s, which was taking over samples %d..%d, is gone; %s keeps them",
                            name,
                            server_id,
                            share.first_id,
                            share.end_id - 1,
                            share.server_id,
                        )
                        self._share_status.pop((name, server_id, share.first_id), None)
                        share.handoff_to = ""
                        self._changed(info)
                    elif share.server_id == server_id and await self._fail_share(info, share):
                        moved += 1
        return moved

    async def _fail_share(self, info: kspeed_pb2.DatasetInfo, share: kspeed_pb2.Share) -> bool:
        """Give the share of a gone server the server it was being handed to, if that one serves; else :meth:`_move`."""
        target = share.handoff_to
        share.handoff_to = ""
        record = next((r for r in self._membership.snapshot() if r.id == target and r.state in SERVING), None)
        if record is None:
            return await self._move(info, share)
        old = share.server_id
        share.server_id = target
        self._share_status.pop((info.spec.name, old, share.first_id), None)
        self._changed(info)
        self.failovers += 1
        log.warning(
            "dataset %s: samples %d..%d of %s (gone mid-handoff) are held by %s, which was taking them over",
            info.spec.name,
            share.first_id,
            share.end_id - 1,
            old,
            target,
        )
        return True

    async def rehome(self) -> int:
        """Give the shares held on demand a holder with a copy, where a ready server has the
        regions free now (a spare registered, or a dataset was removed): the dataset is whole
        again once it has loaded. Returns the shares moved."""
        moved = 0
        for name in sorted(self._datasets):
            info = self._datasets.get(name)
            if info is None or not any(s.on_demand for s in info.shares):
                continue
            async with self._locks.setdefault(name, asyncio.Lock()):
                for share in info.shares:
                    if share.on_demand and await self._move(info, share, copy_only=True):
                        moved += 1
        return moved

    def _targets(
        self, info: kspeed_pb2.DatasetInfo, share: kspeed_pb2.Share, *, copy_only: bool
    ) -> list[tuple[kspeed_pb2.ServerRecord, bool]]:
        """Where ``share`` may go, best first, each with whether it would be served on demand: the
        ready servers (never a draining one) with the regions free (an empty spare first, then the
        one with the most room); then, unless ``copy_only``, the ready survivors that can serve it
        on demand (the one serving the fewest such shares first)."""
        old = share.server_id
        ready = [
            r
            for r in self._membership.snapshot()
            if r.state == READY and r.id != old and r.inventory.region_size == info.region_size
        ]
        holding = self.holders()
        roomy = [
            r
            for r in ready
            if (
                self._slice_room(r) >= share.slice_bytes
                if share.slice_bytes
                else self._free_regions(r) >= needed_regions(share)
            )
        ]
        roomy.sort(key=lambda r: (r.id in holding, -self._free_regions(r), r.id))
        targets = [(r, False) for r in roomy]
        if not copy_only:
            load = collections.Counter(s.server_id for d in self._datasets.values() for s in d.shares if s.on_demand)
            survivors = sorted((r for r in ready if r.inventory.regions_window > 0), key=lambda r: (load[r.id], r.id))
            targets += [(r, True) for r in survivors]
        return targets

    async def _give(
        self,
        info: kspeed_pb2.DatasetInfo,
        share: kspeed_pb2.Share,
        target: kspeed_pb2.ServerRecord,
        on_demand: bool,
        *,
        handoff: bool = False,
    ) -> bool:
        """Assign ``share`` to ``target`` and start its load there (``handoff``: while its holder
        serves on); whether the server took it. The record sent is the dataset as it will be once
        the share has gone there."""
        moving = kspeed_pb2.Share()
        moving.CopyFrom(share)
        moving.server_id, moving.on_demand = target.id, on_demand
        record = _record(info)
        record.revision += 1
        planned = next(s for s in record.shares if s.first_id == share.first_id)
        if handoff:
            planned.handoff_to = target.id
        else:
            planned.server_id, planned.on_demand, planned.handoff_to = target.id, on_demand, ""
        request = kspeed_pb2.DatasetRequest(name=info.spec.name, first_id=share.first_id)
        try:
            await self._calls.call(
                target.address, target.id, "AssignShare", self._assignment(info, moving, record=record)
            )
            await self._calls.call(target.address, target.id, "StartPreload", request)
        except KSpeedError as exc:
            log.warning(
                "dataset %s: %s cannot take the share of %s: %s", info.spec.name, target.id, share.server_id, exc
            )
            return False
        return True

    async def _move(self, info: kspeed_pb2.DatasetInfo, share: kspeed_pb2.Share, *, copy_only: bool = False) -> bool:
        """Give ``share`` another holder (:meth:`_targets`), which reloads it in the order the feeds
        consume it, or serves it **on demand**, reading each sample from the backend into its
        production window as feeds need it (the dataset is degraded until :meth:`rehome` finds it a
        holder with room). Returns whether it moved."""
        name, old = info.spec.name, share.server_id
        for target, on_demand in self._targets(info, share, copy_only=copy_only):
            if not await self._give(info, share, target, on_demand):
                continue
            share.server_id, share.on_demand = target.id, on_demand
            self._share_status.pop((name, old, share.first_id), None)
            self._changed(info)
            self.failovers += 1
            if on_demand:
                log.error(
                    "dataset %s: no ready server has %d regions free for samples %d..%d of %s; %s serves them on "
                    "demand, reading each from the backend (the dataset is degraded until a server with room "
                    "registers)",
                    name,
                    share.num_regions,
                    share.first_id,
                    share.end_id - 1,
                    old,
                    target.id,
                )
            else:
                log.warning(
                    "dataset %s: samples %d..%d moved from %s to %s, which loads them",
                    name,
                    share.first_id,
                    share.end_id - 1,
                    old,
                    target.id,
                )
                if copy_only:  # the survivor that served them on demand lets them go
                    await self._release_share(info, old, share.first_id)
            return True
        if not copy_only:
            log.error(
                "dataset %s: no ready server can take samples %d..%d of %s, which is gone; the dataset is degraded "
                "until it returns or a server registers",
                name,
                share.first_id,
                share.end_id - 1,
                old,
            )
        return False

    # -- drains ----------------------------------------------------------------------------------

    def plan_drain(self, server_id: str, *, allow_degraded: bool) -> list[kspeed_pb2.ShareRef]:
        """The shares a drain of ``server_id`` hands off, once it is checked that each has somewhere
        to go (changes nothing).

        Raises:
            CapacityError: a share has no ready server with room (and may not go on demand), named
                with what would let the drain go ahead.
        """
        refs = []
        for name in sorted(self._datasets):
            info = self._datasets[name]
            for share in info.shares:
                if share.server_id != server_id:
                    continue
                refs.append(kspeed_pb2.ShareRef(dataset=name, first_id=share.first_id))
                if share.handoff_to or self._targets(info, share, copy_only=not allow_degraded):
                    continue
                need = f"{share.slice_bytes} bytes" if share.slice_bytes else f"{needed_regions(share)} region(s)"
                raise CapacityError(
                    f"cannot drain {server_id}: no ready server has {need} free for samples {share.first_id}.."
                    f"{share.end_id - 1} of dataset {name!r}; start a spare server, remove a dataset, or let a "
                    "survivor serve it on demand (kspeed server drain --allow-degraded)"
                )
        return refs

    def start_drain(self, server_id: str, *, allow_degraded: bool) -> None:
        """Begin handing ``server_id``'s shares off (in the background; see :meth:`continue_drain`)."""
        self._degrade[server_id] = allow_degraded
        self._spawn(self.continue_drain(server_id), f"drain-{server_id}")

    async def continue_drain(self, server_id: str) -> int:
        """Hand each share of a draining server that is not being handed off yet to a ready server
        with room (it loads it while the draining server serves on; :meth:`on_heartbeat` moves it
        once loaded), or, where the drain allows it and no server has room, to a survivor that
        serves it on demand at once. Called again as servers become ready. Returns the handoffs begun."""
        begun = 0
        allow_degraded = self._degrade.get(server_id, False)
        for name in sorted(self._datasets):
            info = self._datasets.get(name)
            if info is None or not any(s.server_id == server_id and not s.handoff_to for s in info.shares):
                continue
            async with self._locks.setdefault(name, asyncio.Lock()):
                for share in info.shares:
                    if share.server_id != server_id or share.handoff_to:
                        continue
                    for target, on_demand in self._targets(info, share, copy_only=not allow_degraded):
                        if not await self._give(info, share, target, on_demand, handoff=not on_demand):
                            continue
                        if on_demand:  # nothing to load: it serves from the backend at once
                            share.server_id, share.on_demand = target.id, True
                            self._changed(info)
                            self.handoffs += 1
                            log.warning(
                                "dataset %s: drain of %s: no server has room for samples %d..%d; %s serves them on "
                                "demand (degraded)",
                                name,
                                server_id,
                                share.first_id,
                                share.end_id - 1,
                                target.id,
                            )
                            self._spawn(self._release_share(info, server_id, share.first_id), f"release-{name}")
                        else:
                            share.handoff_to = target.id
                            self._changed(info)
                            log.info(
                                "dataset %s: drain of %s: %s takes over samples %d..%d (loading while %s serves them)",
                                name,
                                server_id,
                                target.id,
                                share.first_id,
                                share.end_id - 1,
                                server_id,
                            )
                        begun += 1
                        break
        return begun

    def _complete_handoff(self, status: kspeed_pb2.ShareStatus, server_id: str) -> None:
        """Move a share to the server taking it over once that server reports it loaded; the old
        holder is then told to drop it, which ends its feeds there (their clients follow the share)."""
        info = self._datasets.get(status.dataset)
        share = next((s for s in info.shares if s.first_id == status.first_id), None) if info else None
        if info is None or share is None or share.handoff_to != server_id or not _loaded(status, share):
            return
        old = share.server_id
        share.server_id, share.handoff_to = server_id, ""
        self._share_status.pop((info.spec.name, old, share.first_id), None)
        self._changed(info)
        self.handoffs += 1
        log.warning(
            "dataset %s: samples %d..%d handed off from %s to %s",
            info.spec.name,
            share.first_id,
            share.end_id - 1,
            old,
            server_id,
        )
        self._spawn(self._release_share(info, old, share.first_id), f"release-{info.spec.name}")

    async def _release_share(self, info: kspeed_pb2.DatasetInfo, server_id: str, first: int) -> None:
        """Tell ``server_id`` to drop one share of ``info`` that is held elsewhere now (its next
        heartbeat would say so too)."""
        record = next((r for r in self._membership.snapshot() if r.id == server_id), None)
        if record is None or record.state not in SERVING:
            return
        request = kspeed_pb2.DatasetRequest(name=info.spec.name, first_id=first)
        try:
            await self._calls.call(record.address, record.id, "DropDataset", request)
        except KSpeedError as exc:
            log.warning("dataset %s: %s could not drop share %d..: %s", info.spec.name, server_id, first, exc)

    async def preload(self, name: str) -> kspeed_pb2.DatasetInfo:
        """Start (or join) the preload of every share."""
        info = self.get(name)
        for share in info.shares:
            address = info.server_addresses.get(share.server_id)
            if address is None:
                raise UnavailableError(
                    f"dataset {name!r}: server {share.server_id} holding samples "
                    f"{share.first_id}..{share.end_id - 1} is not registered"
                )
            status = await self._calls.call(
                address, share.server_id, "StartPreload", kspeed_pb2.DatasetRequest(name=name, first_id=share.first_id)
            )
            self._share_status[(name, share.server_id, share.first_id)] = status
        return self.get(name)

    # -- leases ----------------------------------------------------------------------------------

    def _new_lease(self, dataset: str, holder: str, ttl: float) -> kspeed_pb2.Lease:
        ttl = ttl or self._lease_ttl
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

    def _lease(self, lease_id: str) -> kspeed_pb2.Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            dataset = lease_id.partition("/")[0]
            why = (
                "the dataset was removed"
                if dataset not in self._datasets
                else "it expired or was released; attach again"
            )
            raise NotFoundError(f"lease {lease_id!r} on dataset {dataset!r} is unknown: {why}")
        return lease

    def renew(self, lease_id: str) -> kspeed_pb2.Lease:
        """Extend a lease by its TTL. A lease this registry does not know on a dataset it does (the
        registry was rebuilt from the servers, or the lease expired while its job was stalled) is
        taken up again: the job that renews it is alive.

        Raises:
            NotFoundError: neither the lease nor its dataset is known.
        """
        dataset = lease_id.partition("/")[0]
        if lease_id not in self._leases and dataset in self._datasets and re.fullmatch(LEASE_ID, lease_id):
            lease = kspeed_pb2.Lease(id=lease_id, dataset=dataset, holder=LOST_LEASE_HOLDER, ttl_s=self._lease_ttl)
            self._leases[lease_id] = lease
            log.warning(
                "lease %s on dataset %s was unknown here; taken up again for the job renewing it", lease_id, dataset
            )
        lease = self._lease(lease_id)
        lease.expires_unix = self._wall() + lease.ttl_s
        self._store.keep(functools.partial(self._store.save_lease, lease))
        return lease

    def release(self, lease_id: str) -> None:
        """End a lease now."""
        self._lease(lease_id)
        del self._leases[lease_id]
        self._store.keep(functools.partial(self._store.delete_lease, lease_id))

    async def expire(self) -> None:
        """Drop expired leases, then remove job datasets that no lease holds any more."""
        now = self._wall()
        for lease_id, lease in list(self._leases.items()):
            if lease.expires_unix <= now:
                log.info("lease %s of %r expired", lease_id, lease.holder)
                del self._leases[lease_id]
                self._store.keep(functools.partial(self._store.delete_lease, lease_id))
        held = {lease.dataset for lease in self._leases.values()}
        held |= {name for name, until in self._orphaned.items() if until > now}
        for name, info in list(self._datasets.items()):
            if info.owner == JOB and name not in held:
                log.info("dataset %s: no job holds a lease any more; freeing its memory", name)
                try:
                    await self.remove(name)
                except KSpeedError as exc:
                    log.warning("dataset %s: removal failed: %s", name, exc)
