"""A feeder process: writes the samples clients were granted from the shared pool into their rings.

Feeders are started with ``spawn`` by :mod:`kspeed.server.feeder.supervisor` and map the pool's region
files by path, so several of them fill several clients at once without one GIL serializing the
copies. The server's main process sends commands over a pipe (open a feed, install an epoch plan,
update where samples are, close a feed, stop); each open feed gets one thread
(:class:`~kspeed.server.feeder.writer.FeedWriter`) that answers its grants when their samples are
ready. Feeders report back over a second pipe what they wrote and which window slots no read uses
any more (docs/feeding.md). :mod:`kspeed.server.feeder.protocol` defines both pipes' messages.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import signal
from multiprocessing.connection import Connection

from kspeed import grants
from kspeed.control.daemon import die_with_parent
from kspeed.control.logs import LogSettings
from kspeed.errors import KSpeedError, PeerLostError
from kspeed.rdma.base import RegionKey
from kspeed.rdma.options import RailOptions
from kspeed.rdma.rails import get_rail, use_verbs_api
from kspeed.server.feeder.protocol import (
    COMMANDS,
    CloseFeed,
    Dispatcher,
    Failed,
    FeedClosed,
    InstallPlan,
    Locate,
    MarkChanged,
    OpenFeed,
    Place,
    Reply,
    Stop,
    failure,
    wants_reply,
)
from kspeed.server.feeder.writer import FeederShared, FeedWriter, RegionMaps

#: What a feeder dials when nothing says where its client called from (a caller on this host).
LOOPBACK = ("127.0.0.0/8", "::1/128")

log = logging.getLogger(__name__)

#: The feeder's handler of each command of the main process (:mod:`kspeed.server.feeder.protocol`).
COMMAND_HANDLERS: Dispatcher[Feeder, [], Reply] = Dispatcher("the feeder process", "command", COMMANDS)


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
        self.stopped = False  # told to stop

    def obey(self, command: object) -> Reply:
        """Carry out one command (after :class:`Stop`, :attr:`stopped` is set: the caller exits).

        Raises:
            KSpeedError: the command failed (the caller turns it into a reply).
            ProtocolError: ``command`` is no command this process takes.
        """
        try:
            return COMMAND_HANDLERS(self, command)
        finally:
            for feed in self._concerned(command):  # (the failed ones too: what they changed, they changed)
                feed.moved()

    def _concerned(self, command: object) -> list[FeedWriter]:
        """The feeds whose waiting grants ``command`` may have made ready."""
        feed_id = getattr(command, "feed_id", None)
        if feed_id is not None:
            feed = self.feeds.get(feed_id)
            return [feed] if feed is not None else []
        dataset = getattr(command, "dataset", None)
        return [f for f in self.feeds.values() if dataset is None or f.dataset == dataset]

    @COMMAND_HANDLERS.handles(OpenFeed)
    def _open_feed(self, command: OpenFeed) -> Reply:
        self.open(command)
        return Reply(True)

    @COMMAND_HANDLERS.handles(InstallPlan)
    def _install_plan(self, command: InstallPlan) -> Reply:
        feed = self.feeds.get(command.feed_id)
        if feed is None or not feed.alive:
            raise PeerLostError(f"feed {command.feed_id!r} is not connected (the client left?)")
        self.regions.add(command.paths)
        with self.shared.lock:
            feed.install(command.epoch, command.plan)
        return Reply(True)

    @COMMAND_HANDLERS.handles(CloseFeed)
    def _close_feed(self, command: CloseFeed) -> Reply:
        feed = self.feeds.pop(command.feed_id, None)
        if feed is not None:
            feed.close(command.reason)
            del feed
            gc.collect()  # views of the client's ring in reference cycles go now: its mapping with them
        self.shared.send(FeedClosed(command.feed_id, command.token))  # after the feed's last report
        return Reply(True)

    @COMMAND_HANDLERS.handles(MarkChanged)
    def _mark_changed(self, command: MarkChanged) -> Reply:
        self.changed.setdefault(command.dataset, {}).update(command.what)
        for feed in self.feeds.values():
            if feed.dataset == command.dataset:
                feed.mark_changed(command.what)
        return Reply(True)

    @COMMAND_HANDLERS.handles(Locate)
    def _locate(self, command: Locate) -> Reply:
        return Reply(True, busy=tuple(self.locate(command)))

    @COMMAND_HANDLERS.handles(Place)
    def _place(self, command: Place) -> Reply:
        return Reply(True, busy=tuple(self.place(command)))

    @COMMAND_HANDLERS.handles(Failed)
    def _failed(self, command: Failed) -> Reply:
        with self.shared.lock:
            self.shared.failed.setdefault(command.dataset, {}).update(
                zip(command.ids.tolist(), command.reasons, strict=True)
            )
        return Reply(True)

    @COMMAND_HANDLERS.handles(Stop)
    def _stop(self, command: Stop) -> Reply:
        self.stopped = True  # (serve() exits and closes the feeds: no reply goes out)
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
        try:
            reply = feeder.obey(command)
        except KSpeedError as exc:
            reply = failure(exc)
        if feeder.stopped:
            break
        if not wants_reply(command):
            if not reply.ok:  # (a feed that left meanwhile is no news: its plans went with it)
                level = logging.DEBUG if reply.error == PeerLostError.__name__ else logging.WARNING
                log.log(level, "%s failed: %s: %s", type(command).__name__, reply.error, reply.message)
            continue
        conn.send(reply)
    feeder.close()
