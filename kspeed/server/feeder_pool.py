"""The server's feeder processes and the feeds they serve (the main process's side).

The main process validates ``OpenFeed`` and ``CommitPlan`` requests, turns an epoch plan into the
arrays a feeder needs (which plan positions this server owns, where each sample sits in the pool
and where it goes within its batch), and hands both to the feeder process that owns the feed.
Feeders then serve grants on their own, without the main process, so one server fills several
clients at once.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np

from kspeed import errors, names
from kspeed.control.logs import LogSettings
from kspeed.errors import DatasetError, NotFoundError, ProtocolError, UnavailableError
from kspeed.layout import batch_layout
from kspeed.proto import kspeed_pb2
from kspeed.rdma.options import RailOptions
from kspeed.rdma.rails import available_rails
from kspeed.server import feeder_process
from kspeed.server.datasets import DatasetHost
from kspeed.server.feeder_process import (
    CloseFeed,
    Command,
    InstallPlan,
    MarkChanged,
    OpenFeed,
    PlanPart,
    Reply,
    Stop,
)

log = logging.getLogger(__name__)

COMMAND_TIMEOUT = 30.0
REMEMBERED_ENDS = 1024  # ended feeds whose reason is kept for later calls about them
MAX_PLAN = 1 << 28  # samples per plan


@dataclass
class _Feeder:
    process: mp.process.BaseProcess
    conn: Connection
    lock: threading.Lock
    feeds: int = 0


@dataclass
class _FeedInfo:
    dataset: str
    feeder: int


class FeederPool:
    """Feeder processes of one server and the feeds assigned to them.

    Args:
        count: number of feeder processes.
        server_id: this server's id (sent to clients in HELLO).
        options: data-plane options (token, timeouts) for every feed.
        host: the datasets this server holds.
        plan_timeout: longest a plan waits for its samples to be preloaded.
        logs: log level and format of the feeder processes.
    """

    def __init__(
        self,
        count: int,
        server_id: str,
        options: RailOptions,
        host: DatasetHost,
        *,
        plan_timeout: float,
        logs: LogSettings | None = None,
    ) -> None:
        self._host = host
        self._plan_timeout = plan_timeout
        self._lock = threading.Lock()
        self._feeds: dict[str, _FeedInfo] = {}
        self._ended: dict[str, str] = {}  # feeds the server ended and why, to answer with the reason
        ctx = mp.get_context("spawn")  # never fork: the pool is mapped and gRPC threads run
        self._feeders: list[_Feeder] = []
        for _ in range(max(count, 1)):
            ours, theirs = ctx.Pipe()
            process = ctx.Process(
                target=feeder_process.serve,
                args=(theirs, server_id, options, logs or LogSettings()),
                daemon=True,
                name="kspeed-feeder",
            )
            process.start()
            theirs.close()
            self._feeders.append(_Feeder(process, ours, threading.Lock()))
        log.info("started %d feeder process(es)", len(self._feeders))

    def _command(self, index: int, command: Command) -> Reply:
        worker = self._feeders[index]
        what = type(command).__name__
        with worker.lock:
            if not worker.process.is_alive():
                raise UnavailableError(f"feeder process {index} exited (status {worker.process.exitcode})")
            worker.conn.send(command)
            if not worker.conn.poll(COMMAND_TIMEOUT):
                raise UnavailableError(f"feeder process {index} did not answer {what} in {COMMAND_TIMEOUT}s")
            reply: Reply = worker.conn.recv()
        if not reply.ok:
            cls = getattr(errors, reply.error, None)
            if not (isinstance(cls, type) and issubclass(cls, errors.KSpeedError)):
                cls = errors.KSpeedError
            raise cls(reply.message or f"feeder process {index} failed {what}")
        return reply

    def open(self, request: kspeed_pb2.OpenFeedRequest) -> kspeed_pb2.OpenFeedReply:
        """Connect a feeder to the client's ring.

        Raises:
            ProtocolError: a malformed request.
            NotFoundError: the dataset is not hosted here.
            RailUnavailableError, AuthError, PeerLostError: the data-plane connection failed.
        """
        names.FEED_ID.check(request.feed_id)
        if not 1 <= request.generation <= 255:
            raise ProtocolError(f"feed {request.feed_id}: generation {request.generation} must be 1..255")
        if request.rail not in available_rails():
            raise ProtocolError(
                f"feed {request.feed_id}: rail {request.rail!r} is not offered here "
                f"(available: {', '.join(available_rails())})"
            )
        self._host.get(request.dataset)
        with self._lock:
            current = self._feeds.get(request.feed_id)
            index = current.feeder if current else min(range(len(self._feeders)), key=lambda i: self._feeders[i].feeds)
        self._command(
            index,
            OpenFeed(
                request.feed_id, request.dataset, request.rail, request.material, request.ring_key, request.generation
            ),
        )
        with self._lock:
            if current is None:
                self._feeders[index].feeds += 1
            self._feeds[request.feed_id] = _FeedInfo(request.dataset, index)
        log.info(
            "feed %s (%s) open on feeder %d over %s", request.feed_id, request.holder or "unnamed", index, request.rail
        )
        return kspeed_pb2.OpenFeedReply(feeder=index)

    def dataset_of(self, feed_id: str) -> str:
        """The dataset a feed reads."""
        return self._feed(feed_id).dataset

    def _feed(self, feed_id: str) -> _FeedInfo:
        info = self._feeds.get(feed_id)
        if info is None:
            why = self._ended.get(feed_id)
            if why:
                raise DatasetError(f"feed {feed_id!r} ended: {why}")
            raise NotFoundError(f"feed {feed_id!r} is not open on this server (call OpenFeed first)")
        return info

    def commit_plan(
        self, feed_id: str, epoch: int, batch_size: int, ids: np.ndarray, lengths: np.ndarray
    ) -> kspeed_pb2.PlanReply:
        """Install an epoch plan on the feed's feeder, once every owned sample of it is loaded.

        Raises:
            ProtocolError: lengths that disagree with this server's index, or a bad batch size.
            DatasetError: owned samples of the plan failed to load (named).
        """
        info = self._feed(feed_id)
        if batch_size <= 0 or len(ids) != len(lengths) or len(ids) > MAX_PLAN:
            raise ProtocolError(
                f"feed {feed_id}: plan of {len(ids)} IDs with {len(lengths)} lengths and batch size "
                f"{batch_size} is malformed"
            )
        hosted = self._host.get(info.dataset)
        index = hosted.preloader.index
        owned = np.flatnonzero(index.owns(ids))
        owned_ids = ids[owned]
        vregion, src, length, _ = index.locate(owned_ids)
        wrong = np.flatnonzero(length != lengths[owned])
        if len(wrong):
            k = int(wrong[0])
            raise ProtocolError(
                f"feed {feed_id}: sample {int(owned_ids[k])} has length {int(length[k])} here, the "
                f"plan says {int(lengths[owned][k])}; look it up again"
            )
        hosted.changes.refuse(owned_ids, f"an epoch plan of feed {feed_id} needs")
        self._wait_loaded(info.dataset, hosted, owned_ids)
        by_vindex = {r.vindex: r for r in self._host.pool.regions(info.dataset)}
        needed = np.unique(vregion)
        missing = [int(v) for v in needed if int(v) not in by_vindex]
        if missing:
            raise DatasetError(
                f"dataset {info.dataset!r}: regions {missing[:4]} of this share are not held", dataset=info.dataset
            )
        pool_index = np.zeros(int(needed.max()) + 1 if len(needed) else 0, dtype=np.int64)
        for v in needed.tolist():
            pool_index[v] = by_vindex[v].index
        layout = batch_layout(lengths, batch_size)
        plan = PlanPart(
            starts=layout.starts,
            positions=owned.astype(np.int64),
            region=pool_index[vregion] if len(owned) else np.zeros(0, np.int64),
            src=src.astype(np.int64),
            length=length.astype(np.int64),
            dst=layout.offsets[owned],
            ids=owned_ids.astype(np.int64),
        )
        paths = {int(by_vindex[v].index): str(by_vindex[v].path) for v in needed.tolist()}
        try:
            self._command(info.feeder, InstallPlan(feed_id, epoch, plan, paths))
        except errors.PeerLostError:
            self._feed(feed_id)  # ended meanwhile (its dataset removed)? say so rather than "not connected"
            raise
        return kspeed_pb2.PlanReply(owned=len(owned), owned_bytes=int(length.sum()))

    def _wait_loaded(self, dataset: str, hosted, ids: np.ndarray) -> None:
        index = hosted.preloader.index
        loaded = index.loaded[ids - index.lo]
        if loaded.all():
            return
        log.info("dataset %s: a plan needs %d samples not loaded yet; preloading", dataset, int((~loaded).sum()))
        hosted.preloader.start()
        deadline = time.monotonic() + self._plan_timeout
        while not hosted.preloader.wait(1.0):
            if time.monotonic() > deadline:
                raise UnavailableError(f"dataset {dataset!r}: still preloading after {self._plan_timeout:.0f}s")
        missing = ids[~index.loaded[ids - index.lo]]
        if len(missing):
            raise DatasetError(
                f"dataset {dataset!r}: {len(missing)} sample(s) of the plan failed to load (first: "
                f"{missing[:5].tolist()}); see the preload errors",
                dataset=dataset,
                sample=int(missing[0]),
            )

    def close(self, feed_id: str, reason: str = "") -> None:
        """Close a feed (its data-plane connection and plans); a ``reason`` is told to the client first."""
        info = self._feed(feed_id)
        if reason:
            self._ended[feed_id] = reason
            while len(self._ended) > REMEMBERED_ENDS:
                self._ended.pop(next(iter(self._ended)))
        self._command(info.feeder, CloseFeed(feed_id, reason))
        with self._lock:
            self._feeds.pop(feed_id, None)
            self._feeders[info.feeder].feeds -= 1

    def close_dataset(self, dataset: str, reason: str = "") -> None:
        """Close every feed of a dataset (before its regions are released), telling the clients ``reason``."""
        feeds = [k for k, v in self._feeds.items() if v.dataset == dataset]
        if feeds:
            log.info("dataset %s: closing %d feed(s): %s", dataset, len(feeds), reason or "dropped")
        for feed_id in feeds:
            try:
                self.close(feed_id, reason)
            except errors.KSpeedError as exc:
                log.warning("feed %s: close failed: %s", feed_id, exc)

    def mark_changed(self, dataset: str, what: dict[int, str]) -> None:
        """Tell every feeder to refuse the grants that need these changed samples (ID -> what changed)."""
        for index in range(len(self._feeders)):
            try:
                self._command(index, MarkChanged(dataset, np.array(sorted(what), dtype=np.int64), what))
            except errors.KSpeedError as exc:
                log.warning("feeder %d: cannot tell it about changed samples of %s: %s", index, dataset, exc)

    def count(self) -> int:
        """Open feeds."""
        return len(self._feeds)

    def stop(self) -> None:
        """Stop every feeder process."""
        for worker in self._feeders:
            try:
                with worker.lock:
                    worker.conn.send(Stop())
            except (OSError, ValueError):
                pass
        for worker in self._feeders:
            worker.process.join(timeout=5)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.conn.close()
