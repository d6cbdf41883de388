"""Where the manager moves the shares of a failed server, and what heartbeats say about shares (no daemon)."""

from __future__ import annotations

import asyncio

from kspeed.errors import UnavailableError
from kspeed.manager.datasets import DatasetCatalog
from kspeed.manager.membership import Membership, Timers
from kspeed.manager.store import Store
from kspeed.proto import kspeed_pb2

REGION = 1 << 20


class Calls:
    """Records the manager's calls to servers; ``refuse`` names servers whose calls fail."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, object]] = []
        self.refuse: set[str] = set()

    async def call(self, address, server_id, method, request, timeout=None):
        self.log.append((server_id, method, request))
        if server_id in self.refuse:
            raise UnavailableError(f"server {server_id} is unreachable")
        return kspeed_pb2.ShareStatus(dataset=getattr(request, "name", ""))


def cluster(tmp_path, servers: dict[str, int], shares: list[tuple[str, int, int, int]]):
    """Servers with ``regions_total`` each (one of them the window), all ready, and dataset "ds"
    cut into ``shares`` of (server, first id, end id, regions)."""
    store = Store(str(tmp_path))
    membership = Membership(store, Timers(1.0, 3.0, 10.0))
    for sid, regions in servers.items():
        inventory = kspeed_pb2.ServerInventory(region_size=REGION, regions_total=regions, regions_window=1)
        request = kspeed_pb2.RegisterServerRequest(id=sid, address=f"{sid}:1", inventory=inventory)
        record = membership.register(request, 1)
        membership.probe_result(sid, record.incarnation, True)
    info = kspeed_pb2.DatasetInfo(
        spec=kspeed_pb2.DatasetSpec(name="ds", uri="/data/ds"),
        fingerprint=kspeed_pb2.Fingerprint(count=shares[-1][2]),
        region_size=REGION,
    )
    first_region = 0
    for sid, first, end, regions in shares:
        info.shares.add(server_id=sid, first_id=first, end_id=end, first_region=first_region, num_regions=regions)
        first_region += regions
    store.save_dataset(info)
    calls = Calls()
    catalog = DatasetCatalog(store, membership, calls, lease_ttl=60.0)
    return catalog, membership, calls


def holders(catalog) -> list[tuple[str, bool]]:
    return [(s.server_id, s.on_demand) for s in catalog.get("ds").shares]


def test_a_spare_first_then_a_holder_with_room_then_on_demand(tmp_path):
    catalog, _, calls = cluster(tmp_path, {"a": 9, "b": 9, "spare": 9}, [("a", 0, 10, 4), ("b", 10, 20, 4)])
    assert asyncio.run(catalog.fail_over("a")) == 1
    assert holders(catalog) == [("spare", False), ("b", False)]
    assert [(sid, method) for sid, method, _ in calls.log] == [("spare", "AssignShare"), ("spare", "StartPreload")]
    assert calls.log[1][2].first_id == 0  # the share's preload, not every share of the dataset there

    # No spare now (a, empty again, refuses): b holds a share of the dataset and has 9 - 1 - 4 = 4
    # regions free, enough.
    calls.refuse = {"a"}
    assert asyncio.run(catalog.fail_over("spare")) == 1
    assert holders(catalog) == [("b", False), ("b", False)]


def test_without_room_a_survivor_serves_on_demand_and_a_server_with_room_takes_it_back(tmp_path):
    catalog, membership, calls = cluster(tmp_path, {"a": 6, "b": 6}, [("a", 0, 10, 4), ("b", 10, 20, 4)])
    calls.refuse = {"a"}
    assert asyncio.run(catalog.fail_over("a")) == 1
    assert holders(catalog) == [("b", True), ("b", False)]
    assigned = calls.log[0][2]
    assert assigned.share.on_demand and assigned.share.num_regions == 4
    info = catalog.get("ds")
    assert info.state == kspeed_pb2.DatasetState.DATASET_STATE_DEGRADED

    # A share held on demand takes no regions: b still has 6 - 1 - 4 = 1 free; a new server has room.
    request = kspeed_pb2.RegisterServerRequest(
        id="c", address="c:1", inventory=kspeed_pb2.ServerInventory(region_size=REGION, regions_total=6)
    )
    membership.probe_result("c", membership.register(request, 1).incarnation, True)
    calls.log.clear()
    assert asyncio.run(catalog.rehome()) == 1
    assert holders(catalog) == [("c", False), ("b", False)]
    methods = [(sid, method) for sid, method, _ in calls.log]
    assert methods == [("c", "AssignShare"), ("c", "StartPreload"), ("b", "DropDataset")]
    assert calls.log[2][2].first_id == 0  # only the share it served on demand
    assert asyncio.run(catalog.rehome()) == 0  # nothing left to move


def test_no_survivor_leaves_the_share_where_it_was(tmp_path):
    catalog, _, calls = cluster(tmp_path, {"a": 6, "b": 6}, [("a", 0, 10, 4), ("b", 10, 20, 4)])
    calls.refuse = {"b"}  # the only candidate refuses
    assert asyncio.run(catalog.fail_over("a")) == 0
    assert holders(catalog) == [("a", False), ("b", False)]


def test_heartbeats_name_shares_held_elsewhere_and_shares_missing(tmp_path):
    catalog, _, _ = cluster(tmp_path, {"a": 9, "b": 9}, [("a", 0, 10, 4), ("b", 10, 20, 4)])
    report = [
        kspeed_pb2.ShareStatus(dataset="ds", first_id=0),  # its own
        kspeed_pb2.ShareStatus(dataset="ds", first_id=10),  # b's: held elsewhere now
        kspeed_pb2.ShareStatus(dataset="gone", first_id=0),  # a dataset the cluster no longer has
    ]
    stale, moved, missing = catalog.on_heartbeat("a", report)
    assert stale == ["gone"]
    assert [(r.dataset, r.first_id) for r in moved] == [("ds", 10)]
    assert missing == []
    stale, moved, missing = catalog.on_heartbeat("b", [])
    assert (stale, moved) == ([], [])
    assert [(m.spec.name, m.share.first_id) for m in missing] == [("ds", 10)]
