"""A feeder process: writes the samples clients were granted from the shared pool into their rings.

Feeders are started with ``spawn`` by :mod:`kspeed.server.feeder_pool` and map the pool's region
files by path, so several of them fill several clients at once without one GIL serializing the
copies. The server's main process sends commands over a pipe (open a feed, install an epoch plan,
close a feed, stop); each open feed gets one thread that waits for grants on the feed's
data-plane connection and answers every grant with one vectorized write whose last op carries the
grant's tag as its immediate (docs/feeding.md).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import numpy as np

from kspeed import grants
from kspeed.control.logs import LogSettings
from kspeed.errors import KSpeedError, PeerLostError, ProtocolError
from kspeed.rdma.base import RegionKey, Writer
from kspeed.rdma.options import RailOptions
from kspeed.rdma.rails import get_rail
from kspeed.server.pool import map_region

log = logging.getLogger(__name__)

RECV_TIMEOUT = 0.5  # how often a feed thread looks up from waiting for grants
MAX_PLANS = 3  # epoch plans a feed keeps (the current one, the next one, one spare)
GRANTS_PER_WRITE = 8  # grants served by one write: fewer calls, yet the first tags are not held back long


@functools.cache
def _filler() -> np.ndarray:
    """What probes write (allocated by the first probe)."""
    return np.zeros(grants.MAX_PROBE, dtype=np.uint8)


@dataclass
class PlanPart:
    """The positions of one epoch plan this server owns, with where their bytes are and go.

    Attributes:
        starts: plan index of each batch's first position, plus the plan's length.
        positions: sorted plan positions owned by this server.
        region: per owned position, the pool region index holding the sample.
        src: per owned position, the sample's offset in that region.
        length: per owned position, the sample's length.
        dst: per owned position, the sample's offset within its batch (kspeed.layout.batch_layout).
        ids: per owned position, the sample's ID.
    """

    starts: np.ndarray
    positions: np.ndarray
    region: np.ndarray
    src: np.ndarray
    length: np.ndarray
    dst: np.ndarray
    ids: np.ndarray


class RegionMaps:
    """Read-only numpy views of the pool's region files, mapped once when a plan first names them."""

    def __init__(self) -> None:
        self._arrays: dict[int, np.ndarray] = {}

    def add(self, paths: dict[int, str]) -> None:
        """Map the regions of ``paths`` (pool index -> file) not mapped yet."""
        for index, path in paths.items():
            if index not in self._arrays:
                self._arrays[index] = np.frombuffer(map_region(path), dtype=np.uint8)

    def get(self, index: int) -> np.ndarray:
        return self._arrays[index]


class FeedWriter:
    """One client's data-plane path and the thread that serves its grants."""

    def __init__(self, feed_id: str, dataset: str, writer: Writer, key: RegionKey, regions: RegionMaps) -> None:
        self.feed_id = feed_id
        self.dataset = dataset
        self.changed: dict[int, str] = {}  # samples whose backend file changed since listing: never served
        self._changed_ids = np.zeros(0, dtype=np.int64)
        self.writer = writer
        self.key = key
        self.regions = regions
        self.plans: dict[int, PlanPart] = {}
        self.served = 0
        self._reason = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"feed-{feed_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def mark_changed(self, what: dict[int, str]) -> None:
        """Refuse from now on the grants that need these samples (ID -> what changed)."""
        self.changed = {**self.changed, **what}
        self._changed_ids = np.array(sorted(self.changed), dtype=np.int64)

    def install(self, epoch: int, plan: PlanPart) -> None:
        """Add an epoch plan (dropping the oldest beyond :data:`MAX_PLANS`)."""
        self.plans[epoch] = plan
        for old in sorted(self.plans)[:-MAX_PLANS]:
            self.plans.pop(old, None)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                message = self.writer.recv(RECV_TIMEOUT)
                if message is None:
                    continue
                decoded = grants.decode(message)
                if isinstance(decoded, np.ndarray):
                    for start in range(0, len(decoded), GRANTS_PER_WRITE):
                        self._serve(decoded[start : start + GRANTS_PER_WRITE])
                elif isinstance(decoded, grants.DropPlan):
                    self.plans.pop(decoded.epoch, None)
        except PeerLostError as exc:
            log.info("feed %s: client gone (%s)", self.feed_id, exc)
        except KSpeedError as exc:
            log.warning("feed %s: closed after error: %s", self.feed_id, exc)
        finally:
            with contextlib.suppress(KSpeedError):
                if self._reason:  # the feed ends for good: the client learns why before the connection goes
                    self.writer.send(grants.encode_closing(grants.Closing(self._reason)))
                self.writer.close()

    def _probe(self, grant: np.void) -> None:
        """Write filler of the probed size (docs/feeding.md, Pacing); a bad size is an ERROR, named."""
        nbytes, tag = int(grant["end"]), int(grant["tag"])
        if not 0 < nbytes <= grants.MAX_PROBE:
            why = f"probe of {nbytes} bytes is outside 1..{grants.MAX_PROBE}"
            self.writer.send(grants.encode_error(grants.GrantError(grants.PROBE_EPOCH, 0, tag, why)))
            return
        self.writer.write_batch(
            self.key,
            _filler(),
            np.zeros(1, np.int64),
            np.array([nbytes], np.int64),
            np.array([int(grant["ring_offset"])], np.int64),
            imms=[tag],
        )

    def _serve(self, batch: np.ndarray) -> None:
        """Serve several grants with one vectorized write per pool region; their tags follow the bytes."""
        regions, src, length, dst, tags = [], [], [], [], []
        for grant in batch:
            epoch, index, tag = int(grant["epoch"]), int(grant["batch"]), int(grant["tag"])
            if epoch == grants.PROBE_EPOCH:
                self._probe(grant)
                continue
            plan = self.plans.get(epoch)
            if plan is None or index >= len(plan.starts) - 1:
                why = f"no plan for epoch {epoch}" if plan is None else f"epoch {epoch} has no batch {index}"
                self.writer.send(grants.encode_error(grants.GrantError(epoch, index, tag, why)))
                continue
            lo = int(plan.starts[index]) + int(grant["first"])
            hi = min(int(plan.starts[index]) + int(grant["end"]), int(plan.starts[index + 1]))
            i, j = np.searchsorted(plan.positions, (lo, hi))
            if len(self._changed_ids):
                hit = np.flatnonzero(np.isin(plan.ids[i:j], self._changed_ids))
                if len(hit):
                    sample = int(plan.ids[i + hit[0]])
                    why = (
                        f"dataset {self.dataset!r} sample {sample}: {self.changed[sample]}; its cached bytes are stale"
                    )
                    self.writer.send(grants.encode_error(grants.GrantError(epoch, index, tag, why)))
                    continue
            regions.append(plan.region[i:j])
            src.append(plan.src[i:j])
            length.append(plan.length[i:j])
            dst.append(plan.dst[i:j] + int(grant["ring_offset"]))
            tags.append(tag)
        if not tags:
            return
        region, src_at, nbytes, dst_at = (np.concatenate(a) for a in (regions, src, length, dst))
        groups = np.unique(region)
        if len(groups) == 0:  # nothing of ours in these ranges: still exactly one completion each
            self.writer.write_batch(self.key, b"", src_at, nbytes, dst_at, imms=tags)
        for n, r in enumerate(groups.tolist()):
            mask = region == r if len(groups) > 1 else slice(None)
            self.writer.write_batch(
                self.key,
                self.regions.get(r),
                src_at[mask],
                nbytes[mask],
                dst_at[mask],
                imms=tags if n == len(groups) - 1 else None,
            )
        self.served += len(tags)

    def close(self, reason: str = "") -> None:
        """Stop serving; with a ``reason``, tell the client why first (it ends the feed with that).

        The serving thread closes the writer itself (no write of it can meet released memory); a
        thread blocked on a stalled client is interrupted after a short grace.
        """
        self._reason = reason  # sent by the serving thread itself, never beside one of its writes
        self._stop.set()
        self._thread.join(timeout=RECV_TIMEOUT * 4)
        if self._thread.is_alive():
            self.writer.interrupt()
            self._thread.join(timeout=RECV_TIMEOUT * 4)
        if self._thread.is_alive():
            log.warning("feed %s: serving thread still busy after close; it closes the writer when done", self.feed_id)


# -- the commands of the server's main process (kspeed.server.feeder_pool), sent over a pipe ------------


@dataclass(frozen=True)
class OpenFeed:
    """Connect to a client's ring over ``rail`` and serve its grants (replacing a feed of the same id)."""

    feed_id: str
    dataset: str
    rail: str
    material: bytes
    ring_key: bytes
    generation: int


@dataclass(frozen=True)
class InstallPlan:
    """Serve the grants of pass ``epoch`` of a feed from ``plan``; ``paths`` maps pool regions to files."""

    feed_id: str
    epoch: int
    plan: PlanPart
    paths: dict[int, str]


@dataclass(frozen=True)
class CloseFeed:
    """Stop serving a feed and close its connection; a ``reason`` is told to the client first."""

    feed_id: str
    reason: str = ""


@dataclass(frozen=True)
class MarkChanged:
    """Refuse the grants that need these samples of ``dataset``: their backend files changed since listing."""

    dataset: str
    ids: np.ndarray
    what: dict[int, str]


@dataclass(frozen=True)
class Report:
    """Ask which feeds are alive and how many grants each served."""


@dataclass(frozen=True)
class Stop:
    """Close every feed and exit."""


Command = OpenFeed | InstallPlan | CloseFeed | MarkChanged | Report | Stop


@dataclass(frozen=True)
class Reply:
    """The answer to a command: ``error`` names a :mod:`kspeed.errors` class when it failed."""

    ok: bool
    error: str = ""
    message: str = ""
    feeds: dict[str, tuple[bool, int]] = field(default_factory=dict)


class Feeder:
    """The state of one feeder process: its feeds and the pool regions they have mapped."""

    def __init__(self, server_id: str, options: RailOptions) -> None:
        self.server_id = server_id
        self.options = options
        self.regions = RegionMaps()
        self.feeds: dict[str, FeedWriter] = {}
        self.changed: dict[str, dict[int, str]] = {}  # per dataset, samples never to serve

    def obey(self, command: Command) -> Reply:
        """Carry out one command (not :class:`Stop`).

        Raises:
            KSpeedError: the command failed (the caller turns it into a reply).
        """
        if isinstance(command, OpenFeed):
            self.open(command)
        elif isinstance(command, InstallPlan):
            feed = self.feeds.get(command.feed_id)
            if feed is None or not feed.alive:
                raise PeerLostError(f"feed {command.feed_id!r} is not connected (the client left?)")
            self.regions.add(command.paths)
            feed.install(command.epoch, command.plan)
        elif isinstance(command, CloseFeed):
            feed = self.feeds.pop(command.feed_id, None)
            if feed is not None:
                feed.close(command.reason)
        elif isinstance(command, MarkChanged):
            self.changed.setdefault(command.dataset, {}).update(command.what)
            for feed in self.feeds.values():
                if feed.dataset == command.dataset:
                    feed.mark_changed(command.what)
        elif isinstance(command, Report):
            return Reply(True, feeds={k: (f.alive, f.served) for k, f in self.feeds.items()})
        else:
            raise ProtocolError(f"unknown feeder command {command!r}")
        return Reply(True)

    def open(self, command: OpenFeed) -> None:
        old = self.feeds.pop(command.feed_id, None)
        if old is not None:
            old.close()
        writer = get_rail(command.rail).connect(command.material, self.options)
        try:
            key = RegionKey.from_bytes(command.ring_key)
            writer.send(grants.encode_hello(grants.Hello(command.feed_id, self.server_id, command.generation)))
        except KSpeedError:
            writer.close()
            raise
        feed = self.feeds[command.feed_id] = FeedWriter(command.feed_id, command.dataset, writer, key, self.regions)
        feed.mark_changed(self.changed.get(command.dataset, {}))
        feed.start()

    def close(self) -> None:
        for feed in self.feeds.values():
            feed.close()


def serve(conn: Connection, server_id: str, options: RailOptions, logs: LogSettings) -> None:
    """Entry point of a feeder process: obey commands from the server until told to stop."""
    logs.apply("feeder", helper=True)
    feeder = Feeder(server_id, options)
    while True:
        try:
            command = conn.recv()
        except (EOFError, OSError):
            break  # the server is gone
        if isinstance(command, Stop):
            break
        try:
            reply = feeder.obey(command)
        except KSpeedError as exc:
            reply = Reply(False, type(exc).__name__, str(exc))
        conn.send(reply)
    feeder.close()
