"""The protocol between the server's main process and its feeder processes: every message, and its dispatch.

Each feeder process (:mod:`kspeed.server.feeder.process`) is joined to the main process
(:mod:`kspeed.server.feeder.supervisor`) by two pipes (:func:`multiprocessing.Pipe`, which pickles
what crosses it):

- the **command pipe**, duplex: the main process sends :data:`Command` records, one at a time per
  feeder (under that feeder's lock), and waits for the :class:`Reply` to each, except the two that get
  none (a ``quiet`` :class:`Locate` and :class:`Stop`, see :func:`wants_reply`);
- the **event pipe**, one way: the feeder's feed threads report :data:`Event` records whenever they
  have something to say; the main process reads them on one thread per feeder.

**Commands** (main -> feeder):

- :class:`OpenFeed`: a client called ``OpenFeed``. The feeder dials the client's ring, says HELLO, and
  starts the feed's thread (:class:`~kspeed.server.feeder.writer.FeedWriter`).
- :class:`InstallPlan`: a client committed a plan. Production
  (:meth:`kspeed.server.production.core.Production.install`) sends this server's part of it with the
  current place of each of its samples, and the files of the pool regions this feeder was not told yet.
- :class:`Locate`: raw samples of a dataset have a new place (by sample ID, to every feeder with a feed of
  that share). Quiet when they just came to a place (produced into the window, loaded home, placed again
  after :class:`Corrupt`); answered when they leave a window slot (retired: copied home, or let go).
- :class:`Place`: processed positions of one plan (the dataset's server stages ran for them,
  :mod:`kspeed.server.production.processed`) are in a window slot, released, or failed.
- :class:`Failed`: raw samples of a dataset could not be produced; the grants that need them fail at once.
- :class:`MarkChanged`: samples whose backend files changed since the listing; their grants are refused.
- :class:`CloseFeed`: the feed ends (closed by its client, reclaimed, or its share dropped). The feeder
  stops the feed's thread, whose last :class:`FeedProgress` goes out before it ends, then reports
  :class:`FeedClosed` with the command's token; the main process forgets the feed's plans only then, so
  that its last writes are counted.
- :class:`Stop`: close every feed and exit (the server stops).

**Events** (feeder -> main):

- :class:`FeedProgress`: every few milliseconds while a feed works: grants written, grants waiting and
  how long the served ones waited, positions granted a second time, plans the client dropped, plans
  the client truncated (from which batch on it grants no more).
- :class:`Freed`: window tickets that a :class:`Locate` or :class:`Place` retired while a read still used
  them are no longer read.
- :class:`FeedGone`: a feed ended on its client's side; the main process closes it (:class:`CloseFeed`)
  and reclaims its plans and window slots.
- :class:`FeedClosed`: the answer to a :class:`CloseFeed`, after every other report of that feed.
- :class:`Corrupt`: samples whose bytes failed their crc32c check where they are; the feeder already
  counts them as nowhere, the main process re-reads them and tells their place again (:class:`Locate`).

**Where a sample is, held twice.** The main process holds the truth: production's share state
(:class:`~kspeed.server.production.state.ShareState`) knows per sample whether it is at home, in a window
slot (the :class:`~kspeed.server.memory.window.Slot` and its ticket) or nowhere yet. Each feeder holds,
per owned position of each plan it serves (:class:`~kspeed.server.feeder.plan_part.PlanPart`), a copy: the
pool region and offset to write from (region -1: not resident), the window ticket (0: at home) and the
crc32c to check there. :class:`InstallPlan` gives the copy its first values; from then on every change of
place in the main process is sent as a :class:`Locate` (raw samples) or a :class:`Place` (processed
positions), so the two stay in step; a feeder changes its copy on its own only to withdraw a place
(:class:`Corrupt`), and says so.

**A window slot is counted in both processes.** A slot may be reused only when no plan points at it and
no write reads from it. In a feeder, each write holds the tickets it reads (a count per ticket in
:class:`~kspeed.server.feeder.writer.FeederShared`, taken under the same lock as the locations it
copied). To retire a slot, production sends the sample's new place with an answered :class:`Locate` or
:class:`Place`: under that lock the feeder points its plans elsewhere (so no new read can take the old
ticket) and answers in :attr:`Reply.busy` the retired tickets whose count is not zero yet. Production
keeps each busy ticket with the set of feeders that answered it (``Draining``) and reuses the slot once
that set is empty: each of those feeders sends :class:`Freed` when its last read of the ticket ends. A
slot no feeder answered busy is reused at once. A feeder that is gone (its feed closed, or the process
dead) no longer reads anything: its answer is taken as none busy.

**Errors.** A command that fails in the feeder raises a :class:`~kspeed.errors.KSpeedError` there; it
crosses the pipe as its class name and message (:func:`failure`), and the main process raises the
:mod:`kspeed.errors` class of that name again (:func:`error_of`; :class:`~kspeed.errors.KSpeedError` if
there is none), so a caller catches what it would have caught in one process. The failure of a command
that gets no reply is logged by the feeder. A record that a side has no handler for is a
:class:`~kspeed.errors.ProtocolError` (:class:`Dispatcher`), never ignored.

**Dispatch.** Each side keeps one :class:`Dispatcher`: a table from record type to its handler, filled
once as the handlers are defined (:meth:`Dispatcher.handles`). The feeder process has the commands' table
(:data:`kspeed.server.feeder.process.COMMAND_HANDLERS`), the main process the events'
(:data:`kspeed.server.feeder.supervisor.EVENT_HANDLERS`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, get_args

import numpy as np
from numpy.typing import NDArray

from kspeed import errors
from kspeed.errors import KSpeedError, ProtocolError
from kspeed.server.feeder.plan_part import PlanPart

__all__ = [
    "COMMANDS",
    "EVENTS",
    "CloseFeed",
    "Command",
    "Corrupt",
    "Dispatcher",
    "Event",
    "Failed",
    "FeedClosed",
    "FeedGone",
    "FeedProgress",
    "Freed",
    "InstallPlan",
    "Locate",
    "MarkChanged",
    "OpenFeed",
    "Place",
    "Reply",
    "Stop",
    "error_of",
    "failure",
    "wants_reply",
]

#: Sample IDs, plan positions, pool regions, offsets, window tickets, crc32c values: int64 arrays.
Int64s = NDArray[np.int64]


# -- commands: the main process -> a feeder (the command pipe) ---------------------------------------------


@dataclass(frozen=True, slots=True)
class OpenFeed:
    """Connect to a client's ring over ``rail`` and serve its grants (replacing a feed of the same id).

    Attributes:
        feed_id: the feed, named by its client.
        dataset: the dataset it reads.
        rail: the data-plane rail to dial (``tcp``, ``verbs``, ...).
        material: what the rail needs to reach the client's ring.
        ring_key: the ring's :class:`~kspeed.rdma.base.RegionKey`, as bytes.
        generation: the client's connection generation (told back in HELLO).
        caller: where the client called from: a network rail dials only there (or the server's
            ``data_networks``); none: loopback only.
    """

    feed_id: str
    dataset: str
    rail: str
    material: bytes
    ring_key: bytes
    generation: int
    caller: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class InstallPlan:
    """Serve the grants of pass ``epoch`` of a feed from ``plan``.

    Attributes:
        feed_id: the feed.
        epoch: the plan's epoch (the feeder keeps the last few).
        plan: this server's part of the plan, with the current place of each of its samples.
        paths: pool region -> its file, for the regions this feeder was not told of before.
    """

    feed_id: str
    epoch: int
    plan: PlanPart
    paths: dict[int, str]


@dataclass(frozen=True, slots=True)
class CloseFeed:
    """Stop serving a feed and close its connection; a ``reason`` is told to the client first.
    :class:`FeedClosed` with the same ``token`` is reported after the feed's last report."""

    feed_id: str
    reason: str = ""
    token: int = 0


@dataclass(frozen=True, slots=True)
class MarkChanged:
    """Refuse the grants that need these samples of ``dataset``: their backend files changed since listing.

    Attributes:
        dataset: the dataset.
        ids: the changed samples, sorted.
        what: sample -> what changed (told to the client whose grant is refused).
    """

    dataset: str
    ids: Int64s
    what: dict[int, str]


@dataclass(frozen=True, slots=True)
class Locate:
    """Samples of ``dataset`` are now at ``region``/``src`` (``region`` -1: nowhere; ``ticket`` > 0: a
    window slot), where their bytes must have the crc32c ``crc`` (``None``: not checked). The reply's
    ``busy`` lists the window tickets they left that a read still uses. A ``quiet`` one gets no
    reply: the places of samples just produced or loaded, which leave no slot behind (the server
    goes on producing instead of waiting for every feeder's answer)."""

    dataset: str
    ids: Int64s
    region: Int64s
    src: Int64s
    ticket: Int64s
    quiet: bool = False
    crc: Int64s | None = None


@dataclass(frozen=True, slots=True)
class Place:
    """Processed positions ``at`` (owned indices) of a feed's plan of ``epoch`` are now at
    ``region``/``src``/``ticket`` (``region`` -1: released), or, with ``reasons``, failed for
    those reasons (their grants fail at once). The reply's ``busy`` lists the window tickets they
    left that a read still uses. A ``quiet`` one gets no reply: the places of positions just made
    or shared, which had no slot to leave (a producer that waited for the feeder's answer to each
    waited, under production's lock, for a round trip per task and per group member)."""

    feed_id: str
    epoch: int
    at: Int64s
    region: Int64s
    src: Int64s
    ticket: Int64s
    reasons: tuple[str, ...] = ()
    quiet: bool = False


@dataclass(frozen=True, slots=True)
class Failed:
    """Samples of ``dataset`` that could not be produced, with why (one reason per sample): their
    grants fail at once (until a :class:`Locate` gives them a place)."""

    dataset: str
    ids: Int64s
    reasons: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Stop:
    """Close every feed and exit; no reply."""


Command = OpenFeed | InstallPlan | CloseFeed | MarkChanged | Locate | Place | Failed | Stop

#: Every command type, in the order of :data:`Command`.
COMMANDS: tuple[type[Command], ...] = get_args(Command)


# -- the answer to a command: a feeder -> the main process (the command pipe) --------------------------------


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer to a command.

    Attributes:
        ok: whether the command was carried out.
        error: when it failed, the name of the :mod:`kspeed.errors` class it raised (see :func:`error_of`).
        message: when it failed, the error's message.
        busy: for :class:`Locate` and :class:`Place`, the retired window tickets a read still uses
            (reported by :class:`Freed` once no read does).
    """

    ok: bool
    error: str = ""
    message: str = ""
    busy: tuple[int, ...] = ()


def wants_reply(command: object) -> bool:
    """Whether the sender of ``command`` waits for a :class:`Reply` (a quiet :class:`Locate` or
    :class:`Place` gets none; neither does :class:`Stop`, which the feeder obeys by exiting)."""
    return not (isinstance(command, Stop) or getattr(command, "quiet", False))


def failure(exc: KSpeedError) -> Reply:
    """The reply that carries ``exc`` across the pipe: its class name and message."""
    return Reply(False, type(exc).__name__, str(exc))


def error_of(reply: Reply, fallback: str) -> KSpeedError:
    """The error a failed ``reply`` carries, to raise in the main process: the :mod:`kspeed.errors`
    class it names (:class:`~kspeed.errors.KSpeedError` when it names none), with its message, or
    ``fallback`` when it has none."""
    cls = getattr(errors, reply.error, None)
    if not (isinstance(cls, type) and issubclass(cls, KSpeedError)):
        cls = KSpeedError
    return cls(reply.message or fallback)


# -- events: a feeder -> the main process (the event pipe) ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class FeedProgress:
    """Reported by a feeder: grants written (rows of epoch, batch, first, end), grants waiting now,
    and the seconds each grant that had to wait waited.

    Attributes:
        feed_id: the feed.
        written: grants written since the last report, one row ``(epoch, batch, first, end)`` each.
        waiting: grants waiting now.
        waited: per grant that had to wait, the seconds it waited.
        again: ``(epoch, owned positions)`` a grant asked for a second time.
        dropped: plans the client will not grant again (nothing more is produced for them).
        truncated: ``(epoch, batch)``: the plan of ``epoch`` will not be granted from ``batch`` on
            (nothing more is produced for those batches; the ones before are served as granted).
    """

    feed_id: str
    written: Int64s
    waiting: int
    waited: tuple[float, ...] = ()
    again: tuple[tuple[int, Int64s], ...] = ()
    dropped: tuple[int, ...] = ()
    truncated: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class FeedGone:
    """Reported by a feeder: a feed ended on its own (its client vanished, or its connection
    failed); the server closes it and reclaims its plans and window slots.

    Attributes:
        feed_id: the feed.
        generation: the client connection's generation it served (a feed opened again since is not closed).
        why: what ended it.
    """

    feed_id: str
    generation: int
    why: str


@dataclass(frozen=True, slots=True)
class FeedClosed:
    """Reported by a feeder once it closed a feed on the server's command: every report of the
    feed came before it (the server drops the feed's plans only then, its last writes counted).

    Attributes:
        feed_id: the feed.
        token: the :class:`CloseFeed` command's.
    """

    feed_id: str
    token: int


@dataclass(frozen=True, slots=True)
class Corrupt:
    """Reported by a feeder: samples of a feed's dataset whose bytes failed their crc32c check where
    they are; the server re-reads them from the backend (and counts it), then places them again."""

    feed_id: str
    ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Freed:
    """Reported by a feeder: window tickets that no read uses any more, after they were retired."""

    tickets: tuple[int, ...]


Event = FeedProgress | FeedGone | FeedClosed | Corrupt | Freed

#: Every event type, in the order of :data:`Event`.
EVENTS: tuple[type[Event], ...] = get_args(Event)


# -- dispatch ----------------------------------------------------------------------------------------------

Owner = TypeVar("Owner")  # what handles the records: the feeder, or the main process's feeder supervisor
Record = TypeVar("Record")
Result = TypeVar("Result")
Extra = ParamSpec("Extra")  # what a handler takes after the record (the main process: which feeder)


class Dispatcher(Generic[Owner, Extra, Result]):
    """One side's table from record type to the handler of that record, built once.

    A handler is a method of the owner, registered by the decorator :meth:`handles` as its class is
    defined; :meth:`__call__` looks the record's exact type up and calls its handler. A record of
    no registered type (one of the other direction, one this side has no handler for yet, anything
    else) is a :class:`~kspeed.errors.ProtocolError` naming it and the side.

    Args:
        side: the side that handles the records, as errors name it (``"the feeder process"``).
        kind: what the records are to it (``"command"``, ``"event"``).
        records: the record types it takes: only these can be registered.
    """

    def __init__(self, side: str, kind: str, records: tuple[type, ...]) -> None:
        self.side = side
        self.kind = kind
        self.records = records
        self._handlers: dict[type, Callable[..., Result]] = {}

    def handles(
        self, record: type[Record]
    ) -> Callable[
        [Callable[Concatenate[Owner, Record, Extra], Result]], Callable[Concatenate[Owner, Record, Extra], Result]
    ]:
        """Decorator: the method it decorates handles records of type ``record``.

        Raises:
            TypeError: ``record`` is not one of this side's records, or has a handler already.
        """
        if record not in self.records:
            raise TypeError(f"{self.side}: {record.__qualname__} is not a {self.kind} it takes")
        if record in self._handlers:
            raise TypeError(f"{self.side}: {record.__qualname__} has a handler already")

        def register(
            handler: Callable[Concatenate[Owner, Record, Extra], Result],
        ) -> Callable[Concatenate[Owner, Record, Extra], Result]:
            self._handlers[record] = handler
            return handler

        return register

    def __call__(self, owner: Owner, record: object, *args: Extra.args, **kwargs: Extra.kwargs) -> Result:
        """Hand ``record`` to its handler (a method of ``owner``); returns what the handler returns.

        Raises:
            ProtocolError: no handler takes records of this type.
        """
        handler = self._handlers.get(type(record))
        if handler is None:
            raise ProtocolError(
                f"{self.side} has no handler for {type(record).__qualname__!r}: not a {self.kind} it takes "
                f"(its {self.kind}s: {', '.join(t.__qualname__ for t in self._handlers)})"
            )
        return handler(owner, record, *args, **kwargs)

    def handler_of(self, record: type) -> Callable[..., Any] | None:
        """The handler of records of type ``record`` (``None``: none)."""
        return self._handlers.get(record)

    def unhandled(self) -> list[type]:
        """This side's record types with no handler yet."""
        return [t for t in self.records if t not in self._handlers]
