"""Why a server is not becoming ready, said in its own log (no daemon: a fake clock and states)."""

from __future__ import annotations

import logging

from kspeed.proto import kspeed_pb2
from kspeed.server.announce import Announced
from kspeed.server.readiness import PATIENCE_BEATS, ReadinessWatch

S = kspeed_pb2.ServerState
BEAT = 0.2


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watch(clock: Clock) -> ReadinessWatch:
    w = ReadinessWatch("mgr:7070", clock=clock)
    w.announced = Announced("vm:7071", "this host's name")
    return w


def beats(w: ReadinessWatch, clock: Clock, state: int, count: int) -> None:
    for _ in range(count):
        clock.now += BEAT
        w.observe(state, BEAT)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_server_never_probed_says_why_once_and_names_the_setting(caplog):
    caplog.set_level(logging.INFO, logger="kspeed.server.readiness")
    clock = Clock()
    w = watch(clock)
    beats(w, clock, S.SERVER_STATE_JOINING, PATIENCE_BEATS - 1)
    assert warnings(caplog) == []  # the manager is still probing: no word yet
    beats(w, clock, S.SERVER_STATE_JOINING, 3 * PATIENCE_BEATS)
    [said] = warnings(caplog)
    assert "joining" in said and "no health probe has reached this server" in said
    assert "vm:7071 (this host's name)" in said and "server.advertise" in said and "KSPEED_SERVER_ADVERTISE" in said
    beats(w, clock, S.SERVER_STATE_READY, 1)
    assert any("ready now" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)


def test_probes_that_arrive_are_counted_in_the_message(caplog):
    caplog.set_level(logging.WARNING, logger="kspeed.server.readiness")
    clock = Clock()
    w = watch(clock)
    beats(w, clock, S.SERVER_STATE_SUSPECT, 1)
    w.probed()
    w.probed()
    beats(w, clock, S.SERVER_STATE_SUSPECT, PATIENCE_BEATS)
    [said] = warnings(caplog)
    assert "suspect" in said and "2 health probe(s) reached this server" in said and "kspeed status" in said


def test_a_ready_server_says_nothing_and_a_short_wait_is_forgiven(caplog):
    caplog.set_level(logging.INFO, logger="kspeed.server.readiness")
    clock = Clock()
    w = watch(clock)
    for _ in range(5):  # joining a little while, then ready: the usual start
        beats(w, clock, S.SERVER_STATE_JOINING, PATIENCE_BEATS // 2)
        beats(w, clock, S.SERVER_STATE_READY, PATIENCE_BEATS)
    assert caplog.records == []
