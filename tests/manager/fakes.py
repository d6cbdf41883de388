"""What the manager's unit tests stand in for servers with (no daemon): ready members, and a listing."""

from __future__ import annotations

import numpy as np

from kspeed import wire
from kspeed.manager.membership import Membership
from kspeed.proto import kspeed_pb2

REGION = 1 << 20


def ready(membership: Membership, *ids: str, regions: int = 2) -> None:
    """Register ``ids`` with ``regions`` regions each (one of them the window) and probe them ready."""
    inventory = kspeed_pb2.ServerInventory(region_size=REGION, regions_total=regions, regions_window=1)
    for sid in ids:
        record = membership.register(
            kspeed_pb2.RegisterServerRequest(id=sid, address=f"{sid}:1", inventory=inventory), 1
        )
        membership.probe_result(sid, record.incarnation, True)


def listing() -> kspeed_pb2.DescribeDatasetReply:
    """A server's listing of a dataset of 20 samples of 100 bytes, in two regions of ten."""
    return kspeed_pb2.DescribeDatasetReply(
        fingerprint=kspeed_pb2.Fingerprint(count=20, total_bytes=2000, digest="d"),
        region_size=REGION,
        region_starts=wire.pack_i64(np.array([0, 10, 20])),
        region_bytes=wire.pack_i64(np.array([1000, 1000])),
    )
