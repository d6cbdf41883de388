"""The server's feeder processes and the feeds they serve (the main process's side).

The main process validates ``OpenFeed`` and ``CommitPlan`` requests, turns an epoch plan into the
arrays a feeder needs (which plan positions this server owns and where each sample goes within its
batch) and hands it, through :mod:`kspeed.server.production.core` (which adds where each sample is now
and makes the rest resident in plan order), to the feeder process that owns the feed. ``CommitPlan``
returns at once; feeders serve grants on their own as their samples become resident, so one server
fills several clients at once, and report back over an event pipe what they wrote.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np

from kspeed import errors, names
from kspeed.control.logs import LogSettings
from kspeed.errors import (
    CapacityError,
    ConfigError,
    DatasetError,
    NotFoundError,
    NotHeldError,
    ProtocolError,
    UnavailableError,
)
from kspeed.layout import batch_starts
from kspeed.preprocess.pipeline import STATUS, Pipeline
from kspeed.proto import kspeed_pb2
from kspeed.rdma.options import RailOptions
from kspeed.rdma.rails import available_rails
from kspeed.server.feeder import process as feeder_process
from kspeed.server.feeder.plan_part import PlanPart, id_dtype, narrow
from kspeed.server.feeder.protocol import (
    EVENTS,
    CloseFeed,
    Command,
    Corrupt,
    Dispatcher,
    FeedClosed,
    FeedGone,
    FeedProgress,
    Freed,
    MarkChanged,
    OpenFeed,
    Reply,
    Stop,
    error_of,
    wants_reply,
)
from kspeed.server.hosting.datasets import DatasetHost
from kspeed.server.memory import heap
from kspeed.server.memory.window import ProductionWindow
from kspeed.server.prep.workers import PrepWorkers
from kspeed.server.production.core import PrepSpec, Production
from kspeed.server.production.groups import SAMPLES, SHARE_MODES, Membership

log = logging.getLogger(__name__)

COMMAND_TIMEOUT = 30.0
REMEMBERED_ENDS = 1024  # ended feeds whose reason is kept for later calls about them
MAX_PLAN = 1 << 28  # samples per plan
MAX_RANKS = 1 << 16  # ranks a client may say its job has (a streamed share keeps each one's part)

#: The main process's handler of each event of a feeder (:mod:`kspeed.server.feeder.protocol`); a
#: handler takes the event and the index of the feeder that reported it.
EVENT_HANDLERS: Dispatcher[FeederSupervisor, [int], None] = Dispatcher("the server's main process", "event", EVENTS)


@dataclass(frozen=True)
class PlanOffer:
    """The part of an epoch plan a client hands this server (``PlanChunk``): the plan positions of
    the samples this share owns, their IDs, lengths and byte offsets within their batch.

    Attributes:
        count: the whole plan's length.
        positions: plan positions, increasing.
        ids: sample IDs.
        lengths: lengths in the ring.
        offsets: byte offsets within their batch.
        processed: per sample, whether it runs the server stages here (``None``: none does).
    """

    count: int
    positions: np.ndarray
    ids: np.ndarray
    lengths: np.ndarray
    offsets: np.ndarray
    processed: np.ndarray | None = None


@dataclass
class _Feeder:
    process: mp.process.BaseProcess
    conn: Connection
    events: Connection
    lock: threading.Lock
    reader: threading.Thread | None = None
    feeds: int = 0


@dataclass
class _FeedInfo:
    dataset: str
    first: int  # the share it serves: its first sample
    feeder: int
    generation: int = 0
    ranks: int = 0  # the job's ranks, as its client told (0: not told)
    job: str = ""  # the job's name, as its client told
    membership: Membership | None = None  # the job's group, as its client told


class FeederSupervisor:
    """Feeder processes of one server and the feeds assigned to them.

    Args:
        count: number of feeder processes.
        server_id: this server's id (sent to clients in HELLO).
        options: data-plane options (token, timeouts) for every feed.
        host: the datasets this server holds.
        window: the production window.
        production_timeout: longest a feed goes without writing a grant while a grant of it waits for samples.
        production_depth: samples made resident ahead of each feed's next one.
        production_threads: producer threads.
        prep: the preprocessing workers (server stages of pipelines).
        logs: log level and format of the feeder processes.
        verify: feeders check each stored sample's crc32c before they write it (``verify_served``).
    """

    def __init__(
        self,
        count: int,
        server_id: str,
        options: RailOptions,
        host: DatasetHost,
        window: ProductionWindow,
        *,
        production_timeout: float = 60.0,
        production_depth: int = 1024,
        production_threads: int = 8,
        prep: PrepWorkers | None = None,
        logs: LogSettings | None = None,
        verify: str = "first",
    ) -> None:
        self._host = host
        self._lock = threading.Lock()
        self._feeds: dict[str, _FeedInfo] = {}
        # feeds the server ended, and the error that answers a call about one since
        self._ended: dict[str, tuple[type[errors.KSpeedError], str]] = {}
        self._closing: dict[int, threading.Event] = {}  # CloseFeed tokens: set when their feeder reports it
        self._tokens = itertools.count(1)
        ctx = mp.get_context("spawn")  # never fork: the pool is mapped and gRPC threads run
        self._feeders: list[_Feeder] = []
        for _ in range(max(count, 1)):
            ours, theirs = ctx.Pipe()
            events, their_events = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=feeder_process.serve,
                args=(
                    theirs,
                    their_events,
                    server_id,
                    options,
                    logs or LogSettings(),
                    production_timeout,
                    os.getpid(),
                    verify == "always",
                ),
                daemon=True,
                name="kspeed-feeder",
            )
            process.start()
            theirs.close()
            their_events.close()
            self._feeders.append(_Feeder(process, ours, events, threading.Lock()))
        self.production = Production(
            window,
            host,
            self._command,
            depth=production_depth,
            threads=production_threads,
            prep=prep,
            verify=verify != "off",
        )
        for index, worker in enumerate(self._feeders):
            worker.reader = threading.Thread(
                target=self._read_events, args=(index,), name=f"feeder-{index}-events", daemon=True
            )
            worker.reader.start()
        log.info("started %d feeder process(es)", len(self._feeders))

    def _read_events(self, index: int) -> None:
        """Hand a feeder's reports to production until the feeder exits."""
        events = self._feeders[index].events
        while True:
            try:
                event = events.recv()
            except (EOFError, OSError):
                return
            try:
                EVENT_HANDLERS(self, event, index)
            except Exception:  # a bug must not stop the reports of the other feeds
                log.exception("feeder %d: cannot take in its report %r", index, type(event).__name__)

    @EVENT_HANDLERS.handles(FeedProgress)
    def _on_progress(self, event: FeedProgress, index: int) -> None:
        self.production.progress(index, event)

    @EVENT_HANDLERS.handles(FeedClosed)
    def _on_feed_closed(self, event: FeedClosed, index: int) -> None:
        with self._lock:
            closing = self._closing.pop(event.token, None)
        if closing is not None:
            closing.set()

    @EVENT_HANDLERS.handles(Freed)
    def _on_freed(self, event: Freed, index: int) -> None:
        self.production.freed(index, event.tickets)

    @EVENT_HANDLERS.handles(FeedGone)
    def _on_feed_gone(self, event: FeedGone, index: int) -> None:
        # closed from another thread: the event reader keeps reading (the close waits for a FeedClosed)
        threading.Thread(target=self._reap, args=(event,), name="kspeed-feed-reaper", daemon=True).start()

    @EVENT_HANDLERS.handles(Corrupt)
    def _on_corrupt(self, event: Corrupt, index: int) -> None:
        # re-read from the backend away from the reports
        threading.Thread(
            target=self.production.corrupt, args=(event.feed_id, event.ids), name="kspeed-repair", daemon=True
        ).start()

    def _command(self, index: int, command: Command) -> Reply:
        worker = self._feeders[index]
        what = type(command).__name__
        # (a feeder that exited closed its end: the send or the receive fails, and only then is it
        # asked whether it lives; asking first cost a wait system call per command, 8% of the main
        # process's CPU with four jobs in a group)
        with worker.lock:
            try:
                worker.conn.send(command)
                if not wants_reply(command):  # a quiet Locate or Place
                    return Reply(True)
                if not worker.conn.poll(COMMAND_TIMEOUT):
                    raise UnavailableError(f"feeder process {index} did not answer {what} in {COMMAND_TIMEOUT}s")
                reply: Reply = worker.conn.recv()
            except (OSError, EOFError) as exc:
                worker.process.join(1.0)
                state = "is alive" if worker.process.is_alive() else f"exited (status {worker.process.exitcode})"
                raise UnavailableError(f"feeder process {index} {state}: {what} not delivered ({exc})") from None
        if not reply.ok:
            raise error_of(reply, f"feeder process {index} failed {what}")
        return reply

    def open(self, request: kspeed_pb2.OpenFeedRequest, caller: tuple[str, ...] = ()) -> kspeed_pb2.OpenFeedReply:
        """Connect a feeder to the client's ring, dialling only ``caller`` (the addresses the client
        called from) or the server's ``data_networks``.

        Raises:
            ProtocolError: a malformed request.
            NotFoundError: the dataset is not hosted here.
            RailUnavailableError, AuthError, PeerLostError: the data-plane connection failed.
        """
        names.FEED_ID.check(request.feed_id)
        names.HOLDER.check(request.holder)  # it reaches the log
        if not 1 <= request.generation <= 255:
            raise ProtocolError(f"feed {request.feed_id}: generation {request.generation} must be 1..255")
        if request.rail not in available_rails():
            raise ProtocolError(
                f"feed {request.feed_id}: rail {request.rail!r} is not offered here "
                f"(available: {', '.join(available_rails())})"
            )
        membership = _membership(request)
        first = self._host.get(request.dataset, request.first_id if request.HasField("first_id") else None).key[1]
        with self._lock:
            current = self._feeds.get(request.feed_id)
            index = current.feeder if current else min(range(len(self._feeders)), key=lambda i: self._feeders[i].feeds)
        self._command(
            index,
            OpenFeed(
                request.feed_id,
                request.dataset,
                request.rail,
                request.material,
                request.ring_key,
                request.generation,
                caller,
            ),
        )
        with self._lock:
            if current is None:
                self._feeders[index].feeds += 1
            self._feeds[request.feed_id] = _FeedInfo(
                request.dataset,
                first,
                index,
                request.generation,
                min(request.ranks, MAX_RANKS),
                request.job[:200],
                membership,
            )
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
            ended = self._ended.get(feed_id)
            if ended is not None:
                raise ended[0](ended[1])
            raise NotFoundError(f"feed {feed_id!r} is not open on this server (call OpenFeed first)")
        return info

    def _end(self, feed_id: str, error: type[errors.KSpeedError], message: str) -> None:
        """Remember why the server ended a feed: later calls about it raise ``error(message)``."""
        self._ended[feed_id] = (error, message)
        while len(self._ended) > REMEMBERED_ENDS:
            self._ended.pop(next(iter(self._ended)))

    def commit_plan(
        self,
        feed_id: str,
        epoch: int,
        batch_size: int,
        offer: PlanOffer,
        *,
        server_stages: int = 0,
        seed: int = 0,
        seed_epoch: int = 0,
        skip_failed: bool = False,
        first_batch: int = 0,
    ) -> kspeed_pb2.PlanReply:
        """Install this share's part of an epoch plan on the feed's feeder; its samples are made
        resident in plan order.

        Returns at once: grants are answered as their samples become resident (the preload of
        the share starts, what the plan needs first). Samples marked ``processed`` are run
        through the first ``server_stages`` stages of the dataset's pipeline here (their lengths
        are that stage's declared output). Batches before ``first_batch`` were delivered already
        (the plan is committed again, to a server that took a share over): nothing is produced for them.

        Raises:
            ProtocolError: a malformed part (positions not increasing or beyond the plan, negative
                offsets, a sample this share does not own), lengths that disagree with this
                server's index or the pipeline's declared output, a bad batch size, processed
                samples without a pipeline.
            ChangedError: samples of the plan changed in the backend since the listing.
        """
        info = self._feed(feed_id)
        check_offer(feed_id, batch_size, offer)
        ids, positions, offsets = offer.ids, offer.positions, offer.offsets
        n = len(ids)
        hosted = self._host.get(info.dataset, info.first)
        index = hosted.preloader.index
        foreign = np.flatnonzero(~index.owns(ids))
        if len(foreign):
            raise ProtocolError(
                f"feed {feed_id}: sample {int(ids[foreign[0]])} of the plan is not in this share "
                f"[{index.lo}, {index.hi}) of dataset {info.dataset!r}; look it up again"
            )
        length = index.length[ids - index.lo].astype(np.int64, copy=False)
        mine = offer.processed
        prep = None
        if mine is not None and mine.any():
            prep = self._prep_spec(info.dataset, hosted.request.spec, server_stages, seed, seed_epoch, skip_failed)
            length[mine] = prep.nbytes
        wrong = np.flatnonzero(length != offer.lengths)
        if len(wrong):
            k = int(wrong[0])
            raise ProtocolError(
                f"feed {feed_id}: sample {int(ids[k])} has length {int(length[k])} here"
                f"{' after the server stages' if mine is not None and mine[k] else ''}, the plan says "
                f"{int(offer.lengths[k])}; look it up again"
            )
        hosted.changes.refuse(ids, f"an epoch plan of feed {feed_id} needs")
        owned_bytes = int(length.sum())
        # (compact: the plan part is the largest state kept per sample; production adds where each
        # sample is now as it installs it)
        plan = PlanPart(
            starts=batch_starts(offer.count, batch_size),
            positions=positions.astype(id_dtype(offer.count)),
            ids=ids.astype(id_dtype(index.hi)),
            length=narrow(length),
            dst=narrow(offsets),
            processed=mine if prep is not None else None,
        )
        del length  # (not kept while the plan is installed)
        try:
            self.production.install(
                feed_id,
                info.feeder,
                hosted.key,
                epoch,
                plan,
                prep,
                first_batch,
                seed_epoch,
                ranks=info.ranks,
                job=info.job,
                membership=info.membership,
            )
        except errors.PeerLostError:
            self._feed(feed_id)  # ended meanwhile (its dataset removed)? say so rather than "not connected"
            raise
        heap.trim_later()  # (the plan's chunks, decoded and copied, are freed as the call returns)
        return kspeed_pb2.PlanReply(owned=n, owned_bytes=owned_bytes)

    def _prep_spec(
        self, dataset: str, spec: kspeed_pb2.DatasetSpec, stages: int, seed: int, epoch: int, skip: bool
    ) -> PrepSpec:
        """How processed positions of a plan are produced: the dataset's first ``stages`` stages."""
        if self.production.prep is None:
            raise ProtocolError(f"dataset {dataset!r}: this server runs no preprocessing workers")
        count = len(spec.pipeline.stages)
        if not 1 <= stages <= count:
            raise ProtocolError(
                f"dataset {dataset!r}: a plan asks for {stages} server stage(s) of a pipeline of {count}"
            )
        try:
            pipeline = Pipeline.from_proto(spec.pipeline, stages)
            output = pipeline.output(stages)
            cached = pipeline.cached_stages(spec.cache)
        except ConfigError as exc:
            raise ProtocolError(f"dataset {dataset!r}: {exc}") from exc
        if stages <= cached:
            raise ProtocolError(
                f"dataset {dataset!r}: a plan asks for {stages} server stage(s), but its samples are cached "
                f"after {cached}: there is nothing left to run"
            )
        nbytes = output.nbytes + (STATUS if skip else 0)
        if not self.production.window.fits(nbytes):
            raise CapacityError(
                f"dataset {dataset!r}: a sample of {nbytes} bytes after {stages} server stage(s) does not fit "
                f"a production window region of {self.production.window.region_size} bytes; raise the "
                "servers' region_size or run those stages on the client (offload=0)"
            )
        return PrepSpec(spec.pipeline.SerializeToString(deterministic=True), stages, seed, epoch, nbytes, skip, cached)

    def close(self, feed_id: str, reason: str = "") -> None:
        """Close a feed (its data-plane connection and plans); a ``reason`` is told to the client first."""
        info = self._feed(feed_id)
        if reason:
            self._end(feed_id, DatasetError, f"feed {feed_id!r} ended: {reason}")
        closed = threading.Event()
        with self._lock:
            token = next(self._tokens)
            self._closing[token] = closed
        try:
            self._command(info.feeder, CloseFeed(feed_id, reason, token))
            # its last progress report (the last grants written) is taken in before its plans go
            if not closed.wait(COMMAND_TIMEOUT):
                log.warning("feed %s: feeder %d closed it but did not report so", feed_id, info.feeder)
        finally:
            with self._lock:
                self._closing.pop(token, None)
        self.production.drop_feed(feed_id)
        with self._lock:
            self._feeds.pop(feed_id, None)
            self._feeders[info.feeder].feeds -= 1

    def _reap(self, gone: FeedGone) -> None:
        """Close a feed that ended on its client's side: its plans, window slots and feeder state go."""
        try:
            info = self._feeds.get(gone.feed_id)
            if info is None or info.generation != gone.generation:  # closed, or opened again meanwhile
                return
            self.close(gone.feed_id)
            self._end(gone.feed_id, DatasetError, f"feed {gone.feed_id!r} ended: {gone.why}")
            log.info("feed %s: reclaimed: %s", gone.feed_id, gone.why)
        except errors.KSpeedError as exc:
            log.warning("feed %s: cannot reclaim it: %s", gone.feed_id, exc)

    def close_share(self, dataset: str, first: int, reason: str = "") -> None:
        """Close every feed of a dataset's share (before its regions are released), telling the
        clients ``reason`` (none: the share is held elsewhere now, and a client's later call about
        one of these feeds is :class:`~kspeed.errors.NotHeldError`, a path to follow)."""
        feeds = [k for k, v in self._feeds.items() if (v.dataset, v.first) == (dataset, first)]
        if feeds:
            log.info(
                "dataset %s: closing %d feed(s) of share %d..: %s", dataset, len(feeds), first, reason or "dropped"
            )
        for feed_id in feeds:
            if not reason:
                self._end(
                    feed_id,
                    NotHeldError,
                    f"feed {feed_id!r} was closed: this server no longer holds share {first}.. of dataset "
                    f"{dataset!r} (it is held elsewhere now)",
                )
            try:
                self.close(feed_id, reason)
            except errors.KSpeedError as exc:
                log.warning("feed %s: close failed: %s", feed_id, exc)
        self.production.drop_share((dataset, first))

    def mark_changed(self, dataset: str, what: dict[int, str]) -> None:
        """Tell every feeder to refuse the grants that need these changed samples (ID -> what changed)."""
        for index in range(len(self._feeders)):
            try:
                self._command(index, MarkChanged(dataset, np.array(sorted(what), dtype=np.int64), what))
            except errors.KSpeedError as exc:
                log.warning("feeder %d: cannot tell it about changed samples of %s: %s", index, dataset, exc)

    def pids(self) -> list[int]:
        """The feeder processes alive now."""
        return [
            worker.process.pid
            for worker in self._feeders
            if worker.process.pid is not None and worker.process.is_alive()
        ]

    def count(self) -> int:
        """Open feeds."""
        return len(self._feeds)

    def stop(self) -> None:
        """Stop the producers and every feeder process."""
        self.production.stop()
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
            if worker.reader is not None:
                worker.reader.join(timeout=5)
            worker.events.close()


def check_offer(feed_id: str, batch_size: int, offer: PlanOffer) -> None:
    """Refuse a plan part whose arrays disagree in length, whose positions do not increase within
    the plan, or whose offsets are negative (before anything of it is looked up).

    Raises:
        ProtocolError: what is malformed, named with the feed.
    """
    ids, positions, offsets = offer.ids, offer.positions, offer.offsets
    n = len(ids)
    if (
        batch_size <= 0
        or not 0 <= offer.count <= MAX_PLAN
        or len(offer.lengths) != n
        or len(positions) != n
        or len(offsets) != n
        or (offer.processed is not None and len(offer.processed) != n)
    ):
        raise ProtocolError(
            f"feed {feed_id}: plan part of {n} IDs, {len(offer.lengths)} lengths, {len(positions)} positions "
            f"and {len(offsets)} offsets, of a plan of {offer.count} with batch size {batch_size}, is malformed"
        )
    if n and (int(positions[0]) < 0 or int(positions[-1]) >= offer.count or bool((np.diff(positions) <= 0).any())):
        raise ProtocolError(f"feed {feed_id}: plan positions must increase within the plan's {offer.count} positions")
    if n and int(offsets.min()) < 0:
        raise ProtocolError(f"feed {feed_id}: a plan offset is negative")


def _membership(request: kspeed_pb2.OpenFeedRequest) -> Membership | None:
    """The group a feed's job is in, as its request says (None: none).

    Raises:
        ProtocolError: a malformed group or member name, or an unknown share mode.
    """
    if not request.group:
        return None
    names.GROUP.check(request.group)
    names.GROUP.check(request.member, what="group member")
    share = request.share or SAMPLES
    if share not in SHARE_MODES:
        raise ProtocolError(f"feed {request.feed_id}: share mode {share!r} is not one of {', '.join(SHARE_MODES)}")
    return Membership(request.group, request.member, share, int(request.group_lag))
