"""The datasets a server hosts: the shares the manager assigns it.

A share is a contiguous range of sample IDs held in consecutive virtual regions of the pool. A
server usually holds one share of a dataset; after a failover it may hold more (one it took over
from a failed server), each its own range of the dataset's virtual regions. A share taken
**on demand** (no server had the regions free) holds no regions at all: its samples are read from
the backend into the production window as feeds need them. A share held under a **memory policy**
(its dataset does not fit the cluster, or asked for one) holds only its window's regions: its
samples are read from the backend into them in the order the plans consume them
(:mod:`kspeed.server.production.core`).

The host opens the backend listing, checks it against the fingerprint the manager recorded (a changed
backend is reported, never served stale), allocates the pool regions, loads on request, and
answers the broadcast-reply lookup and pull reads. The manager's assignments are kept in the state
directory so that a restarted server re-adopts its sealed regions before the manager speaks again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import numpy as np

from kspeed import names, wire
from kspeed.errors import (
    ConfigError,
    DatasetError,
    KSpeedError,
    NotFoundError,
    NotHeldError,
    ProtocolError,
)
from kspeed.layout import region_bounds
from kspeed.preprocess.pipeline import Pipeline
from kspeed.preprocess.runner import Runner, check_allowed
from kspeed.proto import kspeed_pb2
from kspeed.server.backend.access import Backend
from kspeed.server.backend.changes import Change, ChangeLog, ChangeWatch
from kspeed.server.backend.sources import Source, open_source
from kspeed.server.backend.tree_watch import ShareWatch
from kspeed.server.hosting.cached_source import CachedSource
from kspeed.server.hosting.integrity import SampleStore
from kspeed.server.hosting.listings import Listings, fetch_failed
from kspeed.server.hosting.preload import Preloader
from kspeed.server.hosting.records import AssignmentRecords
from kspeed.server.memory.pool import WINDOW_OWNER, MemoryPool, RegionState
from kspeed.server.memory.slices import SharedRegions, Slice
from kspeed.server.memory.statefile import Snapshot
from kspeed.server.prep.workers import PrepWorkers
from kspeed.server.production.policies import MemoryPolicy, share_policy
from kspeed.server.production.state import EpochFigures

log = logging.getLogger(__name__)

MAX_REPORTED_ERRORS = 5
REMEMBERED_DROPS = 256  # dropped datasets whose reason is kept for later calls about them
RETAKE_INTERVAL = 30.0  # seconds between attempts to take again a share this server failed to take
EVENT_INTERVAL = 1.0  # seconds between looks at the files a share's watch saw change


def _vindices(share: kspeed_pb2.Share) -> range:
    """The virtual regions a share holds here: all of its regions, with a memory policy its window's
    (the first ``memory_regions``), none while served on demand or as a slice of a shared region."""
    if share.on_demand or share.slice_bytes:
        return range(0)
    held = share.memory_regions if _policy(share).own_window else share.num_regions
    return range(share.first_region, share.first_region + held)


def _policy(share: kspeed_pb2.Share) -> MemoryPolicy:
    """The policy the share is assigned (see :func:`~kspeed.server.production.policies.share_policy`).

    Raises:
        ConfigError: its memory policy is not one this server knows.
    """
    return share_policy(share.policy, on_demand=share.on_demand)


def _known(share: kspeed_pb2.Share) -> bool:
    """Whether the share's memory policy is one this server knows (else taking it fails, saying so)."""
    try:
        _policy(share)
    except ConfigError:
        return False
    return True


def _same_share(a: kspeed_pb2.AssignShareRequest, b: kspeed_pb2.AssignShareRequest) -> bool:
    """Whether two assignments give the same share (the record of the dataset sent along is not part of it)."""
    return (a.spec, a.fingerprint, a.region_size, a.share) == (b.spec, b.fingerprint, b.region_size, b.share)


def _span(share: kspeed_pb2.Share) -> str:
    return f"{share.first_id}..{share.end_id - 1}"


def fingerprint_pb(source: Source) -> kspeed_pb2.Fingerprint:
    """A source's fingerprint as a protobuf message."""
    fp = source.fingerprint
    return kspeed_pb2.Fingerprint(count=fp.count, total_bytes=fp.total_bytes, digest=fp.digest)


def _listed_as(source: Source, fingerprint: kspeed_pb2.Fingerprint) -> bool:
    """Whether ``source`` is the listing ``fingerprint`` was made of (a local tree registered before
    its tags were its stamps' bytes is recognised by its digest as it was then)."""
    if fingerprint_pb(source) == fingerprint:
        return True
    same_size = (source.fingerprint.count, source.fingerprint.total_bytes) == (
        fingerprint.count,
        fingerprint.total_bytes,
    )
    return same_size and bool(fingerprint.digest) and source.legacy_digest() == fingerprint.digest


def decode_ids(data: bytes, dataset: str, count: int) -> np.ndarray:
    """Packed sample IDs (:mod:`kspeed.wire`), checked against the dataset's size.

    Raises:
        ProtocolError: the bytes are not whole int64 values.
        NotFoundError: an ID lies outside ``0..count-1`` (the first one is named).
    """
    ids = wire.unpack_i64(data, f"dataset {dataset!r}: sample IDs")
    bad = (ids < 0) | (ids >= count)
    if bad.any():
        sample = int(ids[bad][0])
        raise NotFoundError(
            f"dataset {dataset!r} has {count} samples (IDs 0..{count - 1}); sample {sample} does not exist"
        )
    return ids


ShareKey = tuple[str, int]  # (dataset, first sample ID of the share)


class _ShareLocks:
    """A lock per share being taken, so two assignments of one share run one after the other
    (kept only while some assignment of that share is under way)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[ShareKey, tuple[threading.Lock, int]] = {}

    @contextlib.contextmanager
    def hold(self, key: ShareKey) -> Iterator[None]:
        with self._lock:
            lock, users = self._held.get(key, (threading.Lock(), 0))
            self._held[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._lock:
                lock, users = self._held[key]
                if users > 1:
                    self._held[key] = (lock, users - 1)
                else:
                    del self._held[key]


@dataclass
class Hosted:
    """One dataset share held by this server."""

    request: kspeed_pb2.AssignShareRequest
    source: Source
    preloader: Preloader
    store: SampleStore
    watch: ShareWatch | None = None  # a local tree's folders watched (which files may have changed)

    @property
    def name(self) -> str:
        return self.request.spec.name

    @property
    def key(self) -> ShareKey:
        return self.request.spec.name, int(self.request.share.first_id)

    @property
    def on_demand(self) -> bool:
        """Held without a copy: read from the backend as feeds need it (see the module docstring)."""
        return self.request.share.on_demand

    @property
    def policy(self) -> MemoryPolicy:
        """The policy the share is held under: whole, on demand, or a memory policy with a window
        of its own (:mod:`kspeed.server.production.policies`)."""
        return _policy(self.request.share)

    def window_regions(self) -> list[int]:
        """With a memory policy, the pool regions of the share's window (in virtual order)."""
        if not self.policy.own_window:
            return []
        held = {r.vindex: r.index for r in self.preloader.pool.regions(self.name)}
        return [held[v] for v in _vindices(self.request.share)]

    @property
    def changes(self) -> ChangeLog:
        """The share's samples whose backend file changed since the listing."""
        return self.preloader.changes


class DatasetHost:
    """All dataset shares of one server.

    Args:
        pool: the server's memory pool.
        backend: backend access under the operator's allow-list.
        state_dir: where assignments are kept across restarts.
        preload_threads: backend reads in flight per preload.
        scrub_interval: seconds between background integrity scrubs of a loaded share (0: off).
    """

    def __init__(
        self,
        pool: MemoryPool,
        backend: Backend,
        state_dir: str,
        *,
        preload_threads: int = 16,
        scrub_interval: float = 0.0,
        change_check_interval: float = 300.0,
        change_check_budget: int = 0,
        preprocess_allow: tuple[str, ...] = (),
        prep: PrepWorkers | None = None,
        listings: Listings | None = None,
    ) -> None:
        self.pool = pool
        self.listings = listings
        self.slices = SharedRegions(pool)
        self.preprocess_allow = preprocess_allow
        self.prep = prep
        self.backend = backend
        self._records = AssignmentRecords(state_dir)
        self._threads = preload_threads
        self._scrub_interval = scrub_interval
        self._lock = threading.RLock()  # never held over backend I/O: heartbeats and status calls take it
        self._taking = _ShareLocks()
        self._hosted: dict[ShareKey, Hosted] = {}
        self._recording: dict[ShareKey, kspeed_pb2.AssignShareRequest] = {}  # recorded ahead of being held
        self._dropped: dict[str, str] = {}  # recently dropped datasets and why, to answer with the reason
        self.on_drop: Callable[[str, int, str], None] = lambda name, first, reason: None  # e.g. close its feeds
        self.on_changed: Callable[[str, list[Change]], None] = lambda name, changes: None  # e.g. tell the feeders
        self.on_loaded: Callable[[str], None] = lambda name: None  # a share's preload ended (e.g. report it now)
        # a share's per-epoch figures under a memory policy (production keeps them)
        self.figures: Callable[[ShareKey], list[EpochFigures]] = lambda key: []
        self.watch = ChangeWatch(self._checks, interval=change_check_interval, budget=change_check_budget)
        self._retaken: dict[ShareKey, float] = {}  # share -> when it was last taken again
        self.assignments = 0  # shares assigned so far (a share's number is when it was assigned)
        self._assigned: dict[ShareKey, int] = {}
        self._retaking: list[threading.Thread] = []
        self._events_lock = threading.Lock()  # one look at the watches' events at a time
        self._closing = threading.Event()
        self._events = threading.Thread(target=self._follow_events, name="kspeed-share-events", daemon=True)

    # -- backend changes -------------------------------------------------------------------------

    def _checks(self) -> list[tuple[ChangeLog, Callable[[np.ndarray], list[Change]]]]:
        with self._lock:
            return [(h.changes, h.source.check) for h in self._hosted.values()]

    def check(self, name: str, limit: int = 0, *, attach: bool = False) -> kspeed_pb2.ShareStatus:
        """Compare ``name``'s backend files with the listing now: all of each share, or the next
        ``limit`` of each, or (``attach``) all of each in the backend's cheapest way
        (:meth:`~kspeed.server.backend.sources.Source.verify`); returns the status of its first share here.

        Raises:
            NotFoundError: the dataset is not hosted here.
            BackendError: the backend cannot be asked.
        """
        shares = self.shares(name)
        for hosted in shares:
            changes = hosted.changes
            whole = attach or limit <= 0
            ids = np.arange(changes.lo, changes.hi, dtype=np.int64) if whole else changes.next_batch(limit)
            if not attach:
                changes.record(hosted.source.check(ids))
                changes.counted(len(ids))
                continue
            with self._events_lock:
                touched = hosted.watch.touched(always=True) if hosted.watch is not None else None
                if touched is None:
                    changes.record(hosted.source.verify(ids))
                else:  # every other file is as listed: the watch saw no event naming it
                    changes.record(hosted.source.check(touched))
            changes.counted(len(ids))
        return self.status(name, shares[0].key[1])

    def _follow_events(self) -> None:
        """Compare the files the shares' watches saw change, every :data:`EVENT_INTERVAL`."""
        while not self._closing.wait(EVENT_INTERVAL):
            self.look_at_events()

    def look_at_events(self) -> int:
        """Compare the files each share's watch named since the last look with the listing; returns
        the new changes found (a share whose watch no longer sees everything waits for an attach)."""
        with self._lock:
            watched = [h for h in self._hosted.values() if h.watch is not None]
        found = 0
        with self._events_lock:
            for hosted in watched:
                assert hosted.watch is not None
                touched = hosted.watch.touched(always=False)
                if touched is None or not len(touched):
                    continue
                try:
                    found += len(hosted.changes.record(hosted.source.check(touched)))
                except KSpeedError as exc:  # the backend may be away a while: the attach compares again
                    log.warning("dataset %s: cannot compare the files that changed: %s", hosted.name, exc)
        return found

    # -- assignments -----------------------------------------------------------------------------

    def restore(self) -> None:
        """Re-adopt the shares recorded before a restart (errors are logged, not fatal: a server
        whose state disk is full starts with what it can re-adopt, and says what it cannot write)."""
        requests = self._records.load()
        keep = frozenset((r.spec.name, v) for r in requests if _known(r.share) for v in _vindices(r.share))
        for request in requests:
            try:
                self.assign(request, keep=keep, save=False)
                log.info("dataset %s: share %s re-adopted after restart", request.spec.name, _span(request.share))
            except KSpeedError as exc:
                log.error("dataset %s: cannot re-adopt share %s: %s", request.spec.name, _span(request.share), exc)
        if len(self.keys()) < len(requests):
            self._record()

    def reconcile(self, assignments: list[kspeed_pb2.AssignShareRequest], *, before: int | None = None) -> None:
        """Make the hosted shares exactly ``assignments`` (the manager's word at registration): the
        ones held already are kept, the others dropped, and the ones not held yet are taken and
        loaded in the background (:meth:`retake`: a listing can take minutes, and this runs on the
        thread that heartbeats).

        ``before``: :attr:`assignments` when the registration was sent; shares assigned since
        (the manager assigning one to the server it just declared ready) are newer than its reply
        and stay.
        """
        wanted = {(a.spec.name, int(a.share.first_id)): a for a in assignments}
        for name, first in set(self.keys()) - set(wanted):
            if before is not None and self._assigned.get((name, first), 0) > before:
                continue
            log.info("dataset %s: the manager no longer assigns share %d.. here; dropping", name, first)
            self.drop(name, "the manager assigns its share to another server", final=False, first=first)
        with self._lock:
            held = {key: h.request for key, h in self._hosted.items()}
        new = []
        for key, request in wanted.items():
            if key not in held or not _same_share(held[key], request):
                new.append(request)  # to list and load: in the background, as the agent must heartbeat
                continue
            try:
                self.assign(request)  # held already: counted as assigned now (nothing is listed)
            except KSpeedError as exc:
                log.error("dataset %s: cannot take the assigned share: %s", request.spec.name, exc)
        if new:
            self.retake(new)

    def retake(self, requests: list[kspeed_pb2.AssignShareRequest]) -> None:
        """Take again shares the manager assigns here that this server did not report (dropped by
        hand, or lost): each is assigned and reloaded in the background (a listing can take long;
        heartbeats go on), at most once per :data:`RETAKE_INTERVAL` per share."""
        now = time.monotonic()
        for request in requests:
            key = (request.spec.name, int(request.share.first_id))
            with self._lock:
                self._retaking = [t for t in self._retaking if t.is_alive()]
                if key in self._hosted or now - self._retaken.get(key, -RETAKE_INTERVAL) < RETAKE_INTERVAL:
                    continue
                self._retaken[key] = now
                thread = threading.Thread(target=self._retake, args=(request,), name=f"retake-{key[0]}", daemon=True)
                self._retaking.append(thread)
            thread.start()

    def _retake(self, request: kspeed_pb2.AssignShareRequest) -> None:
        name, first = request.spec.name, int(request.share.first_id)
        try:
            self.assign(request)
            self.start_preload(name, first)
            log.warning("dataset %s: took share %s again (the manager assigns it here)", name, _span(request.share))
        except KSpeedError as exc:
            log.error("dataset %s: cannot take the assigned share again: %s", name, exc)

    def describe(self, spec: kspeed_pb2.DatasetSpec) -> kspeed_pb2.DescribeDatasetReply:
        """List a dataset's backend for the manager: its samples laid out in this server's regions
        (where each region starts, the bytes in it), classes and fingerprint.

        A pipeline is checked first: every server stage must resolve on this server's preprocessing
        workers (built-in ops with their parameters, modules on the operator's preprocess allow-list).
        """
        self.check_pipeline(spec)
        raw = open_source(self.backend, spec.name, spec.uri, kind=spec.kind or "auto")
        listing_id = self.listings.keep(spec, raw) if self.listings is not None else ""
        source = self._cached(spec, raw, describing=True)
        if spec.labels == "dirname" and (source.labels is None or source.kind == "tar"):
            raise DatasetError(
                f"dataset {spec.name!r}: labels 'dirname' need every sample in a class directory under {spec.uri}",
                dataset=spec.name,
            )
        if spec.labels == "cls" and (source.labels is None or source.kind != "tar"):
            raise DatasetError(
                f"dataset {spec.name!r}: labels 'cls' need tar shards whose every sample has a .cls member "
                f"({spec.uri} is {source.kind})",
                dataset=spec.name,
            )
        region_size = self.pool.region_size
        starts = region_bounds(source.sizes, region_size, dataset=spec.name)
        cum = np.concatenate(([0], np.cumsum(source.sizes, dtype=np.int64)))
        return kspeed_pb2.DescribeDatasetReply(
            fingerprint=fingerprint_pb(source),
            class_names=list(source.classes),
            region_size=region_size,
            sample_dtype=source.dtype,
            sample_shape=list(source.row_shape),
            shard_starts=wire.pack_i64(source.shard_starts()) if source.shard_of is not None else b"",
            region_starts=wire.pack_i64(starts),
            region_bytes=wire.pack_i64(cum[starts[1:]] - cum[starts[:-1]]),
            listing_id=listing_id,
        )

    def check_pipeline(self, spec: kspeed_pb2.DatasetSpec, *, resolve: bool = True) -> None:
        """Refuse a pipeline whose server stages (up to the last declared output) this server could
        not run, with the reason; client and GPU stages are the client's to run.

        Only the preprocessing workers import the stages' modules, never this process: an import
        holds its interpreter for seconds (torchvision's), and this process answers health probes
        and heartbeats. What needs no import (ops, parameters, the module allow-list) is checked
        here; the workers start resolving the stages at once, and with ``resolve`` this waits for
        them (a dataset being described, at registration). An assignment does not wait: on a spare
        taking a failed server's share that import would lengthen the jobs' pause, and a stage that
        does not resolve fails each of its samples with the reason. Without workers (a host built
        by itself, in tests) the stages are resolved here.

        Raises:
            AccessDeniedError: a stage's module is not on the allow-list.
            ConfigError: a stage cannot be resolved or has bad parameters.
        """
        if spec.pipeline.stages:
            pipeline = Pipeline.from_proto(spec.pipeline)
            stages = pipeline.server_stages
            check_allowed(pipeline, self.preprocess_allow, dataset=spec.name, stages=stages)
            if self.prep is None:
                Runner(pipeline, allow=self.preprocess_allow, dataset=spec.name, stages=stages)
            elif stages:
                message = spec.pipeline.SerializeToString()
                self.prep.warm(spec.name, message, stages)
                if resolve:
                    self.prep.check(spec.name, message, stages)
            pipeline.cached_stages(spec.cache)
        elif spec.cache:
            raise ConfigError(f"dataset {spec.name!r}: cache {spec.cache!r} needs a pipeline", field="cache")

    def _open(self, request: kspeed_pb2.AssignShareRequest) -> Source:
        """The dataset's listing for an assigned share, as this server stores its samples: fetched
        from the server that listed it at registration where the assignment names one (listed here
        when it cannot be fetched, or names none).

        Raises:
            ConfigError: the dataset is cached preprocessed and this server runs no preprocessing workers.
        """
        spec, where = request.spec, request.listing
        raw = None
        if self.listings is not None and where.listing_id:
            try:
                raw = self.listings.fetch(spec, where)
            except (KSpeedError, grpc.RpcError) as exc:
                fetch_failed(spec, where, exc)
        if raw is None:
            raw = open_source(self.backend, spec.name, spec.uri, kind=spec.kind or "auto")
        return self._cached(spec, raw)

    def _cached(self, spec: kspeed_pb2.DatasetSpec, source: Source, *, describing: bool = False) -> Source:
        """``source`` as this server stores the dataset's samples: cached preprocessed, or raw.

        Raises:
            ConfigError: the dataset is cached preprocessed and this server runs no preprocessing workers.
        """
        if not spec.cache:
            return source
        if self.prep is None and not describing:
            raise ConfigError(
                f"dataset {spec.name!r} is cached preprocessed and this server runs no preprocessing workers",
                field="cache",
            )
        pipeline = Pipeline.from_proto(spec.pipeline)
        return CachedSource(source, pipeline, pipeline.cached_stages(spec.cache), self.prep)

    def assign(
        self,
        request: kspeed_pb2.AssignShareRequest,
        *,
        keep: frozenset[tuple[str, int]] = frozenset(),
        save: bool = True,
    ) -> kspeed_pb2.ShareStatus:
        """Hold ``request.share`` of the dataset (idempotent). A share of the dataset here that
        starts at the same sample, or overlaps it, is replaced; other shares stay.

        The pipeline is checked and the backend listed before the host's lock is taken: a listing
        can take minutes, and heartbeats, health and status calls need the lock meanwhile.
        Assignments of one share wait for each other, so the second finds the first's share and
        changes nothing; what else changed meanwhile (other shares, free regions) is looked at
        under the lock.

        ``keep``: (dataset, virtual region) pairs not to free even when no hosted share holds
        them (the other shares of a restart being re-adopted). ``save``: record the assignment in
        the state directory (a restart re-adopts what is recorded already).

        Raises:
            DatasetError: the backend changed since the dataset was registered.
            CapacityError: the pool lacks free regions (nothing is allocated).
            ConfigError: the manager's region size is not this pool's, or the share's memory policy
                is not one this server knows.
            StateFileError: the assignment cannot be recorded (nothing is allocated or kept).
        """
        name, share = request.spec.name, request.share
        key = (name, int(share.first_id))
        with self._taking.hold(key):
            with self._lock:
                again, newer = self._again(key, request)
                held = self.status(name, key[1]) if again else None
                record = self._snapshot() if newer else None
            if record is not None:
                self._records.record(record)
            if held is not None:
                return held
            if request.region_size != self.pool.region_size:
                raise ConfigError(
                    f"dataset {name!r}: assigned with region size {request.region_size}, this "
                    f"server's pool uses {self.pool.region_size}",
                    field="server.region_size",
                )
            _policy(share)  # (a manager that knows policies this server does not)
            self.check_pipeline(request.spec, resolve=False)
            source = self._open(request)
            watch = self._watch(source, share)
            if request.HasField("listing"):  # where the listing came from is of no use once it is here
                fetched, request = request, kspeed_pb2.AssignShareRequest()
                request.CopyFrom(fetched)
                request.ClearField("listing")
            if not _listed_as(source, request.fingerprint):
                raise DatasetError(
                    f"dataset {name!r}: the backend changed since registration (registered: "
                    f"{request.fingerprint.count} samples, {request.fingerprint.total_bytes} bytes; now: "
                    f"{source.fingerprint}); remove the dataset and register it again",
                    dataset=name,
                )
            recorded = False
            try:
                if save:
                    self._record_ahead(key, request)
                    recorded = True
                with self._lock:
                    status, replaced = self._install(request, source, keep, watch)
            except BaseException:
                if watch is not None:
                    watch.close()
                if save:
                    self._record_after(key, recorded)
                raise
            if save:
                self._record_after(key, replaced)
            return status

    def _record_ahead(self, key: ShareKey, request: kspeed_pb2.AssignShareRequest) -> None:
        """Record ``request`` as held before it is: a restart then re-adopts it (or, when taking it
        fails, what the file lists at worst is one share too many). Written outside the lock.

        Raises:
            StateFileError: it cannot be recorded (nothing is allocated yet).
        """
        with self._lock:
            self._recording[key] = request
            snapshot = self._snapshot()
        self._records.write(snapshot)

    def _record_after(self, key: ShareKey, changed: bool = True) -> None:
        """The share at ``key`` is held now, or failed to be: record what is held where that
        ``changed`` from what :meth:`_record_ahead` wrote."""
        with self._lock:
            self._recording.pop(key, None)
            snapshot = self._snapshot() if changed else None
        if snapshot is not None:
            self._records.record(snapshot)

    def _watch(self, source: Source, share: kspeed_pb2.Share) -> ShareWatch | None:
        """A watch of the share's folders, where its samples are files of a local tree (started
        before any of them is read: :mod:`kspeed.server.backend.tree_watch`)."""
        raw = getattr(source, "raw", source)
        if raw.kind != "dir" or raw.protocol != "file" or raw.keys is None:
            return None
        linked = raw.unwatchable if raw.unwatchable is not None else np.zeros(0, dtype=np.int64)
        watch = ShareWatch.start(raw.dataset, raw.root, raw.keys, share.first_id, share.end_id, linked)
        if watch is not None and not self._events.is_alive() and not self._closing.is_set():
            with contextlib.suppress(RuntimeError):  # started already, by another assignment
                self._events.start()
        return watch

    def _again(self, key: ShareKey, request: kspeed_pb2.AssignShareRequest) -> tuple[bool, bool]:
        """Whether ``request`` is the share held at ``key`` already; if so, it counts as assigned now
        (the manager's word again: as new as a fresh assignment), and whether it carries a newer
        record of the dataset (kept, to be recorded). Called under the lock."""
        current = self._hosted.get(key)
        if current is None or not _same_share(current.request, request):
            return False, False
        self.assignments += 1
        self._assigned[key] = self.assignments
        if current.request.dataset.revision < request.dataset.revision:
            current.request = request
            return True, True
        return True, False

    def _install(
        self,
        request: kspeed_pb2.AssignShareRequest,
        source: Source,
        keep: frozenset[tuple[str, int]],
        watch: ShareWatch | None = None,
    ) -> tuple[kspeed_pb2.ShareStatus, bool]:
        """Hold the share of ``request`` over its listing ``source``: replace the shares it overlaps,
        allocate its regions; on an error nothing of it is left. Returns its status and whether it
        replaced shares. Called under the lock."""
        name, share = request.spec.name, request.share
        key = (name, int(share.first_id))
        policy = _policy(share)
        replaced, missing = self._claim_regions(name, key, share, keep)
        sliced = bool(share.slice_bytes) and not share.on_demand
        try:
            slot = self.slices.take(key, int(share.slice_bytes)) if sliced else None
            preloader = Preloader(
                source,
                self.pool,
                lo=share.first_id,
                hi=share.end_id,
                first_region=share.first_region,
                threads=self._threads,
                on_demand=not policy.home,
                slot=slot,
                changes=ChangeLog(
                    name, share.first_id, share.end_id, on_change=lambda changes: self.on_changed(name, changes)
                ),
            )
            store = SampleStore(preloader)
            self._hosted[key] = Hosted(request, source, preloader, store, watch)
        except KSpeedError:
            self._hosted.pop(key, None)
            if missing:
                self.pool.release(name, missing)
            if sliced:
                self.slices.give(key)
            raise
        preloader.on_finished = lambda: self.on_loaded(name)
        if self._scrub_interval > 0 and policy.home:
            store.start_scrub(self._scrub_interval)
        self.assignments += 1
        self._assigned[key] = self.assignments
        self._dropped.pop(name, None)
        _say_held(name, share, policy, slot)
        return self.status(name, key[1]), replaced

    def _claim_regions(
        self, name: str, key: ShareKey, share: kspeed_pb2.Share, keep: frozenset[tuple[str, int]]
    ) -> tuple[bool, list[int]]:
        """Drop the shares ``share`` overlaps (not recorded: the caller records), release the
        regions no share (nor ``keep``) claims, and allocate the ones it lacks; returns whether
        shares were dropped, and the regions newly allocated (released again on a failure)."""
        replaced = False
        for other in self.shares(name, missing_ok=True):
            s = other.request.share
            if other.key == key or (s.first_id < share.end_id and share.first_id < s.end_id):
                self.drop(name, "its share changed", final=False, first=other.key[1], record=False)
                replaced = True
        wanted = set(_vindices(share))
        claimed = {v for h in self.shares(name, missing_ok=True) for v in _vindices(h.request.share)}
        held = {r.vindex for r in self.pool.regions(name) if r.vindex is not None}
        stale = held - wanted - claimed - {v for n, v in keep if n == name}
        if stale:
            self.pool.release(name, stale)
        missing = sorted(wanted - held)
        if missing:
            self.pool.allocate(name, missing)
        return replaced, missing

    def drop(
        self, name: str, reason: str = "", *, final: bool = True, first: int | None = None, record: bool = True
    ) -> None:
        """Stop serving ``name`` (every share of it here, or only the one starting at ``first``) and
        free the regions (waits for a running preload to finish).

        The share's feeds end first. With ``final`` (the dataset was removed) their clients are
        told ``reason`` (default: it was removed) and end; otherwise (the share is served elsewhere
        now) their connections are only cut, and clients follow the share to its new holder.

        Raises:
            ProtocolError: ``name`` is no dataset name at all.
        """
        names.DATASET.check(name)  # a name that could not be hosted never reaches the logs or the feeders
        reason = reason or (
            f"dataset {name!r} was removed from the cluster" if final else "its share is served elsewhere now"
        )
        with self._lock:
            dropping = [h for h in self.shares(name, missing_ok=True) if first is None or h.key[1] == first]
            whole = first is None or len(dropping) == len(self.shares(name, missing_ok=True))
        if whole:
            self._dropped[name] = reason
            while len(self._dropped) > REMEMBERED_DROPS:
                self._dropped.pop(next(iter(self._dropped)))
        for hosted in dropping:
            self.on_drop(name, hosted.key[1], reason if final else "")
        with self._lock:
            for hosted in dropping:
                self._hosted.pop(hosted.key, None)
                self._assigned.pop(hosted.key, None)
                hosted.store.stop_scrub()
                hosted.preloader.stop()
                if hosted.watch is not None:
                    hosted.watch.close()
            for hosted in dropping:
                self.slices.give(hosted.key)
            if whole:
                self.pool.release(name)
                if self.prep is not None:
                    self.prep.forget(name)
            else:
                for hosted in dropping:
                    self.pool.release(name, _vindices(hosted.request.share))
                    hosted.preloader.forget_index()
            snapshot = self._snapshot() if record else None
        if snapshot is not None:
            self._records.record(snapshot)
        for hosted in dropping:
            log.info("dataset %s: share %s dropped", name, _span(hosted.request.share))

    # -- serving ---------------------------------------------------------------------------------

    def get(self, name: str, first: int | None = None) -> Hosted:
        """The hosted share of ``name`` that starts at sample ``first`` (``None``: the only one here).

        Raises:
            NotHeldError: ``first`` is given and this server holds no share of it starting there (the
                manager moved it elsewhere, or it never was here).
            NotFoundError: ``first`` is not given and this server holds no share of it.
            ProtocolError: ``name`` is no dataset name at all, or ``first`` is not given and this
                server holds several shares of it.
        """
        if first is not None:
            hosted = self._hosted.get((name, int(first)))
            if hosted is not None:
                return hosted
            shares = self.shares(name, missing_ok=True)
            names.DATASET.check(name)
            why = self._dropped.get(name)
            held = ", ".join(_span(h.request.share) for h in shares) or "nothing of it" + (f": {why}" if why else "")
            raise NotHeldError(
                f"dataset {name!r}: this server holds no share starting at sample {first} (holds {held})"
            )
        shares = self.shares(name)
        if len(shares) > 1:
            held = ", ".join(_span(h.request.share) for h in shares)
            raise ProtocolError(f"dataset {name!r}: this server holds {len(shares)} shares ({held}); name the share")
        return shares[0]

    def shares(self, name: str, *, missing_ok: bool = False) -> list[Hosted]:
        """The shares of ``name`` held here, by first sample.

        Raises:
            NotFoundError: none (unless ``missing_ok``).
            ProtocolError: ``name`` is no dataset name at all.
        """
        with self._lock:
            found = sorted((h for k, h in self._hosted.items() if k[0] == name), key=lambda h: h.key[1])
        if found or missing_ok:
            return found
        names.DATASET.check(name)
        why = self._dropped.get(name)
        raise NotFoundError(f"dataset {name!r} is not hosted on this server" + (f": {why}" if why else ""))

    def keep_records(self, records: list[kspeed_pb2.DatasetInfo]) -> None:
        """Keep the newer records of hosted datasets the manager sent with the shares (saved once; a
        full disk is logged: the next record, or the next assignment, is saved again)."""
        newer = {r.spec.name: r for r in records}
        with self._lock:
            changed = False
            for hosted in self._hosted.values():
                record = newer.get(hosted.name)
                if record is not None and record.revision > hosted.request.dataset.revision:
                    hosted.request.dataset.CopyFrom(record)
                    changed = True
            snapshot = self._snapshot() if changed else None
        if snapshot is not None:
            self._records.record(snapshot)

    def held(self) -> list[kspeed_pb2.AssignShareRequest]:
        """The assignments of every hosted share, as the manager sent them (a manager that lost its
        registry rebuilds it from these)."""
        with self._lock:
            return [h.request for h in self._hosted.values()]

    def keys(self) -> list[ShareKey]:
        """(dataset, first sample) of every hosted share."""
        with self._lock:
            return sorted(self._hosted)

    def names(self) -> list[str]:
        """Names of the hosted datasets."""
        with self._lock:
            return sorted({name for name, _ in self._hosted})

    def start_preload(self, name: str, first: int | None = None) -> kspeed_pb2.ShareStatus:
        """Start (or join) the preload of ``name``'s shares here (or of the one starting at
        ``first``); returns the status of the first of them. A share held on demand loads nothing."""
        shares = self.shares(name) if first is None else [self.get(name, first)]
        for hosted in shares:
            hosted.preloader.start()
        return self.status(name, shares[0].key[1])

    def status(self, name: str, first: int | None = None) -> kspeed_pb2.ShareStatus:
        """Progress and health of one share."""
        hosted = self.get(name, first)
        p = hosted.preloader.progress()
        result = hosted.preloader.result()
        errors = [str(e) for e in result.errors[:MAX_REPORTED_ERRORS]]
        mine = set(_vindices(hosted.request.share))
        sealed = sum(1 for r in self.pool.regions(name) if r.state is RegionState.SEALED and r.vindex in mine)
        changes = hosted.changes
        return kspeed_pb2.ShareStatus(
            dataset=name,
            first_id=hosted.key[1],
            regions_sealed=sealed,
            integrity_repairs=hosted.store.counters["repaired"],
            changed_samples=changes.count,
            changes=[str(c) for c in changes.first()],
            samples_checked=changes.checked,
            revision=hosted.request.dataset.revision,
            stage_seconds=self.prep.seconds_of(name) if self.prep is not None else {},
            epochs=[
                kspeed_pb2.EpochFigures(
                    epoch=f.epoch,
                    planned=f.planned,
                    written=f.written,
                    misses=f.misses,
                    backend_bytes=f.backend_bytes,
                    backend_requests=f.backend_requests,
                    stall_s=f.stall_s,
                )
                for f in self.figures(hosted.key)
            ],
            progress=kspeed_pb2.PreloadProgress(
                samples_loaded=p.samples_done,
                samples_total=p.samples_total,
                bytes_loaded=p.bytes_done,
                bytes_total=p.bytes_total,
                bytes_per_s=p.rate_bytes_s,
                running=p.running,
                error_count=p.errors,
                errors=errors,
                samples_read=result.read_samples,
            ),
        )

    def statuses(self) -> list[kspeed_pb2.ShareStatus]:
        """Status of every hosted share (for heartbeats)."""
        out = []
        for name, first in self.keys():
            with contextlib.suppress(NotFoundError):
                out.append(self.status(name, first))
        return out

    def lookup(self, name: str, ids: np.ndarray, first: int | None = None) -> kspeed_pb2.LookupReply:
        """Which of ``ids`` the share starting at ``first`` owns (``None``: any share here), with
        their lengths (and labels)."""
        shares = [self.get(name, first)] if first is not None else self.shares(name)
        mask = np.zeros(len(ids), dtype=bool)
        lengths = np.zeros(len(ids), dtype=np.int64)
        for hosted in shares:
            owned, lens = hosted.preloader.index.lookup(ids)
            mask |= owned
            lengths[owned] = lens
        reply = kspeed_pb2.LookupReply(
            positions=wire.pack_u32(np.flatnonzero(mask)), lengths=wire.pack_u32(lengths[mask])
        )
        hosted = shares[0]
        if hosted.source.labels is not None and hosted.request.spec.labels:
            reply.labels = wire.pack_i64(hosted.source.labels[ids[mask]])
        return reply

    def _by_share(self, name: str, ids: np.ndarray) -> list[tuple[Hosted, np.ndarray]]:
        """``ids`` grouped by the share here that owns them: (share, positions in ``ids``).

        Raises:
            NotFoundError: an id is owned by no share here (the first one is named).
        """
        ids = np.asarray(ids, dtype=np.int64)
        left = np.ones(len(ids), dtype=bool)
        groups = []
        for hosted in self.shares(name):
            at = np.flatnonzero(left & hosted.preloader.index.owns(ids))
            if len(at):
                groups.append((hosted, at))
                left[at] = False
        if left.any():
            raise NotFoundError(f"dataset {name!r}: sample {int(ids[left][0])} is not owned by this server")
        return groups

    def read(self, name: str, ids: np.ndarray) -> kspeed_pb2.ReadReply:
        """The verified bytes of ``ids`` (all owned here), back to back.

        Raises:
            ChangedError: a sample's backend file changed since the listing (named).
            NotFoundError: a sample is not owned here (named).
        """
        ids = np.asarray(ids, dtype=np.int64)
        parts: list[bytes] = [b""] * len(ids)
        lengths = np.zeros(len(ids), dtype=np.int64)
        for hosted, at in self._by_share(name, ids):
            hosted.changes.refuse(ids[at], "read")
            data, lens = hosted.store.read_many(ids[at])
            starts = np.concatenate(([0], np.cumsum(lens)))
            for j, k in enumerate(at.tolist()):
                parts[k] = bytes(data[int(starts[j]) : int(starts[j + 1])])
            lengths[at] = lens
        return kspeed_pb2.ReadReply(data=b"".join(parts), lengths=wire.pack_u32(lengths))

    def nbytes(self, name: str, ids: np.ndarray) -> int:
        """Total length of ``ids`` (every one must be owned here).

        Raises:
            NotFoundError: an id is not owned by this server.
        """
        ids = np.asarray(ids, dtype=np.int64)
        return sum(int(h.preloader.index.locate(ids[at])[2].sum()) for h, at in self._by_share(name, ids))

    def count(self, name: str) -> int:
        """Number of samples of the whole dataset (for ID checks)."""
        return self.shares(name)[0].request.fingerprint.count

    def memory_used(self) -> int:
        """Pool bytes allocated to datasets (not the production window; shared regions whole)."""
        held = sum(1 for r in self.pool.regions() if r.dataset not in (None, WINDOW_OWNER))
        return held * self.pool.region_size

    def close(self) -> None:
        """Stop the change checks, scrubs and running preloads (the reads in flight end first), and
        wait for shares being taken again."""
        self.watch.stop()
        self._closing.set()
        if self._events.is_alive():
            self._events.join()
        for thread in list(self._retaking):
            thread.join(timeout=30)
        with self._lock:
            for hosted in self._hosted.values():
                hosted.store.stop_scrub()
                hosted.preloader.stop()
                if hosted.watch is not None:
                    hosted.watch.close()

    # -- persistence -----------------------------------------------------------------------------

    def _snapshot(self) -> Snapshot:
        """The record of the hosted shares and of those being recorded ahead. Called under the lock
        (written after it: :mod:`~kspeed.server.hosting.records`)."""
        requests = {key: h.request for key, h in self._hosted.items()}
        requests.update(self._recording)
        return self._records.snapshot(requests.values())

    def _record(self) -> None:
        """Record the hosted shares after some were let go (a failure is logged: see
        :meth:`AssignmentRecords.record`). Not called under the lock."""
        with self._lock:
            snapshot = self._snapshot()
        self._records.record(snapshot)


def _say_held(name: str, share: kspeed_pb2.Share, policy: MemoryPolicy, slot: Slice | None) -> None:
    """Log how a share is held: in a slice, under a memory policy, on demand, or whole."""
    if slot is not None:
        log.info(
            "dataset %s: holding samples %d..%d in a slice of %d bytes of shared region %d",
            name,
            share.first_id,
            share.end_id - 1,
            slot[2],
            slot[0],
        )
    elif policy.own_window:
        log.info(
            "dataset %s: holding samples %d..%d under policy %s in %d of their %d region(s)",
            name,
            share.first_id,
            share.end_id - 1,
            policy.name,
            share.memory_regions,
            share.num_regions,
        )
    elif share.on_demand:
        log.warning(
            "dataset %s: serving samples %d..%d on demand (read from the backend as feeds need them; "
            "no server had %d regions free)",
            name,
            share.first_id,
            share.end_id - 1,
            share.num_regions,
        )
    else:
        log.info(
            "dataset %s: holding samples %d..%d in %d region(s)",
            name,
            share.first_id,
            share.end_id - 1,
            share.num_regions,
        )
