"""The dataset catalog: registration, allocation to servers, leases and preload progress.

The manager owns this hard state (SQLite); servers hold the data. Registering a dataset asks one
ready server to list the backend (the manager has no backend credentials; the lister answers with
its region layout, one entry per region, never one per sample), allocates whole regions on servers
with :func:`kspeed.manager.allocator.allocate_regions` (or, for a dataset that does not fit or has a
memory policy, a window per share with :func:`~kspeed.manager.allocator.allocate_window`), and
assigns each server its share; a
failure on any server undoes the assignments already made, so nothing is left half-registered.

A dataset created by a job lives while some lease on it does (:mod:`kspeed.manager.leases`); a
dataset added by an operator lives until it is removed. How shares move between servers (failover,
handoff, rehome) is :mod:`kspeed.manager.moves`; what the catalog holds, :mod:`kspeed.manager.catalog_state`.

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
import time
from collections.abc import Callable

from kspeed import names, uris, wire
from kspeed.errors import (
    CapacityError,
    ChangedError,
    ConflictError,
    DatasetError,
    KSpeedError,
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
from kspeed.manager.catalog_state import record_of
from kspeed.manager.membership import JOINING, READY, Membership
from kspeed.manager.moves import ShareMoves
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
JOIN_POLL = 0.05  # seconds between looks at servers that are still joining


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


class DatasetCatalog(ShareMoves):
    """Datasets, their allocations and leases: registration, removal, what holders report, and the
    datasets taken back from the servers' records."""

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
        super().__init__(store, membership, calls, lease_ttl=lease_ttl, wall=wall)
        self._verify_on_attach = verify_on_attach
        self._verified: dict[str, float] = {}
        self._join_wait = join_wait

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
            self._datasets[name] = record_of(reported)
            self._adopted.add(name)
            if reported.owner == JOB:
                self.leases.hold_for_renewal(name)
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

    async def create(self, request: kspeed_pb2.CreateDatasetRequest) -> kspeed_pb2.CreateDatasetReply:
        """Register a dataset or attach to the existing one of that name."""
        spec = request.spec
        validate_spec(spec)
        owner = request.owner or JOB
        names.HOLDER.check(request.holder)
        if request.lease_ttl_s < 0 or request.lease_ttl_s > 86400:
            raise ProtocolError(f"lease_ttl_s {request.lease_ttl_s} must be between 0 and 86400")
        async with self._lock(spec.name):
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
                reply.lease.CopyFrom(self.leases.new(spec.name, request.holder, request.lease_ttl_s))
            reply.dataset.CopyFrom(self.get(spec.name))
            return reply

    async def _verify(self, info: kspeed_pb2.DatasetInfo) -> None:
        """Before a job attaches: have every holder compare its share with the backend, and refuse a
        dataset whose files changed.

        Each holder compares in its backend's cheapest way that notices a listed file's change
        (``CheckShare`` with ``attach``: one ``stat`` per local file, one paged listing of an object
        store, a manifest's stamp; :meth:`~kspeed.server.backend.sources.Source.verify`), the holders
        at once. One check per :data:`VERIFY_TTL` per dataset, so the ranks of a job attaching
        together share it. A change marks the dataset changed for good.

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
            statuses, why = await self._check_shares(info, attach=True)
            changed = sum(int(status.changed_samples) for status in statuses)
            if not changed and not why:
                self._verified[name] = now
                return
            info.changed_reason = why or (
                f"the backend's listing changed since registration ({changed} sample(s) differ from it)"
            )
            self._store.keep(functools.partial(self._store.save_dataset, info))
            log.error("dataset %s: %s", name, info.changed_reason)
        live = self._live(info)
        named = "; ".join(live.changes) or "the changed samples are being determined"
        raise ChangedError(
            f"dataset {name!r}: {info.changed_reason or 'backend files changed after they were loaded'}: {named}; "
            f"its cached bytes are stale and not served: remove it (kspeed dataset rm {name} --force) and register it "
            "again",
            dataset=name,
        )

    async def _check_shares(
        self, info: kspeed_pb2.DatasetInfo, *, attach: bool = False
    ) -> tuple[list[kspeed_pb2.ShareStatus], str]:
        """Have every ready holder compare its whole share with its listing now, the holders at once;
        their reports name the changes. Returns the reports, and why the dataset counts as changed
        where a holder's backend refused the comparison itself (e.g. its root is gone), else ``""``."""
        name = info.spec.name
        states = {r.id: r for r in self._membership.snapshot()}
        holders = [states[sid] for sid in dict.fromkeys(s.server_id for s in info.shares) if sid in states]
        request = kspeed_pb2.CheckShareRequest(name=name, attach=attach)

        async def check(record: kspeed_pb2.ServerRecord) -> kspeed_pb2.ShareStatus | str | None:
            try:
                status = await self._calls.call(record.address, record.id, "CheckShare", request)
            except DatasetError as exc:
                return str(exc)
            except KSpeedError as exc:
                log.warning("dataset %s: %s could not check its share: %s", name, record.id, exc)
                return None
            self._share_status[(name, record.id, status.first_id)] = status
            return status

        found = await asyncio.gather(*(check(r) for r in holders if r.state == READY))
        statuses = [f for f in found if isinstance(f, kspeed_pb2.ShareStatus)]
        return statuses, next((f for f in found if isinstance(f, str)), "")

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
        listing = kspeed_pb2.ListingSource(server_id=lister.id, address=lister.address, listing_id=described.listing_id)
        await self._assign_all(info, addresses, listing)
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

    async def _assign_all(
        self, info: kspeed_pb2.DatasetInfo, addresses: dict[str, str], listing: kspeed_pb2.ListingSource
    ) -> None:
        """Assign every share of a new dataset, the servers at once (each fetches the listing from
        its ``listing`` server, or lists the backend when it cannot), one server's shares in turn.
        A failure anywhere, or the caller giving up, drops the share on every server it was sent to
        (the one whose call failed too: it may have taken it as the call failed), then is raised.

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
                request = self._assignment(info, share)
                if listing.listing_id:
                    request.listing.CopyFrom(listing)
                await self._calls.call(addresses[server_id], server_id, "AssignShare", request)

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
        async with self._lock(name):
            info = self.get(name)
            held = self.leases.of(name)
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
            self.leases.forget(name)
            for key in [k for k in self._share_status if k[0] == name]:
                del self._share_status[key]
            self._store.keep(functools.partial(self._store.delete_dataset, name, self._wall()))
        log.info("dataset %s removed", name)

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

    def renew(self, lease_id: str) -> kspeed_pb2.Lease:
        """Extend a lease by its TTL (:meth:`Leases.renew <kspeed.manager.leases.Leases.renew>`)."""
        return self.leases.renew(lease_id)

    def release(self, lease_id: str) -> None:
        """End a lease now."""
        self.leases.release(lease_id)

    async def expire(self) -> None:
        """Drop expired leases, then remove job datasets that no lease holds any more."""
        self.leases.expire()
        held = self.leases.held()
        for name, info in list(self._datasets.items()):
            if info.owner == JOB and name not in held:
                log.info("dataset %s: no job holds a lease any more; freeing its memory", name)
                try:
                    await self.remove(name)
                except KSpeedError as exc:
                    log.warning("dataset %s: removal failed: %s", name, exc)
