"""A registry rebuilt from what the servers hold (no daemon): a lost or empty state file, a damaged
one, the cluster id, which copy wins, and leases of the jobs still running."""

from __future__ import annotations

import asyncio
import os
import sqlite3

import pytest

from kspeed.control.rpc import peer_version
from kspeed.errors import ConfigError, ConflictError, NotFoundError
from kspeed.manager.datasets import DatasetCatalog
from kspeed.manager.membership import Membership, Timers
from kspeed.manager.service import ManagerService
from kspeed.manager.store import Store
from kspeed.proto import kspeed_pb2
from tests.manager.test_failover import REGION, Calls

JOB = kspeed_pb2.DatasetOwner.DATASET_OWNER_JOB


def record(revision: int, holders: list[str], *, created: float = 100.0, owner=JOB) -> kspeed_pb2.DatasetInfo:
    """Dataset "ds" of 20 samples in two shares held by ``holders``, at ``revision``."""
    info = kspeed_pb2.DatasetInfo(
        spec=kspeed_pb2.DatasetSpec(name="ds", uri="/data/ds"),
        owner=owner,
        fingerprint=kspeed_pb2.Fingerprint(count=20, total_bytes=2000, digest="d"),
        region_size=REGION,
        created_unix=created,
        revision=revision,
        class_names=["cat", "dog"],
    )
    for k, sid in enumerate(holders):
        info.shares.add(server_id=sid, first_id=10 * k, end_id=10 * k + 10, first_region=4 * k, num_regions=4)
    return info


def holding(info: kspeed_pb2.DatasetInfo, sid: str) -> list[kspeed_pb2.AssignShareRequest]:
    """The assignments ``sid`` keeps, each with ``info`` as its record."""
    return [
        kspeed_pb2.AssignShareRequest(
            spec=info.spec, fingerprint=info.fingerprint, region_size=REGION, share=share, dataset=info
        )
        for share in info.shares
        if share.server_id == sid
    ]


class Manager:
    """The manager's state, catalog and service over one state directory."""

    def __init__(self, state_dir, *, lease_ttl: float = 60.0, wall=None) -> None:
        os.makedirs(state_dir, exist_ok=True)
        self.store = Store(str(state_dir))
        self.membership = Membership(self.store, Timers(1.0, 3.0, 10.0))
        self.calls = Calls()
        extra = {"wall": wall} if wall is not None else {}
        self.catalog = DatasetCatalog(self.store, self.membership, self.calls, lease_ttl=lease_ttl, **extra)
        self.service = ManagerService(self.membership, self.catalog, self.store, 1.0)

    def register(self, sid: str, cluster_id: str, held: list[kspeed_pb2.AssignShareRequest]):
        inventory = kspeed_pb2.ServerInventory(region_size=REGION, memory_bytes=8 * REGION, regions_total=8)
        request = kspeed_pb2.RegisterServerRequest(
            id=sid,
            address=f"{sid}:1",
            http_address=f"{sid}:2",
            inventory=inventory,
            cluster_id=cluster_id,
            version=peer_version(),
        )
        request.holding.extend(held)
        reply = asyncio.run(self.service.RegisterServer(request, None))
        self.membership.probe_result(sid, reply.incarnation, True)  # ready
        return reply


def test_an_empty_registry_takes_the_cluster_id_and_datasets_of_the_servers_holding_data(tmp_path):
    old = Manager(tmp_path / "old")
    cluster_id = old.store.cluster_id
    fresh = Manager(tmp_path / "new")  # its file lost: a new, provisional id
    assert fresh.store.provisional and fresh.store.cluster_id != cluster_id
    info = record(3, ["a", "b"])
    reply = fresh.register("a", cluster_id, holding(info, "a"))
    assert reply.cluster_id == cluster_id and not fresh.store.provisional
    rebuilt = fresh.catalog.get("ds")
    assert [s.server_id for s in rebuilt.shares] == ["a", "b"] and rebuilt.revision == 3
    assert list(rebuilt.class_names) == ["cat", "dog"]
    # The server is told to keep what it holds: its share is among its assignments.
    assert [(r.spec.name, r.share.first_id) for r in reply.assignments] == [("ds", 0)]
    # b registers later with the same record: it keeps its share too.
    assert [
        (r.spec.name, r.share.first_id) for r in fresh.register("b", cluster_id, holding(info, "b")).assignments
    ] == [("ds", 10)]
    # It survives a restart of the manager: the registry is whole again.
    fresh.store.close()
    again = Manager(tmp_path / "new")
    assert again.store.cluster_id == cluster_id and [s.server_id for s in again.catalog.get("ds").shares] == ["a", "b"]


def test_a_server_without_data_never_decides_the_cluster_id(tmp_path):
    fresh = Manager(tmp_path)
    mine = fresh.store.cluster_id
    assert fresh.register("a", "elsewhere", []).cluster_id == mine
    assert fresh.store.provisional  # still open to the servers that hold data


def test_a_server_holding_another_clusters_data_is_refused_once_the_id_is_settled(tmp_path):
    manager = Manager(tmp_path)
    manager.register("a", "c1", holding(record(1, ["a", "b"]), "a"))
    with pytest.raises(ConflictError, match=r"server 'x' holds 1 share\(s\) of cluster c2.*kspeed server purge"):
        manager.register("x", "c2", holding(record(1, ["x"]), "x"))
    assert "x" not in manager.membership.known()


def test_the_newest_copy_wins_until_the_manager_changes_the_dataset_itself(tmp_path):
    manager = Manager(tmp_path)
    manager.register("a", "c1", holding(record(3, ["a", "b"]), "a"))
    # c took b's share over at revision 5 (b failed before the registry was lost): c's copy is newer.
    newer = record(5, ["a", "c"])
    reply = manager.register("c", "c1", holding(newer, "c"))
    assert [s.server_id for s in manager.catalog.get("ds").shares] == ["a", "c"]
    assert [r.share.first_id for r in reply.assignments] == [10]
    # An older copy changes nothing.
    manager.register("b", "c1", holding(record(3, ["a", "b"]), "b"))
    assert [s.server_id for s in manager.catalog.get("ds").shares] == ["a", "c"]
    # Once the manager moves a share itself, its registry wins over any copy, however new.
    assert asyncio.run(manager.catalog.fail_over("a")) == 1
    moved = manager.catalog.get("ds")
    assert [s.server_id for s in moved.shares] == ["b", "c"]
    manager.register("d", "c1", holding(record(9, ["d", "c"]), "d"))
    assert [s.server_id for s in manager.catalog.get("ds").shares] == [s.server_id for s in moved.shares]


def test_a_dataset_removed_here_is_not_taken_back_from_an_older_copy(tmp_path):
    manager = Manager(tmp_path)
    manager.register("a", "c1", holding(record(1, ["a", "b"], created=100.0), "a"))
    asyncio.run(manager.catalog.remove("ds", force=True))
    reply = manager.register("b", "c1", holding(record(1, ["a", "b"], created=100.0), "b"))
    assert reply.assignments == [] and manager.catalog.datasets() == []
    # A dataset of that name registered after the removal (elsewhere) is another dataset: taken.
    manager.register("c", "c1", holding(record(1, ["c"], created=2e12), "c"))
    assert [s.server_id for s in manager.catalog.get("ds").shares] == ["c"]


def test_a_rebuilt_job_dataset_waits_a_lease_period_and_its_jobs_take_their_leases_up_again(tmp_path):
    now = [1000.0]
    manager = Manager(tmp_path, lease_ttl=30.0, wall=lambda: now[0])
    manager.register("a", "c1", holding(record(1, ["a"]), "a"))
    asyncio.run(manager.catalog.expire())
    assert manager.catalog.get("ds")  # no lease yet, but the jobs reading it get one period to renew
    lease = manager.catalog.renew("ds/0123456789abcdef")  # a running job's lease, unknown to this registry
    assert lease.dataset == "ds" and lease.expires_unix == now[0] + 30.0
    now[0] += 100.0
    manager.catalog.renew(lease.id)
    asyncio.run(manager.catalog.expire())
    assert manager.catalog.get("ds").leases == 1
    with pytest.raises(NotFoundError, match="unknown"):
        manager.catalog.renew("other/0123456789abcdef")  # no such dataset: nothing to take up
    with pytest.raises(NotFoundError):
        manager.catalog.renew("ds/not-a-lease-id")


def test_without_renewals_a_rebuilt_job_dataset_is_freed_after_the_lease_period(tmp_path):
    now = [1000.0]
    manager = Manager(tmp_path, lease_ttl=30.0, wall=lambda: now[0])
    manager.register("a", "c1", holding(record(1, ["a"]), "a"))
    now[0] += 31.0
    asyncio.run(manager.catalog.expire())
    assert manager.catalog.datasets() == []


def test_a_damaged_state_file_is_refused_with_the_command_that_rebuilds_it(tmp_path):
    path = tmp_path / "manager.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(ConfigError, match=r"is damaged .*--rebuild-state"):
        Store(str(tmp_path))
    assert path.read_bytes().startswith(b"this is not")  # nothing touched
    store = Store(str(tmp_path), rebuild=True)
    assert store.provisional and list(store.datasets()) == []
    aside = [p for p in os.listdir(tmp_path) if ".damaged-" in p]
    assert len(aside) == 1 and (tmp_path / aside[0]).read_bytes().startswith(b"this is not")


def test_an_empty_state_file_is_a_fresh_registry_open_to_the_servers(tmp_path):
    (tmp_path / "manager.sqlite3").write_bytes(b"")
    store = Store(str(tmp_path))
    assert store.provisional
    assert sqlite3.connect(str(tmp_path / "manager.sqlite3")).execute("PRAGMA quick_check").fetchone() == ("ok",)


def test_servers_are_sent_newer_records_of_what_they_hold(tmp_path):
    manager = Manager(tmp_path)
    manager.register("a", "c1", holding(record(4, ["a", "b"]), "a"))
    stale = kspeed_pb2.ShareStatus(dataset="ds", first_id=0, revision=2)
    current = kspeed_pb2.ShareStatus(dataset="ds", first_id=0, revision=4)
    assert [r.revision for r in manager.catalog.records_for([stale])] == [4]
    assert manager.catalog.records_for([current]) == []
