"""The datasets a server hosts: one share each, assigned by the manager.

A share is a contiguous range of sample IDs held in consecutive virtual regions of the pool. The
host opens the backend listing, checks it against the fingerprint the manager recorded (a changed
backend is reported, never served stale), allocates the pool regions, loads on request, and
answers the broadcast-reply lookup and pull reads. The manager's assignments are kept in the state
directory so that a restarted server re-adopts its sealed regions before the manager speaks again.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kspeed import names, wire
from kspeed.errors import ConfigError, DatasetError, KSpeedError, NotFoundError
from kspeed.preprocess.pipeline import Pipeline
from kspeed.preprocess.runner import Runner
from kspeed.proto import kspeed_pb2
from kspeed.server.backend import Backend
from kspeed.server.cached_source import CachedSource
from kspeed.server.changes import Change, ChangeLog, ChangeWatch
from kspeed.server.integrity import SampleStore
from kspeed.server.pool import WINDOW_OWNER, MemoryPool, RegionState
from kspeed.server.preload import Preloader
from kspeed.server.prep_pool import PrepPool
from kspeed.server.sources import Source, open_source

log = logging.getLogger(__name__)

ASSIGNMENTS_FILE = "assignments.json"
MAX_REPORTED_ERRORS = 5
REMEMBERED_DROPS = 256  # dropped datasets whose reason is kept for later calls about them
RETAKE_INTERVAL = 30.0  # seconds between attempts to take again a share this server failed to take


def fingerprint_pb(source: Source) -> kspeed_pb2.Fingerprint:
    """A source's fingerprint as a protobuf message."""
    fp = source.fingerprint
    return kspeed_pb2.Fingerprint(count=fp.count, total_bytes=fp.total_bytes, digest=fp.digest)


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


@dataclass
class Hosted:
    """One dataset share held by this server."""

    request: kspeed_pb2.AssignShareRequest
    source: Source
    preloader: Preloader
    store: SampleStore

    @property
    def name(self) -> str:
        return self.request.spec.name

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
        prep: PrepPool | None = None,
    ) -> None:
        self.pool = pool
        self.preprocess_allow = preprocess_allow
        self.prep = prep
        self.backend = backend
        self._path = os.path.join(state_dir, ASSIGNMENTS_FILE)
        self._threads = preload_threads
        self._scrub_interval = scrub_interval
        self._lock = threading.RLock()
        self._hosted: dict[str, Hosted] = {}
        self._dropped: dict[str, str] = {}  # recently dropped datasets and why, to answer with the reason
        self.on_drop: Callable[[str, str], None] = lambda name, reason: None  # e.g. close the dataset's feeds
        self.on_changed: Callable[[str, list[Change]], None] = lambda name, changes: None  # e.g. tell the feeders
        self.watch = ChangeWatch(self._checks, interval=change_check_interval, budget=change_check_budget)
        self._retaken: dict[str, float] = {}  # dataset -> when it was last taken again
        self._retaking: list[threading.Thread] = []

    # -- backend changes -------------------------------------------------------------------------

    def _checks(self) -> list[tuple[ChangeLog, Callable[[np.ndarray], list[Change]]]]:
        with self._lock:
            return [(h.changes, h.source.check) for h in self._hosted.values()]

    def check(self, name: str, limit: int = 0) -> kspeed_pb2.ShareStatus:
        """Compare ``name``'s backend files with the listing now: all of the share, or the next ``limit``.

        Raises:
            NotFoundError: the dataset is not hosted here.
            BackendError: the backend cannot be asked.
        """
        hosted = self.get(name)
        changes = hosted.changes
        ids = np.arange(changes.lo, changes.hi, dtype=np.int64) if limit <= 0 else changes.next_batch(limit)
        changes.record(hosted.source.check(ids))
        changes.counted(len(ids))
        return self.status(name)

    # -- assignments -----------------------------------------------------------------------------

    def restore(self) -> None:
        """Re-adopt the shares recorded before a restart (errors are logged, not fatal)."""
        for request in self._load_assignments():
            try:
                self.assign(request)
                log.info("dataset %s: share re-adopted after restart", request.spec.name)
            except KSpeedError as exc:
                log.error("dataset %s: cannot re-adopt share: %s", request.spec.name, exc)

    def reconcile(self, assignments: list[kspeed_pb2.AssignShareRequest]) -> None:
        """Make the hosted shares exactly ``assignments`` (the manager's word at registration)."""
        wanted = {a.spec.name: a for a in assignments}
        for name in set(self.names()) - set(wanted):
            log.info("dataset %s: the manager no longer assigns it here; dropping", name)
            self.drop(name, "the manager assigns its share to another server", final=False)
        for request in wanted.values():
            try:
                self.assign(request)
            except KSpeedError as exc:
                log.error("dataset %s: cannot take the assigned share: %s", request.spec.name, exc)

    def retake(self, requests: list[kspeed_pb2.AssignShareRequest]) -> None:
        """Take again shares the manager assigns here that this server did not report (dropped by
        hand, or lost): each is assigned and reloaded in the background (a listing can take long;
        heartbeats go on), at most once per :data:`RETAKE_INTERVAL` per dataset."""
        now = time.monotonic()
        for request in requests:
            name = request.spec.name
            with self._lock:
                self._retaking = [t for t in self._retaking if t.is_alive()]
                if name in self._hosted or now - self._retaken.get(name, -RETAKE_INTERVAL) < RETAKE_INTERVAL:
                    continue
                self._retaken[name] = now
                thread = threading.Thread(target=self._retake, args=(request,), name=f"retake-{name}", daemon=True)
                self._retaking.append(thread)
            thread.start()

    def _retake(self, request: kspeed_pb2.AssignShareRequest) -> None:
        name = request.spec.name
        try:
            self.assign(request)
            self.start_preload(name)
            log.warning("dataset %s: took its share again (the manager assigns it here) and reloads it", name)
        except KSpeedError as exc:
            log.error("dataset %s: cannot take the assigned share again: %s", name, exc)

    def describe(self, spec: kspeed_pb2.DatasetSpec) -> kspeed_pb2.DescribeDatasetReply:
        """List a dataset's backend for the manager (sizes in ID order, classes, fingerprint).

        A pipeline is checked first: every stage must resolve here (built-in ops with their
        parameters, modules on the operator's preprocess allow-list).
        """
        self.check_pipeline(spec)
        source = self._open(spec, describing=True)
        if spec.labels == "dirname" and source.labels is None:
            raise DatasetError(
                f"dataset {spec.name!r}: labels 'dirname' need every sample in a class directory under {spec.uri}",
                dataset=spec.name,
            )
        return kspeed_pb2.DescribeDatasetReply(
            fingerprint=fingerprint_pb(source),
            sizes=wire.pack_i64(source.sizes),
            class_names=list(source.classes),
        )

    def check_pipeline(self, spec: kspeed_pb2.DatasetSpec) -> None:
        """Refuse a pipeline whose server stages (up to the last declared output) this server could
        not run, with the reason; client and GPU stages are the client's to run.

        Raises:
            AccessDeniedError: a stage's module is not on the allow-list.
            ConfigError: a stage cannot be resolved or has bad parameters.
        """
        if spec.pipeline.stages:
            pipeline = Pipeline.from_proto(spec.pipeline)
            Runner(pipeline, allow=self.preprocess_allow, dataset=spec.name, stages=pipeline.server_stages)
            pipeline.cached_stages(spec.cache)
        elif spec.cache:
            raise ConfigError(f"dataset {spec.name!r}: cache {spec.cache!r} needs a pipeline", field="cache")

    def _open(self, spec: kspeed_pb2.DatasetSpec, *, describing: bool = False) -> Source:
        """The dataset's listing, as this server stores its samples (cached preprocessed, or raw).

        Raises:
            ConfigError: the dataset is cached preprocessed and this server runs no preprocessing workers.
        """
        source = open_source(self.backend, spec.name, spec.uri, kind=spec.kind or "auto")
        if not spec.cache:
            return source
        if self.prep is None and not describing:
            raise ConfigError(
                f"dataset {spec.name!r} is cached preprocessed and this server runs no preprocessing workers",
                field="cache",
            )
        pipeline = Pipeline.from_proto(spec.pipeline)
        return CachedSource(source, pipeline, pipeline.cached_stages(spec.cache), self.prep)

    def assign(self, request: kspeed_pb2.AssignShareRequest) -> kspeed_pb2.ShareStatus:
        """Hold ``request.share`` of the dataset (idempotent; a different share replaces the old one).

        Raises:
            DatasetError: the backend changed since the dataset was registered.
            CapacityError: the pool lacks free regions (nothing is allocated).
            ConfigError: the manager's region size is not this pool's.
        """
        name = request.spec.name
        self.check_pipeline(request.spec)
        with self._lock:
            current = self._hosted.get(name)
            if current is not None and current.request == request:
                return self.status(name)
            if current is not None:
                self.drop(name, "its share changed", final=False)
            if request.region_size != self.pool.region_size:
                raise ConfigError(
                    f"dataset {name!r}: assigned with region size {request.region_size}, this "
                    f"server's pool uses {self.pool.region_size}",
                    field="server.region_size",
                )
            source = self._open(request.spec)
            if fingerprint_pb(source) != request.fingerprint:
                raise DatasetError(
                    f"dataset {name!r}: the backend changed since registration (registered: "
                    f"{request.fingerprint.count} samples, {request.fingerprint.total_bytes} bytes; now: "
                    f"{source.fingerprint}); remove the dataset and register it again",
                    dataset=name,
                )
            share = request.share
            held = {r.vindex for r in self.pool.regions(name)}
            wanted = range(share.first_region, share.first_region + share.num_regions)
            stale = held - set(wanted)
            if stale:
                self.pool.release(name)
                held = set()
            missing = [v for v in wanted if v not in held]
            if missing:
                self.pool.allocate(name, missing)
            try:
                preloader = Preloader(
                    source,
                    self.pool,
                    lo=share.first_id,
                    hi=share.end_id,
                    first_region=share.first_region,
                    threads=self._threads,
                    changes=ChangeLog(
                        name, share.first_id, share.end_id, on_change=lambda changes: self.on_changed(name, changes)
                    ),
                )
            except KSpeedError:
                self.pool.release(name)
                raise
            store = SampleStore(preloader)
            if self._scrub_interval > 0:
                store.start_scrub(self._scrub_interval)
            self._hosted[name] = Hosted(request, source, preloader, store)
            self._dropped.pop(name, None)
            self._save_assignments()
            log.info(
                "dataset %s: holding samples %d..%d in %d region(s)",
                name,
                share.first_id,
                share.end_id - 1,
                share.num_regions,
            )
            return self.status(name)

    def drop(self, name: str, reason: str = "", *, final: bool = True) -> None:
        """Stop serving ``name`` and free its regions (waits for a running preload to finish).

        The dataset's feeds end first. With ``final`` (the dataset was removed) their clients are
        told ``reason`` (default: it was removed) and end; otherwise (its share is served elsewhere
        now) their connections are only cut, and clients follow the share to its new holder.

        Raises:
            ProtocolError: ``name`` is no dataset name at all.
        """
        names.DATASET.check(name)  # a name that could not be hosted never reaches the logs or the feeders
        reason = reason or (
            f"dataset {name!r} was removed from the cluster" if final else "its share is served elsewhere now"
        )
        self._dropped[name] = reason
        while len(self._dropped) > REMEMBERED_DROPS:
            self._dropped.pop(next(iter(self._dropped)))
        self.on_drop(name, reason if final else "")
        with self._lock:
            hosted = self._hosted.pop(name, None)
            if hosted is not None:
                hosted.store.stop_scrub()
                hosted.preloader.wait()
            self.pool.release(name)
            if self.prep is not None:
                self.prep.forget(name)
            self._save_assignments()
        if hosted is not None:
            log.info("dataset %s: dropped", name)

    # -- serving ---------------------------------------------------------------------------------

    def get(self, name: str) -> Hosted:
        """The hosted share of ``name``.

        Raises:
            NotFoundError: this server holds no share of it.
            ProtocolError: ``name`` is no dataset name at all.
        """
        hosted = self._hosted.get(name)
        if hosted is None:
            names.DATASET.check(name)
            why = self._dropped.get(name)
            raise NotFoundError(f"dataset {name!r} is not hosted on this server" + (f": {why}" if why else ""))
        return hosted

    def names(self) -> list[str]:
        """Names of the hosted datasets."""
        with self._lock:
            return sorted(self._hosted)

    def start_preload(self, name: str) -> kspeed_pb2.ShareStatus:
        """Start (or join) the preload of ``name``'s share."""
        self.get(name).preloader.start()
        return self.status(name)

    def status(self, name: str) -> kspeed_pb2.ShareStatus:
        """Progress and health of one share."""
        hosted = self.get(name)
        p = hosted.preloader.progress()
        result = hosted.preloader.result()
        errors = [str(e) for e in result.errors[:MAX_REPORTED_ERRORS]]
        sealed = sum(1 for r in self.pool.regions(name) if r.state is RegionState.SEALED)
        changes = hosted.changes
        return kspeed_pb2.ShareStatus(
            dataset=name,
            regions_sealed=sealed,
            integrity_repairs=hosted.store.counters["repaired"],
            changed_samples=changes.count,
            changes=[str(c) for c in changes.first()],
            samples_checked=changes.checked,
            stage_seconds=self.prep.seconds_of(name) if self.prep is not None else {},
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
        for name in self.names():
            with contextlib.suppress(NotFoundError):
                out.append(self.status(name))
        return out

    def lookup(self, name: str, ids: np.ndarray) -> kspeed_pb2.LookupReply:
        """Which of ``ids`` this server owns, with their lengths (and labels)."""
        hosted = self.get(name)
        mask, lengths = hosted.preloader.index.lookup(ids)
        reply = kspeed_pb2.LookupReply(positions=wire.pack_u32(np.flatnonzero(mask)), lengths=wire.pack_u32(lengths))
        if hosted.source.labels is not None and hosted.request.spec.labels:
            reply.labels = wire.pack_i64(hosted.source.labels[ids[mask]])
        return reply

    def read(self, name: str, ids: np.ndarray) -> kspeed_pb2.ReadReply:
        """The verified bytes of ``ids`` (all owned here), back to back.

        Raises:
            ChangedError: a sample's backend file changed since the listing (named).
        """
        hosted = self.get(name)
        hosted.changes.refuse(ids, "read")
        data, lengths = hosted.store.read_many(ids)
        return kspeed_pb2.ReadReply(data=bytes(data), lengths=wire.pack_u32(lengths))

    def nbytes(self, name: str, ids: np.ndarray) -> int:
        """Total length of ``ids`` (every one must be owned here).

        Raises:
            NotFoundError: an id is not owned by this server.
        """
        return int(self.get(name).preloader.index.locate(ids)[2].sum())

    def count(self, name: str) -> int:
        """Number of samples of the whole dataset (for ID checks)."""
        return self.get(name).request.fingerprint.count

    def memory_used(self) -> int:
        """Pool bytes allocated to datasets (not the production window)."""
        held = sum(1 for r in self.pool.regions() if r.dataset not in (None, WINDOW_OWNER))
        return held * self.pool.region_size

    def close(self) -> None:
        """Stop the change checks and scrubs and wait for shares being taken again and running preloads."""
        self.watch.stop()
        for thread in list(self._retaking):
            thread.join(timeout=30)
        with self._lock:
            for hosted in self._hosted.values():
                hosted.store.stop_scrub()
                hosted.preloader.wait()

    # -- persistence -----------------------------------------------------------------------------

    def _save_assignments(self) -> None:
        data = {name: base64.b64encode(h.request.SerializeToString()).decode() for name, h in self._hosted.items()}
        tmp = f"{self._path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
        os.replace(tmp, self._path)

    def _load_assignments(self) -> list[kspeed_pb2.AssignShareRequest]:
        try:
            with open(self._path, encoding="utf-8") as fh:
                data = json.load(fh)
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            log.error("ignoring unreadable %s: %s", self._path, exc)
            return []
        return [kspeed_pb2.AssignShareRequest.FromString(base64.b64decode(v)) for v in data.values()]
