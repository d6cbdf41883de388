"""Following the manager's membership stream: snapshot, changes, and resuming after it breaks."""

from __future__ import annotations

import threading

from kspeed.control.membership_watch import MembershipWatch
from kspeed.errors import UnavailableError
from kspeed.proto import kspeed_pb2

READY = kspeed_pb2.SERVER_STATE_READY
FAILED = kspeed_pb2.SERVER_STATE_FAILED


def record(sid: str, state: int) -> kspeed_pb2.ServerRecord:
    return kspeed_pb2.ServerRecord(id=sid, address=f"{sid}:1", state=state)


class Manager:
    """Serves scripted streams: each open takes the next script; asked revisions are recorded."""

    def __init__(self, scripts: list[list[kspeed_pb2.MembershipEvent | Exception]]) -> None:
        self.scripts = scripts
        self.asked: list[int] = []
        self.release = threading.Event()  # the last stream stays open until this is set

    def watch(self, since: int):
        self.asked.append(since)
        script = self.scripts.pop(0) if self.scripts else []

        def events():
            for item in script:
                if isinstance(item, Exception):
                    raise item
                yield item
            self.release.wait(10)

        return events(), self.release.set


def test_snapshot_then_changes_then_a_broken_stream_resumes_from_the_last_revision():
    first = [
        kspeed_pb2.MembershipEvent(revision=4, snapshot=True, servers=[record("a", READY), record("b", READY)]),
        kspeed_pb2.MembershipEvent(revision=5, servers=[record("a", FAILED)]),
        UnavailableError("manager at m:1 is unreachable"),  # the manager restarts
    ]
    second = [kspeed_pb2.MembershipEvent(revision=6, servers=[record("c", READY)])]
    manager = Manager([first, second])
    watch = MembershipWatch(manager.watch)
    try:
        assert watch.wait(0, 5) >= 4
        while watch.revision < 6:
            watch.wait(watch.revision, 5)
        assert manager.asked == [0, 5]  # resumed after the last revision it saw
        assert watch.synced and watch.state("a") == FAILED and watch.state("zz") is None
        assert watch.ready() == {"b": "b:1", "c": "c:1"}
    finally:
        watch.close()
    assert not any(t.name == "kspeed-membership" and t.is_alive() for t in threading.enumerate())


def test_nothing_is_known_before_a_snapshot():
    manager = Manager([[UnavailableError("manager at m:1 is unreachable")]])
    watch = MembershipWatch(manager.watch)
    try:
        assert watch.wait(0, 0.3) == 0
        assert not watch.synced and watch.ready() == {} and watch.state("a") is None
    finally:
        watch.close()
