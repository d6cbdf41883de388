"""A server's clean ways out, without a daemon: a stop waited out for a restart, a drain that hands
its shares off while it serves on, and what failure does to a drain under way."""

from __future__ import annotations

import asyncio

import pytest

from kspeed.errors import CapacityError, NotFoundError, StateError
from kspeed.manager.membership import DRAINING, JOINING, LEFT, READY, STOPPED, Membership, Timers
from kspeed.manager.store import Store
from kspeed.proto import kspeed_pb2
from tests.manager.test_failover import REGION, cluster, holders


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def members(tmp_path, grace: float = 30.0) -> tuple[Membership, Clock]:
    clock = Clock()
    membership = Membership(Store(str(tmp_path)), Timers(1.0, 3.0, 10.0, grace), clock=clock, wall=clock)
    return membership, clock


def join(membership: Membership, sid: str) -> int:
    inventory = kspeed_pb2.ServerInventory(region_size=REGION, memory_bytes=8 * REGION, regions_total=8)
    record = membership.register(kspeed_pb2.RegisterServerRequest(id=sid, address=f"{sid}:1", inventory=inventory), 1)
    membership.probe_result(sid, record.incarnation, True)
    membership.heartbeat(kspeed_pb2.HeartbeatRequest(id=sid, incarnation=record.incarnation))
    return record.incarnation


def state(membership: Membership, sid: str) -> int:
    return membership.get(sid).state


def stop(membership: Membership, sid: str, incarnation: int, keep_pool: bool) -> None:
    membership.deregister(
        kspeed_pb2.DeregisterServerRequest(id=sid, incarnation=incarnation, reason="shutdown", keep_pool=keep_pool)
    )


def test_a_clean_stop_with_the_pool_kept_is_waited_for_then_the_server_has_left(tmp_path):
    membership, clock = members(tmp_path, grace=30.0)
    incarnation = join(membership, "a")
    stop(membership, "a", incarnation, keep_pool=True)
    assert state(membership, "a") == STOPPED
    assert "wait 30s for it to restart" in membership.get("a").state_reason
    clock.now += 29.0
    membership.tick()
    assert state(membership, "a") == STOPPED
    with pytest.raises(NotFoundError, match="stopped here; register again"):
        membership.heartbeat(kspeed_pb2.HeartbeatRequest(id="a", incarnation=incarnation))
    clock.now += 1.5
    membership.tick()
    assert state(membership, "a") == LEFT
    assert "not back within restart_grace" in membership.get("a").state_reason


def test_a_restart_within_the_grace_joins_again_and_nothing_left(tmp_path):
    membership, clock = members(tmp_path, grace=30.0)
    first = join(membership, "a")
    stop(membership, "a", first, keep_pool=True)
    clock.now += 5.0
    assert join(membership, "a") == first + 1
    assert state(membership, "a") == READY
    clock.now += 60.0
    membership.heartbeat(kspeed_pb2.HeartbeatRequest(id="a", incarnation=first + 1))
    membership.tick()
    assert state(membership, "a") == READY


def test_a_stop_that_discards_the_pool_or_no_grace_is_a_departure_at_once(tmp_path):
    membership, _ = members(tmp_path, grace=30.0)
    stop(membership, "a", join(membership, "a"), keep_pool=False)
    assert state(membership, "a") == LEFT
    (tmp_path / "nograce").mkdir()
    membership, _ = members(tmp_path / "nograce", grace=0.0)
    stop(membership, "b", join(membership, "b"), keep_pool=True)
    assert state(membership, "b") == LEFT


def test_a_draining_server_stays_draining_through_heartbeats_suspicion_and_restarts(tmp_path):
    membership, clock = members(tmp_path)
    incarnation = join(membership, "a")
    assert membership.drain("a").state == DRAINING
    membership.heartbeat(kspeed_pb2.HeartbeatRequest(id="a", incarnation=incarnation))
    assert state(membership, "a") == DRAINING
    clock.now += 4.0  # silent: suspect; heard again: draining, not ready
    membership.tick()
    membership.heartbeat(kspeed_pb2.HeartbeatRequest(id="a", incarnation=incarnation))
    assert state(membership, "a") == DRAINING
    # It restarts mid-drain (a stop while draining is a departure: its shares are on their way out).
    stop(membership, "a", incarnation, keep_pool=True)
    assert state(membership, "a") == LEFT
    membership.drain("b") if False else None
    incarnation = join(membership, "c")
    membership.drain("c")
    membership.register(
        kspeed_pb2.RegisterServerRequest(
            id="c", address="c:2", inventory=kspeed_pb2.ServerInventory(region_size=REGION, memory_bytes=8 * REGION)
        ),
        1,
    )
    assert state(membership, "c") == JOINING
    membership.probe_result("c", incarnation + 1, True)
    membership.heartbeat(kspeed_pb2.HeartbeatRequest(id="c", incarnation=incarnation + 1))
    assert state(membership, "c") == DRAINING  # the drain outlives the restart


def test_only_a_live_server_can_be_drained(tmp_path):
    membership, _ = members(tmp_path)
    with pytest.raises(NotFoundError, match="unknown server 'x'"):
        membership.drain("x")
    stop(membership, "a", join(membership, "a"), keep_pool=False)
    with pytest.raises(StateError, match="'a' is left, not live: there is nothing to drain"):
        membership.drain("a")


def loaded(first: int, count: int, running: bool = False) -> kspeed_pb2.ShareStatus:
    progress = kspeed_pb2.PreloadProgress(samples_loaded=count, samples_total=count, running=running)
    return kspeed_pb2.ShareStatus(dataset="ds", first_id=first, progress=progress)


def test_a_drain_hands_each_share_to_a_server_with_room_and_moves_it_once_loaded(tmp_path):
    catalog, membership, calls = cluster(tmp_path, {"a": 9, "b": 9, "spare": 9}, [("a", 0, 10, 4), ("b", 10, 20, 4)])

    async def run() -> None:
        assert [(r.dataset, r.first_id) for r in catalog.plan_drain("a", allow_degraded=False)] == [("ds", 0)]
        membership.drain("a")
        assert await catalog.continue_drain("a") == 1
        share = catalog.get("ds").shares[0]
        assert (share.server_id, share.handoff_to) == ("a", "spare")  # a serves on while spare loads
        assert [(sid, m) for sid, m, _ in calls.log] == [("spare", "AssignShare"), ("spare", "StartPreload")]
        assert calls.log[0][2].share.server_id == "spare" and not calls.log[0][2].share.handoff_to
        assert catalog.holds("a")
        # The new holder's reports are its own (not "held elsewhere"); a partial load moves nothing.
        stale, moved, missing = catalog.on_heartbeat("spare", [loaded(0, 10, running=True)])
        assert (stale, moved, missing) == ([], [], [])
        assert catalog.get("ds").shares[0].server_id == "a"
        catalog.on_heartbeat("spare", [loaded(0, 10)])
        await asyncio.sleep(0)  # the old holder is told to drop it in the background
        await asyncio.gather(*catalog._tasks)
        share = catalog.get("ds").shares[0]
        assert (share.server_id, share.handoff_to) == ("spare", "")
        assert not catalog.holds("a") and catalog.handoffs == 1
        assert [(sid, m) for sid, m, _ in calls.log][-1] == ("a", "DropDataset")
        assert calls.log[-1][2].first_id == 0

    asyncio.run(run())
    assert holders(catalog) == [("spare", False), ("b", False)]


def test_a_drain_with_nowhere_to_go_is_refused_unless_it_may_degrade(tmp_path):
    catalog, membership, calls = cluster(tmp_path, {"a": 6, "b": 6}, [("a", 0, 10, 4), ("b", 10, 20, 4)])
    with pytest.raises(CapacityError, match=r"cannot drain a: no ready server has 4 region\(s\) free.*allow-degraded"):
        catalog.plan_drain("a", allow_degraded=False)
    assert calls.log == [] and state(membership, "a") == READY

    async def run() -> None:
        catalog.plan_drain("a", allow_degraded=True)
        membership.drain("a")
        catalog.start_drain("a", allow_degraded=True)
        await asyncio.gather(*catalog._tasks)
        await asyncio.gather(*catalog._tasks)

    asyncio.run(run())
    assert holders(catalog) == [("b", True), ("b", False)]  # served on demand at once
    assert ("a", "DropDataset") in [(sid, m) for sid, m, _ in calls.log]


def test_a_drained_server_that_fails_mid_handoff_gives_the_share_to_its_taker(tmp_path):
    catalog, membership, _ = cluster(tmp_path, {"a": 9, "b": 9, "spare": 9}, [("a", 0, 10, 4), ("b", 10, 20, 4)])

    async def run() -> None:
        membership.drain("a")
        await catalog.continue_drain("a")
        assert await catalog.fail_over("a") == 1

    asyncio.run(run())
    share = catalog.get("ds").shares[0]
    assert (share.server_id, share.handoff_to) == ("spare", "")


def test_a_taker_that_fails_mid_handoff_leaves_the_share_where_it_was(tmp_path):
    catalog, membership, _ = cluster(tmp_path, {"a": 9, "b": 9, "spare": 9}, [("a", 0, 10, 4), ("b", 10, 20, 4)])

    async def run() -> None:
        membership.drain("a")
        await catalog.continue_drain("a")
        assert await catalog.fail_over("spare") == 0

    asyncio.run(run())
    share = catalog.get("ds").shares[0]
    assert (share.server_id, share.handoff_to) == ("a", "")


def test_every_change_of_the_shares_is_a_new_revision_sent_with_the_assignment(tmp_path):
    catalog, _, calls = cluster(tmp_path, {"a": 9, "b": 9, "spare": 9}, [("a", 0, 10, 4), ("b", 10, 20, 4)])
    before = catalog.get("ds").revision
    asyncio.run(catalog.fail_over("a"))
    after = catalog.get("ds")
    assert after.revision == before + 1
    sent = calls.log[0][2]
    assert sent.dataset.revision == after.revision
    assert [s.server_id for s in sent.dataset.shares] == ["spare", "b"]
    assert not sent.dataset.share_status and not sent.dataset.server_addresses  # the record, not live figures
