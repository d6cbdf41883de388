"""The servers' store of live positions (kspeed/server/positions.py): the newest per rank, bounded."""

from __future__ import annotations

import pytest

from kspeed.errors import ProtocolError
from kspeed.proto import kspeed_pb2
from kspeed.server.positions import MAX_STATE, Positions


def position(rank: int, state: bytes = b"{}", *, world: int = 2, job: str = "j", dataset: str = "d"):
    return kspeed_pb2.Position(dataset=dataset, job=job, world_size=world, rank=rank, state=state)


def test_the_newest_position_of_each_rank_is_kept_per_job_and_dataset():
    kept = Positions()
    kept.keep(position(0, b"a"))
    kept.keep(position(1, b"b"))
    kept.keep(position(0, b"c"))
    kept.keep(position(0, b"x", job="other"))
    kept.keep(position(0, b"y", dataset="e"))
    kept.keep(position(2, b"z", world=3))
    got = sorted((p.world_size, p.rank, p.state) for p in kept.of("d", "j"))
    assert got == [(2, 0, b"c"), (2, 1, b"b"), (3, 2, b"z")]
    assert kept.of("d", "nobody") == []
    assert kept.nbytes == 5


def test_the_least_recently_updated_go_first_beyond_the_byte_cap():
    kept = Positions(max_bytes=10)
    for rank in range(4):
        kept.keep(position(rank, b"1234", world=4))
    kept.keep(position(1, b"1234", world=4))  # (updated: kept before the others)
    assert sorted(p.rank for p in kept.of("d", "j")) == [1, 3]
    assert kept.nbytes == 8


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        (position(0, job=""), "job name"),
        (position(0, dataset="x" * 300), "dataset name"),
        (position(2, world=2), "rank 2 of world size 2"),
        (position(0, world=0), "rank 0 of world size 0"),
        (position(0, b"x" * (MAX_STATE + 1)), "over 4096"),
    ],
)
def test_a_bad_position_is_named_and_nothing_is_kept(bad, named):
    kept = Positions()
    with pytest.raises(ProtocolError, match=named):
        kept.keep(bad)
    assert kept.nbytes == 0 and kept.of(bad.dataset, bad.job) == []
