"""The feeder protocol (kspeed.server.feeder.protocol): every record crosses the pipes intact, each
side has a handler for every record sent to it, and a record it has none for is a ProtocolError.

No feeder process is started: records go through a real multiprocessing pipe within this process
(the serialization the server uses), and the handlers are called on a feeder state built here.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import multiprocessing as mp
import socket
import threading

import numpy as np
import pytest

from kspeed.errors import KSpeedError, PeerLostError, ProtocolError
from kspeed.rdma.base import RegionKey
from kspeed.rdma.options import RailOptions
from kspeed.server.feeder import process, protocol, supervisor
from kspeed.server.feeder.plan_part import PlanPart
from kspeed.server.feeder.process import COMMAND_HANDLERS, Feeder
from kspeed.server.feeder.protocol import (
    COMMANDS,
    EVENTS,
    CloseFeed,
    Corrupt,
    Failed,
    FeedClosed,
    FeedGone,
    FeedProgress,
    Freed,
    InstallPlan,
    Locate,
    MarkChanged,
    OpenFeed,
    Place,
    Reply,
    Stop,
    error_of,
    failure,
    wants_reply,
)
from kspeed.server.feeder.supervisor import EVENT_HANDLERS, FeederSupervisor, PlanOffer, check_offer
from kspeed.server.feeder.writer import FeederShared, FeedWriter
from tests.server.test_doorbell import SocketWriter


@dataclasses.dataclass(frozen=True)
class Stray:
    """A record neither side takes (module level: it must pickle)."""

    what: str = "stray"


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def plan_part() -> PlanPart:
    return PlanPart(
        starts=i64(0, 2, 4),
        positions=i64(0, 1, 3),
        ids=i64(10, 11, 13),
        length=i64(100, 200, 300),
        dst=i64(0, 100, 0),
        region=i64(-1, 2, 3),
        src=i64(0, 4096, 8192),
        ticket=i64(0, 0, 7),
        crc=i64(-1, 123456, 654321),
        processed=np.array([False, True, False]),
        failures={1: "stage 2 raised"},
    )


#: One record of every type the protocol defines, with every field set away from its default.
SAMPLES: dict[type, object] = {
    OpenFeed: OpenFeed("feed-1", "imagenet", "tcp", b"\x01material", b"\x02key", 3, ("10.0.0.5", "::1")),
    InstallPlan: InstallPlan("feed-1", 4, plan_part(), {0: "/dev/shm/kspeed/region-0", 5: "/dev/shm/kspeed/region-5"}),
    CloseFeed: CloseFeed("feed-1", "dataset removed", 17),
    MarkChanged: MarkChanged("imagenet", i64(3, 9), {3: "mtime changed", 9: "size changed"}),
    Locate: Locate("imagenet", i64(1, 2), i64(0, -1), i64(64, 0), i64(5, 0), quiet=True, crc=i64(77, -1)),
    Place: Place("feed-1", 4, i64(0, 2), i64(-1, -1), i64(0, 0), i64(0, 0), ("timeout", "bad image"), quiet=True),
    Failed: Failed("imagenet", i64(8), ("backend said 404",)),
    Stop: Stop(),
    Reply: Reply(False, "PeerLostError", "the client left", (4, 9)),
    FeedProgress: FeedProgress("feed-1", i64(4, 0, 0, 2, 4, 1, 0, 2).reshape(2, 4), 3, (0.5,), ((4, i64(1, 2)),), (3,)),
    FeedGone: FeedGone("feed-1", 3, "its client is gone"),
    FeedClosed: FeedClosed("feed-1", 17),
    Corrupt: Corrupt("feed-1", (11, 13)),
    Freed: Freed((5, 7)),
}


def records() -> set[type]:
    """Every record type defined in the protocol module (found there, not listed here)."""
    return {
        cls
        for _, cls in inspect.getmembers(protocol, inspect.isclass)
        if dataclasses.is_dataclass(cls) and cls.__module__ == protocol.__name__
    }


def same(a: object, b: object) -> bool:
    """Equal, field by field (numpy arrays compared by dtype, shape and value)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, tuple | list):
        assert isinstance(b, tuple | list)
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def through_pipe(record: object, *, duplex: bool) -> object:
    """``record`` sent and received over a pipe like the server's (spawn context, as the supervisor's)."""
    receiver, sender = mp.get_context("spawn").Pipe(duplex=duplex)
    try:
        sender.send(record)
        assert receiver.poll(5)
        return receiver.recv()
    finally:
        sender.close()
        receiver.close()


def test_every_record_is_a_command_an_event_or_the_reply():
    assert records() == {*COMMANDS, *EVENTS, Reply}
    assert not set(COMMANDS) & set(EVENTS)
    assert set(SAMPLES) == records()  # a new record needs a sample here too


@pytest.mark.parametrize("cls", sorted(records(), key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_records_are_frozen_slotted_dataclasses(cls):
    assert cls.__dataclass_params__.frozen
    assert "__slots__" in cls.__dict__
    record = SAMPLES[cls]
    with pytest.raises(AttributeError):
        record.__dict__  # noqa: B018  (slots: no instance dictionary)
    if dataclasses.fields(cls):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, dataclasses.fields(cls)[0].name, None)


@pytest.mark.parametrize("cls", sorted(records(), key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_every_record_round_trips_through_its_pipe(cls):
    record = SAMPLES[cls]
    back = through_pipe(record, duplex=cls is not Reply and cls not in EVENTS)  # the event pipe is one-way
    assert back is not record
    assert same(back, record)


def test_same_tells_records_apart():
    """The comparison the round trips rely on sees a difference in a nested array or a field."""
    other = InstallPlan("feed-1", 4, dataclasses.replace(plan_part(), ticket=i64(0, 0, 8)), SAMPLES[InstallPlan].paths)
    assert not same(other, SAMPLES[InstallPlan])
    assert not same(dataclasses.replace(SAMPLES[Locate], crc=None), SAMPLES[Locate])
    assert not same(Locate("d", i64(1), i64(0), i64(0), i64(0)), Locate("d", i64(1).astype(np.int32), *[i64(0)] * 3))


def test_every_command_has_a_handler_of_the_feeder():
    assert COMMAND_HANDLERS.records == COMMANDS
    assert COMMAND_HANDLERS.unhandled() == []
    for cls in COMMANDS:
        handler = COMMAND_HANDLERS.handler_of(cls)
        assert handler is not None and handler.__qualname__.startswith("Feeder."), cls


def test_every_event_has_a_handler_of_the_main_process():
    assert EVENT_HANDLERS.records == EVENTS
    assert EVENT_HANDLERS.unhandled() == []
    for cls in EVENTS:
        handler = EVENT_HANDLERS.handler_of(cls)
        assert handler is not None and handler.__qualname__.startswith("FeederSupervisor."), cls


def test_a_record_without_a_handler_is_unhandled():
    """A new record type whose side registers no handler is reported (as the tests above would fail)."""
    table = protocol.Dispatcher("the feeder process", "command", (Stop, Failed))
    table.handles(Stop)(lambda owner, record: "stopped")
    assert table.unhandled() == [Failed]
    assert table(None, Stop()) == "stopped"
    with pytest.raises(ProtocolError, match="no handler for 'Failed'"):
        table(None, SAMPLES[Failed])
    with pytest.raises(TypeError, match="has a handler already"):
        table.handles(Stop)
    with pytest.raises(TypeError, match="not a command it takes"):
        table.handles(Freed)


@pytest.mark.parametrize("stray", [Stray(), SAMPLES[Freed], "Locate"], ids=["unknown", "an event", "a string"])
def test_the_feeder_refuses_what_is_no_command(stray):
    with pytest.raises(ProtocolError) as caught:
        COMMAND_HANDLERS(None, stray)
    assert type(stray).__qualname__ in str(caught.value)
    assert "the feeder process" in str(caught.value)


@pytest.mark.parametrize("stray", [Stray(), SAMPLES[Locate], 42], ids=["unknown", "a command", "an int"])
def test_the_main_process_refuses_what_is_no_event(stray):
    with pytest.raises(ProtocolError) as caught:
        EVENT_HANDLERS(None, stray, 0)
    assert type(stray).__qualname__ in str(caught.value)
    assert "the server's main process" in str(caught.value)


@pytest.fixture
def feeder(monkeypatch):
    """A feeder process's state, in this process (its rails untouched), and the events it reports."""
    monkeypatch.setattr(process, "use_verbs_api", lambda spec: None)
    events: list[object] = []
    state = Feeder("server-1", RailOptions(), FeederShared(events.append), production_timeout=60.0)
    yield state, events
    state.close()


def test_commands_reach_their_handlers(feeder):
    state, events = feeder
    assert state.obey(SAMPLES[Failed]) == Reply(True)
    assert state.shared.failed == {"imagenet": {8: "backend said 404"}}
    assert state.obey(SAMPLES[MarkChanged]) == Reply(True)
    assert state.changed == {"imagenet": {3: "mtime changed", 9: "size changed"}}
    assert state.obey(SAMPLES[Locate]) == Reply(True, busy=())
    assert state.shared.failed == {"imagenet": {8: "backend said 404"}}  # (not one of the located samples)
    assert state.obey(Locate("imagenet", i64(8), i64(1), i64(0), i64(0))) == Reply(True, busy=())
    assert state.shared.failed == {"imagenet": {}}  # placed: no longer failed
    assert state.obey(SAMPLES[CloseFeed]) == Reply(True)
    assert events == [FeedClosed("feed-1", 17)]  # (no such feed: its close is still reported)
    with pytest.raises(PeerLostError, match="not connected"):
        state.obey(SAMPLES[InstallPlan])
    with pytest.raises(PeerLostError, match="not connected"):
        state.obey(SAMPLES[Place])
    assert not state.stopped
    state.obey(Stop())
    assert state.stopped


def test_a_stray_command_fails_across_the_pipe_as_a_protocol_error(feeder):
    state, _ = feeder
    with pytest.raises(ProtocolError) as caught:
        state.obey(Stray())
    reply = through_pipe(failure(caught.value), duplex=True)
    assert reply == Reply(False, "ProtocolError", str(caught.value))
    error = error_of(reply, "feeder process 0 failed Stray")
    assert type(error) is ProtocolError
    assert str(error) == str(caught.value) and "Stray" in str(error)


def test_errors_cross_the_pipe_by_class_name():
    error = error_of(through_pipe(failure(PeerLostError("the client left")), duplex=True), "fallback")
    assert type(error) is PeerLostError and str(error) == "the client left"
    unknown = error_of(Reply(False, "NoSuchError", ""), "feeder process 2 failed Place")
    assert type(unknown) is KSpeedError and str(unknown) == "feeder process 2 failed Place"
    not_ours = error_of(Reply(False, "ValueError", "x"), "fallback")  # a kspeed.errors name that is no KSpeedError
    assert type(not_ours) is KSpeedError


def test_only_quiet_locates_and_places_and_stop_go_unanswered():
    unanswered = {cls for cls in COMMANDS if not wants_reply(SAMPLES[cls])}
    assert unanswered == {Locate, Place, Stop}  # the sample Locate and Place are quiet
    assert wants_reply(dataclasses.replace(SAMPLES[Locate], quiet=False))
    assert wants_reply(dataclasses.replace(SAMPLES[Place], quiet=False))


def test_a_command_wakes_only_the_feeds_it_concerns(feeder):
    """A place wakes its own feed; a location, a failure or a change wakes the feeds of its dataset;
    anything else every feed (a feeder woke every waiting feed for every command: each feed scanned
    its grants once per other feed's placement)."""
    state, _ = feeder
    pairs = [socket.socketpair() for _ in range(3)]
    try:
        for (name, dataset), (a, _b) in zip((("a", "imagenet"), ("b", "imagenet"), ("c", "coco")), pairs, strict=True):
            state.feeds[name] = FeedWriter(
                name, dataset, SocketWriter(a), RegionKey("shm", "here", 1, 0, 1 << 20), None, state.shared
            )
        moves = lambda: {name: feed.moves for name, feed in state.feeds.items()}  # noqa: E731
        state.obey(Place("a", 4, i64(0), i64(1), i64(0), i64(3), quiet=True))  # (no plan of epoch 4: nothing to place)
        assert moves() == {"a": 1, "b": 0, "c": 0}
        state.obey(SAMPLES[Locate])
        state.obey(SAMPLES[Failed])
        assert moves() == {"a": 3, "b": 2, "c": 0}
        state.obey(MarkChanged("coco", i64(1), {1: "size changed"}))
        assert moves() == {"a": 3, "b": 2, "c": 1}
        with pytest.raises(PeerLostError):
            state.obey(Place("gone", 4, i64(0), i64(1), i64(0), i64(3)))
        assert moves() == {"a": 3, "b": 2, "c": 1}
    finally:
        state.feeds.clear()
        for a, b in pairs:
            a.close()
            b.close()


def test_the_main_process_takes_events_from_the_pipe_and_logs_a_stray_one(caplog):
    """The supervisor's event reader hands each event to its handler; one it has no handler for is
    logged as a ProtocolError (never dropped silently), and the reader goes on."""
    pool = FeederSupervisor.__new__(FeederSupervisor)  # (no feeder processes: only what the handlers use)
    pool._lock = threading.Lock()
    closing = threading.Event()
    pool._closing = {17: closing}
    receiver, sender = mp.get_context("spawn").Pipe(duplex=False)
    pool._feeders = [supervisor._Feeder(process=None, conn=None, events=receiver, lock=threading.Lock())]
    sender.send(Stray())
    sender.send(SAMPLES[FeedClosed])
    sender.close()
    with caplog.at_level(logging.ERROR, logger=supervisor.__name__):
        pool._read_events(0)  # returns at the end of the pipe
    receiver.close()
    assert closing.is_set()
    assert pool._closing == {}
    [stray] = [r for r in caplog.records if "cannot take in its report" in r.getMessage()]
    assert "'Stray'" in stray.getMessage()
    assert stray.exc_info is not None and stray.exc_info[0] is ProtocolError


def _offer(**changes):
    fields = {
        "count": 10,
        "positions": np.array([1, 4, 7]),
        "ids": np.array([5, 6, 7]),
        "lengths": np.array([8, 8, 8]),
        "offsets": np.array([0, 0, 8]),
        "processed": None,
    }
    fields.update(changes)
    return PlanOffer(**fields)


@pytest.mark.parametrize(
    ("changes", "batch_size", "named"),
    [
        ({}, 0, "is malformed"),
        ({"lengths": np.array([8, 8])}, 4, "2 lengths"),
        ({"offsets": np.array([0, 8])}, 4, "2 offsets"),
        ({"processed": np.array([True])}, 4, "is malformed"),
        ({"count": -1}, 4, "is malformed"),
        ({"positions": np.array([1, 1, 7])}, 4, "must increase"),
        ({"positions": np.array([1, 4, 10])}, 4, "must increase"),
        ({"offsets": np.array([0, -8, 8])}, 4, "offset is negative"),
    ],
)
def test_a_malformed_plan_part_is_refused_before_anything_is_looked_up(changes, batch_size, named):
    check_offer("f1", 4, _offer())  # the well-formed part passes
    with pytest.raises(ProtocolError, match=rf"feed f1: .*{named}"):
        check_offer("f1", batch_size, _offer(**changes))
