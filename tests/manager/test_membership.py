"""Server lifecycle in the membership, with a fake clock (no daemon)."""

from __future__ import annotations

import pytest

from kspeed.errors import NotFoundError, ProtocolError
from kspeed.manager.membership import FAILED, JOINING, LEFT, READY, SUSPECT, Membership, Timers
from kspeed.manager.store import Store
from kspeed.proto import kspeed_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(tmp_path, clock):
    return Membership(Store(str(tmp_path)), Timers(1.0, 3.0, 10.0), clock=clock, wall=clock)


def register(membership, server_id="srv-a"):
    request = kspeed_pb2.RegisterServerRequest(
        id=server_id,
        address="127.0.0.1:9000",
        http_address="127.0.0.1:9001",
        inventory=kspeed_pb2.ServerInventory(memory_bytes=2**30, region_size=2**27),
    )
    return membership.register(request, 1)


def beat(membership, server_id="srv-a", incarnation=1):
    return membership.heartbeat(kspeed_pb2.HeartbeatRequest(id=server_id, incarnation=incarnation))


def state(membership, server_id="srv-a"):
    return membership.get(server_id).state


def test_joining_ready_suspect_failed(tmp_path):
    clock = Clock()
    membership = make(tmp_path, clock)
    record = register(membership)
    assert record.state == JOINING and record.incarnation == 1
    beat(membership)
    assert state(membership) == JOINING  # a heartbeat alone does not prove the gRPC service works
    membership.probe_result("srv-a", 1, True)
    assert state(membership) == READY
    clock.now += 3.5
    membership.tick()
    assert state(membership) == SUSPECT
    beat(membership)
    assert state(membership) == READY
    clock.now += 10.5
    membership.tick()
    assert state(membership) == FAILED
    with pytest.raises(NotFoundError, match="register again"):
        beat(membership)
    assert register(membership).incarnation == 2


def test_failing_probes_make_suspect(tmp_path):
    clock = Clock()
    membership = make(tmp_path, clock)
    register(membership)
    membership.probe_result("srv-a", 1, True)
    membership.probe_result("srv-a", 1, False, "unavailable")
    assert state(membership) == READY
    membership.probe_result("srv-a", 1, False, "unavailable")
    assert state(membership) == SUSPECT
    assert "unavailable" in membership.get("srv-a").state_reason
    membership.probe_result("srv-a", 1, True)
    assert state(membership) == READY
    membership.probe_result("srv-a", 7, False)  # a stale incarnation's probe changes nothing
    membership.probe_result("srv-a", 7, False)
    assert state(membership) == READY


def test_unknown_and_stale_heartbeats(tmp_path):
    membership = make(tmp_path, Clock())
    with pytest.raises(NotFoundError):
        beat(membership, "srv-x")
    register(membership)
    register(membership)  # re-registration bumps the incarnation
    with pytest.raises(NotFoundError, match="stale"):
        beat(membership, incarnation=1)
    beat(membership, incarnation=2)


def test_incarnation_0_is_no_wildcard_and_a_heartbeat_cannot_change_who_a_server_is(tmp_path):
    membership = make(tmp_path, Clock())
    register(membership)
    membership.probe_result("srv-a", 1, True)
    with pytest.raises(NotFoundError, match="incarnation 0 is stale"):
        beat(membership, incarnation=0)
    with pytest.raises(ProtocolError, match="incarnation 0 is not the current one"):
        membership.deregister(kspeed_pb2.DeregisterServerRequest(id="srv-a"))
    evil = kspeed_pb2.ServerInventory(hostname="evil", memory_bytes=2**30, region_size=2**27)
    with pytest.raises(ProtocolError, match="may not change its hostname"):
        membership.heartbeat(kspeed_pb2.HeartbeatRequest(id="srv-a", incarnation=1, inventory=evil))
    record = membership.get("srv-a")
    assert (record.state, record.inventory.hostname) == (READY, "")  # nothing of the refused calls stuck
    fuller = kspeed_pb2.ServerInventory(memory_bytes=2**30, region_size=2**27, regions_free=3)
    membership.heartbeat(kspeed_pb2.HeartbeatRequest(id="srv-a", incarnation=1, inventory=fuller))
    assert membership.get("srv-a").inventory.regions_free == 3  # what changes as it runs is taken


def test_deregister(tmp_path):
    membership = make(tmp_path, Clock())
    register(membership)
    with pytest.raises(ProtocolError):
        membership.deregister(kspeed_pb2.DeregisterServerRequest(id="srv-a", incarnation=9))
    membership.deregister(kspeed_pb2.DeregisterServerRequest(id="srv-a", incarnation=1, reason="bye"))
    assert state(membership) == LEFT
    assert membership.snapshot() == []
    assert [r.id for r in membership.snapshot(include_left=True)] == ["srv-a"]
    with pytest.raises(NotFoundError):
        membership.deregister(kspeed_pb2.DeregisterServerRequest(id="srv-b", incarnation=1))


def test_restart_restores_registry_as_suspect_until_heard(tmp_path):
    clock = Clock()
    membership = make(tmp_path, clock)
    register(membership, "srv-a")
    register(membership, "srv-b")
    membership.probe_result("srv-a", 1, True)
    membership.deregister(kspeed_pb2.DeregisterServerRequest(id="srv-b", incarnation=1))
    cluster_id = membership._store.cluster_id
    membership._store.close()

    restored = make(tmp_path, clock)
    assert restored._store.cluster_id == cluster_id
    assert state(restored, "srv-a") == SUSPECT
    assert state(restored, "srv-b") == LEFT
    restored.tick()
    restored.probe_result("srv-a", 1, True)  # answering probes is not enough: its heartbeat says what it holds
    clock.now += 2.9
    restored.tick()
    assert state(restored, "srv-a") == SUSPECT
    assert restored.get("srv-a").state_reason == "manager restarted; awaiting heartbeat"
    beat(restored, "srv-a")
    assert state(restored, "srv-a") == READY
    assert restored.get("srv-a").incarnation == 1


def test_listeners_see_every_change_with_increasing_revisions(tmp_path):
    membership = make(tmp_path, Clock())
    seen = []
    unsubscribe = membership.subscribe(lambda record, revision: seen.append((record.id, record.state, revision)))
    register(membership)
    membership.probe_result("srv-a", 1, True)
    unsubscribe()
    register(membership, "srv-b")
    assert [(i, s) for i, s, _ in seen] == [("srv-a", JOINING), ("srv-a", READY)]
    assert seen[0][2] < seen[1][2] < membership.revision
    assert membership.counts()["joining"] == 1 and membership.counts()["ready"] == 1
