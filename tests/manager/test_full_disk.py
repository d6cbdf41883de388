"""The manager on a full disk (a real tmpfs filled up; no daemon): the registry's writes fail with
StateFileError naming the file, the membership and the catalog go on from memory, a dataset the
registry cannot record is not created (its shares dropped again), and everything unsaved is written
once there is room."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from kspeed.errors import StateFileError
from kspeed.manager.datasets import DatasetCatalog
from kspeed.manager.membership import FAILED, READY, Membership, Timers
from kspeed.manager.store import Store
from kspeed.proto import kspeed_pb2
from tests.fulldisk import fill, small_disk
from tests.manager.fakes import listing, ready


class Calls:
    """Server calls that succeed (a listing of two regions of ten 100-byte samples)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    async def call(self, address, server_id, method, request, timeout=None):
        self.log.append((server_id, method))
        if method == "DescribeDataset":
            return listing()
        return kspeed_pb2.ShareStatus()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def saved_states(path) -> dict[str, int]:
    db = sqlite3.connect(str(path))
    try:
        return {
            sid: kspeed_pb2.ServerRecord.FromString(blob).state
            for sid, blob in db.execute("SELECT id, record FROM servers")
        }
    finally:
        db.close()


def test_a_full_disk_costs_the_manager_new_datasets_only_and_what_it_held_is_written_once_there_is_room(tmp_path):
    with small_disk(tmp_path / "disk", 1 << 20) as disk:
        store = Store(str(disk))
        clock = Clock()
        membership = Membership(store, Timers(1.0, 3.0, 10.0), clock=clock, wall=clock)
        calls = Calls()
        catalog = DatasetCatalog(store, membership, calls, lease_ttl=60.0)
        ready(membership, "a", "b")
        filler = fill(disk)

        with pytest.raises(StateFileError, match=rf"cannot write the registry {disk}/manager.sqlite3: .*free there"):
            store.save_dataset(kspeed_pb2.DatasetInfo(spec=kspeed_pb2.DatasetSpec(name="x" * 200_000)))
        spec = kspeed_pb2.DatasetSpec(name="ds", uri="/data/ds")
        with pytest.raises(StateFileError):
            # a dataset the registry cannot record is not created: its shares are dropped again
            asyncio.run(catalog.create(kspeed_pb2.CreateDatasetRequest(spec=spec)))
        assert catalog.datasets() == []
        assert sorted(sid for sid, method in calls.log if method == "DropDataset") == ["a", "b"]

        # The membership goes on from memory: a server silent past fail_after is failed, the
        # ticker keeps ticking, and the failure is counted.
        clock.now += 11.0
        membership.heartbeat(kspeed_pb2.HeartbeatRequest(id="b", incarnation=1))
        membership.tick()
        assert membership.get("a").state == FAILED and membership.get("b").state == READY
        assert store.write_failures >= 1 and catalog.write_failures == store.write_failures
        assert saved_states(disk / "manager.sqlite3").get("a") != FAILED  # not on disk yet

        filler.unlink()  # room again: the next tick writes what was left unsaved
        membership.tick()
        assert saved_states(disk / "manager.sqlite3")["a"] == FAILED
        asyncio.run(catalog.create(kspeed_pb2.CreateDatasetRequest(spec=spec)))
        assert [d.spec.name for d in store.datasets()] == ["ds"]
        store.close()
