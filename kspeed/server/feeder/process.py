"""A feeder process: writes the samples clients were granted from the shared pool into their rings.

Feeders are started with ``spawn`` by :mod:`kspeed.server.feeder.supervisor` and map the pool's region
files by path, so several of them fill several clients at once without one GIL serializing the
copies. The server's main process sends commands over a pipe (open a feed, install an epoch plan,
update where samples are, close a feed, stop); each open feed gets one thread
(:class:`~kspeed.server.feeder.writer.FeedWriter`) that answers its grants when their samples are
ready. Feeders report back over a second pipe what they wrote and which window slots no read uses
any more (docs/feeding.md).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np

from kspeed import grants
from kspeed.control.daemon import die_with_parent
from kspeed.control.logs import LogSettings
from kspeed.errors import KSpeedError, PeerLostError, ProtocolError
from kspeed.rdma.base import RegionKey
from kspeed.rdma.options import RailOptions
from kspeed.rdma.rails import get_rail, use_verbs_api
from kspeed.server.feeder.writer import FeedClosed, FeederShared, FeedWriter, PlanPart
from kspeed.server.memory.pool import map_region

#: What a feeder dials when nothing says where its client called from (a caller on this host).
LOOPBACK = ("127.0.0.0/8", "::1/128")

log = logging.getLogger(__name__)


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


# -- the commands of the server's main process (kspeed.server.feeder.supervisor), sent over a pipe ------------


@dataclass(frozen=True)
class OpenFeed:
    """Connect to a client's ring over ``rail`` and serve its grants (replacing a feed of the same id)."""

    feed_id: str
    dataset: str
    rail: str
    material: bytes
    ring_key: bytes
    generation: int
    caller: tuple[str, ...] = ()  # where the client called from: a network rail dials only there (or data_networks)


@dataclass(frozen=True)
class InstallPlan:
    """Serve the grants of pass ``epoch`` of a feed from ``plan``; ``paths`` maps pool regions to files."""

    feed_id: str
    epoch: int
    plan: PlanPart
    paths: dict[int, str]


@dataclass(frozen=True)
class CloseFeed:
    """Stop serving a feed and close its connection; a ``reason`` is told to the client first.
    :class:`~kspeed.server.feeder.writer.FeedClosed` with the same ``token`` is reported after."""

    feed_id: str
    reason: str = ""
    token: int = 0


@dataclass(frozen=True)
class MarkChanged:
    """Refuse the grants that need these samples of ``dataset``: their backend files changed since listing."""

    dataset: str
    ids: np.ndarray
    what: dict[int, str]


@dataclass(frozen=True)
class Locate:
    """Samples of ``dataset`` are now at ``region``/``src`` (``region`` -1: nowhere; ``ticket`` > 0: a
    window slot), where their bytes must have the crc32c ``crc`` (``None``: not checked). The reply's
    ``busy`` lists the window tickets they left that a read still uses. A ``quiet`` one gets no
    reply: the places of samples just produced or loaded, which leave no slot behind (the server
    goes on producing instead of waiting for every feeder's answer)."""

    dataset: str
    ids: np.ndarray
    region: np.ndarray
    src: np.ndarray
    ticket: np.ndarray
    quiet: bool = False
    crc: np.ndarray | None = None


@dataclass(frozen=True)
class Place:
    """Processed positions ``at`` (owned indices) of a feed's plan of ``epoch`` are now at
    ``region``/``src``/``ticket`` (``region`` -1: released), or, with ``reasons``, failed for
    those reasons (their grants fail at once). The reply's ``busy`` lists the window tickets they
    left that a read still uses."""

    feed_id: str
    epoch: int
    at: np.ndarray
    region: np.ndarray
    src: np.ndarray
    ticket: np.ndarray
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class Failed:
    """Samples of ``dataset`` that could not be produced, with why: their grants fail at once."""

    dataset: str
    ids: np.ndarray
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class Stop:
    """Close every feed and exit."""


Command = OpenFeed | InstallPlan | CloseFeed | MarkChanged | Locate | Place | Failed | Stop


@dataclass(frozen=True)
class Reply:
    """The answer to a command: ``error`` names a :mod:`kspeed.errors` class when it failed."""

    ok: bool
    error: str = ""
    message: str = ""
    busy: tuple[int, ...] = ()


class Feeder:
    """The state of one feeder process: its feeds and the pool regions they have mapped."""

    def __init__(self, server_id: str, options: RailOptions, shared: FeederShared, production_timeout: float) -> None:
        self.server_id = server_id
        self.options = options
        use_verbs_api(options.verbs_api)
        self.shared = shared
        self.production_timeout = production_timeout
        self.regions = RegionMaps()
        self.feeds: dict[str, FeedWriter] = {}
        self.changed: dict[str, dict[int, str]] = {}  # per dataset, samples never to serve

    def obey(self, command: Command) -> Reply:
        """Carry out one command (not :class:`Stop`).

        Raises:
            KSpeedError: the command failed (the caller turns it into a reply).
        """
        self.shared.moves += 1  # whatever changed, waiting grants are worth another look
        if isinstance(command, OpenFeed):
            self.open(command)
        elif isinstance(command, InstallPlan):
            feed = self.feeds.get(command.feed_id)
            if feed is None or not feed.alive:
                raise PeerLostError(f"feed {command.feed_id!r} is not connected (the client left?)")
            self.regions.add(command.paths)
            with self.shared.lock:
                feed.install(command.epoch, command.plan)
        elif isinstance(command, CloseFeed):
            feed = self.feeds.pop(command.feed_id, None)
            if feed is not None:
                feed.close(command.reason)
                del feed
                gc.collect()  # views of the client's ring in reference cycles go now: its mapping with them
            self.shared.send(FeedClosed(command.feed_id, command.token))  # after the feed's last report
        elif isinstance(command, MarkChanged):
            self.changed.setdefault(command.dataset, {}).update(command.what)
            for feed in self.feeds.values():
                if feed.dataset == command.dataset:
                    feed.mark_changed(command.what)
        elif isinstance(command, Locate):
            return Reply(True, busy=tuple(self.locate(command)))
        elif isinstance(command, Place):
            return Reply(True, busy=tuple(self.place(command)))
        elif isinstance(command, Failed):
            with self.shared.lock:
                self.shared.failed.setdefault(command.dataset, {}).update(
                    zip(command.ids.tolist(), command.reasons, strict=True)
                )
        else:
            raise ProtocolError(f"unknown feeder command {command!r}")
        return Reply(True)

    def locate(self, command: Locate) -> list[int]:
        """Apply new locations to every plan of the dataset's feeds; returns the retired tickets still read."""
        retired: set[int] = set()
        with self.shared.lock:
            failed = self.shared.failed.get(command.dataset)
            if failed:
                for sample in command.ids.tolist():
                    failed.pop(sample, None)
            self.shared.unchecked(command.dataset, command.ids)  # a new place (or new bytes): check it again
            for feed in self.feeds.values():
                if feed.dataset != command.dataset:
                    continue
                for plan in feed.plans.values():
                    old = plan.locate(command.ids, command.region, command.src, command.ticket, command.crc)
                    retired.update(t for t in old.tolist() if t > 0)
            retired.difference_update(command.ticket.tolist())
            return self.shared.retire(sorted(retired))

    def place(self, command: Place) -> list[int]:
        """Apply new locations to processed positions of one plan; returns the retired tickets still read."""
        feed = self.feeds.get(command.feed_id)
        if feed is None:
            raise PeerLostError(f"feed {command.feed_id!r} is not connected (the client left?)")
        with self.shared.lock:
            plan = feed.plans.get(command.epoch)
            if plan is None:
                return []
            if command.reasons:
                plan.failures.update(zip(command.at.tolist(), command.reasons, strict=True))
            for k in command.at[command.region >= 0].tolist():
                plan.failures.pop(k, None)
            old = plan.place(command.at, command.region, command.src, command.ticket)
            retired = {t for t in old.tolist() if t > 0} - set(command.ticket.tolist())
            return self.shared.retire(sorted(retired))

    def open(self, command: OpenFeed) -> None:
        old = self.feeds.pop(command.feed_id, None)
        if old is not None:
            old.close()
        allowed = (*command.caller, *self.options.dial_allow) or LOOPBACK
        writer = get_rail(command.rail).connect(command.material, dataclasses.replace(self.options, dial_allow=allowed))
        try:
            key = RegionKey.from_bytes(command.ring_key)
            writer.send(grants.encode_hello(grants.Hello(command.feed_id, self.server_id, command.generation)))
        except KSpeedError:
            writer.close()
            raise
        feed = FeedWriter(
            command.feed_id,
            command.dataset,
            writer,
            key,
            self.regions,
            self.shared,
            production_timeout=self.production_timeout,
            generation=command.generation,
        )
        self.feeds[command.feed_id] = feed
        feed.mark_changed(self.changed.get(command.dataset, {}))
        feed.start()

    def close(self) -> None:
        for feed in self.feeds.values():
            feed.close()
        self.shared.doorbell.close()


def serve(
    conn: Connection,
    events: Connection,
    server_id: str,
    options: RailOptions,
    logs: LogSettings,
    production_timeout: float,
    parent: int = 0,
    recheck: bool = False,
) -> None:
    """Entry point of a feeder process: obey commands from the server (``parent``) until told to
    stop; die with it (a killed server's feeders must not keep writing into clients' rings).
    ``recheck``: check a stored sample's bytes at every write, not only the first from its place."""
    die_with_parent(parent, signal.SIGKILL)
    logs.apply("feeder", helper=True)
    feeder = Feeder(server_id, options, FeederShared(events.send, recheck=recheck), production_timeout)
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
        if getattr(command, "quiet", False):
            if not reply.ok:
                log.warning("%s failed: %s: %s", type(command).__name__, reply.error, reply.message)
            continue
        conn.send(reply)
    feeder.close()
