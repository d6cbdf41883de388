"""Server lifecycle in the registry, with a fake clock (no daemon)."""

from __future__ import annotations

import pytest

from kspeed.errors import NotFoundError, ProtocolError
from kspeed.manager.membership import FAILED, JOINING, LEFT, READY, SUSPECT, Registry, Timers
from kspeed.manager.store import Store
from kspeed.proto import kspeed_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(tmp_path, clock):
    return Registry(Store(str(tmp_path)), Timers(1.0, 3.0, 10.0), clock=clock, wall=clock)


def register(registry, server_id="srv-a"):
    request = kspeed_pb2.RegisterServerRequest(
        id=server_id,
        address="127.0.0.1:9000",
        http_address="127.0.0.1:9001",
        inventory=kspeed_pb2.ServerInventory(memory_bytes=2**30, region_size=2**27),
    )
    return registry.register(request, 1)


def beat(registry, server_id="srv-a", incarnation=1):
    return registry.heartbeat(kspeed_pb2.HeartbeatRequest(id=server_id, incarnation=incarnation))


def state(registry, server_id="srv-a"):
    return registry.get(server_id).state


def test_joining_ready_suspect_failed(tmp_path):
    clock = Clock()
    registry = make(tmp_path, clock)
    record = register(registry)
    assert record.state == JOINING and record.incarnation == 1
    beat(registry)
    assert state(registry) == JOINING  # a heartbeat alone does not prove the gRPC service works
    registry.probe_result("srv-a", 1, True)
    assert state(registry) == READY
    clock.now += 3.5
    registry.tick()
    assert state(registry) == SUSPECT
    beat(registry)
    assert state(registry) == READY
    clock.now += 10.5
    registry.tick()
    assert state(registry) == FAILED
    with pytest.raises(NotFoundError, match="register again"):
        beat(registry)
    assert register(registry).incarnation == 2


def test_failing_probes_make_suspect(tmp_path):
    clock = Clock()
    registry = make(tmp_path, clock)
    register(registry)
    registry.probe_result("srv-a", 1, True)
    registry.probe_result("srv-a", 1, False, "unavailable")
    assert state(registry) == READY
    registry.probe_result("srv-a", 1, False, "unavailable")
    assert state(registry) == SUSPECT
    assert "unavailable" in registry.get("srv-a").state_reason
    registry.probe_result("srv-a", 1, True)
    assert state(registry) == READY
    registry.probe_result("srv-a", 7, False)  # a stale incarnation's probe changes nothing
    registry.probe_result("srv-a", 7, False)
    assert state(registry) == READY


def test_unknown_and_stale_heartbeats(tmp_path):
    registry = make(tmp_path, Clock())
    with pytest.raises(NotFoundError):
        beat(registry, "srv-x")
    register(registry)
    register(registry)  # re-registration bumps the incarnation
    with pytest.raises(NotFoundError, match="stale"):
        beat(registry, incarnation=1)
    beat(registry, incarnation=2)


def test_deregister(tmp_path):
    registry = make(tmp_path, Clock())
    register(registry)
    with pytest.raises(ProtocolError):
        registry.deregister(kspeed_pb2.DeregisterServerRequest(id="srv-a", incarnation=9))
    registry.deregister(kspeed_pb2.DeregisterServerRequest(id="srv-a", incarnation=1, reason="bye"))
    assert state(registry) == LEFT
    assert registry.snapshot() == []
    assert [r.id for r in registry.snapshot(include_left=True)] == ["srv-a"]
    with pytest.raises(NotFoundError):
        registry.deregister(kspeed_pb2.DeregisterServerRequest(id="srv-b"))


def test_restart_restores_registry_as_suspect_until_heard(tmp_path):
    clock = Clock()
    registry = make(tmp_path, clock)
    register(registry, "srv-a")
    register(registry, "srv-b")
    registry.probe_result("srv-a", 1, True)
    registry.deregister(kspeed_pb2.DeregisterServerRequest(id="srv-b", incarnation=1))
    cluster_id = registry._store.cluster_id
    registry._store.close()

    restored = make(tmp_path, clock)
    assert restored._store.cluster_id == cluster_id
    assert state(restored, "srv-a") == SUSPECT
    assert state(restored, "srv-b") == LEFT
    beat(restored, "srv-a")
    assert state(restored, "srv-a") == READY
    assert restored.get("srv-a").incarnation == 1


def test_listeners_see_every_change_with_increasing_revisions(tmp_path):
    registry = make(tmp_path, Clock())
    seen = []
    unsubscribe = registry.subscribe(lambda record, revision: seen.append((record.id, record.state, revision)))
    register(registry)
    registry.probe_result("srv-a", 1, True)
    unsubscribe()
    register(registry, "srv-b")
    assert [(i, s) for i, s, _ in seen] == [("srv-a", JOINING), ("srv-a", READY)]
    assert seen[0][2] < seen[1][2] < registry.revision
    assert registry.counts()["joining"] == 1 and registry.counts()["ready"] == 1
