"""A live resume (kspeed/client/live.py): the job's state from its ranks' kept positions, and ranks
that continue an epoch from the servers' record, at the same or another world size."""

from __future__ import annotations

import json
from collections import Counter

from kspeed.client.live import LivePositions, newest_state
from kspeed.errors import UnavailableError
from kspeed.proto import kspeed_pb2
from kspeed.server.positions import Positions
from tests.client.conftest import N_SAMPLES


def kept(state: dict) -> kspeed_pb2.Position:
    return kspeed_pb2.Position(
        dataset="d", job="j", world_size=state["world_size"], rank=state["rank"], state=json.dumps(state).encode()
    )


def state(rank: int, world: int, passes: list, epoch: int = 1) -> dict:
    return {"epoch": epoch, "rank": rank, "world_size": world, "passes": passes, "batch_size": 4}


def test_the_newest_pass_wins_and_each_rank_keeps_its_own_furthest_position():
    old = [kept(state(r, 4, [[4, [8] * 4]])) for r in range(4)]
    new = [
        kept(state(0, 2, [[4, [8, 8, 8, 8]], [2, [4, 4]]])),
        kept(state(0, 2, [[4, [8, 8, 8, 8]], [2, [8, 8]]])),  # (its later report)
    ]
    got = newest_state([*old, *new, kspeed_pb2.Position(state=b"not json")])
    assert got is not None and got["passes"] == [[4, [8, 8, 8, 8]], [2, [8, 0]]]  # rank 1 reported none
    later = newest_state([*new, kept(state(1, 3, [[3, [0, 0, 0]]], epoch=2))])
    assert later is not None and later["epoch"] == 2 and later["passes"] == [[3, [0, 0, 0]]]
    assert newest_state([]) is None


def read(ds, batches=None) -> list[int]:
    got = []
    for k, batch in enumerate(ds):
        got += batch.ids.tolist()
        if batches is not None and k + 1 == batches:
            break
    return got


def test_ranks_continue_the_epoch_from_the_servers_record_at_the_same_and_another_world_size(make_ds):
    seen = []
    # Three ranks read part of epoch 4 (each a different number of batches), their positions kept.
    first = [make_ds(batch_size=8, rank=r, world_size=3, seed=2) for r in range(3)]
    stores = {fake.server_id: fake.kept for fake in first[0][1]}
    for _, fakes in first[1:]:  # (one cluster: the same servers' stores)
        for fake in fakes:
            fake.kept = stores[fake.server_id]
    assert [ds.resume_live("job") for ds, _ in first] == [False] * 3  # a new job: nothing kept yet
    for (ds, _), batches in zip(first, [3, 2, 3], strict=True):
        ds.set_epoch(4)
        seen += read(ds, batches)
    # Two ranks take over through the same servers (another world size: the rest split anew); one
    # reads on, then both stop, and two others join that pass at their own positions.
    second = []
    for rank in range(2):
        ds, _ = make_ds(batch_size=8, rank=rank, world_size=2, seed=2, kept=stores)
        assert ds.resume_live("job") is True and ds.epoch == 4
        second.append(ds)
    seen += read(second[0], 2)
    for rank in range(2):
        ds, _ = make_ds(batch_size=8, rank=rank, world_size=2, seed=2, kept=stores)
        assert ds.resume_live("job") is True
        seen += read(ds)
        ds.set_epoch(5)  # the next epoch is whole again
        assert len(ds.sampler) == -(-N_SAMPLES // 2)
    counts = Counter(seen)
    assert set(counts) == set(range(N_SAMPLES))
    assert sum(c - 1 for c in counts.values()) < 2  # (a pad of the two ranks' pass)


class Keeper:
    """A server's link that keeps positions, or fails to (a server that is down)."""

    def __init__(self, server_id: str, down: bool = False) -> None:
        self.server_id, self.name, self.down, self.calls = server_id, f"server {server_id}", down, 0
        self.kept = Positions()

    def keep_position(self, position):
        self.calls += 1
        if self.down:
            raise UnavailableError(f"{self.name} is unreachable")
        self.kept.keep(position)
        return lambda: None


def test_a_server_that_does_not_keep_a_position_is_passed_over_and_the_others_keep_two_copies(caplog):
    servers = [Keeper("a", down=True), Keeper("b"), Keeper("c")]
    live = LivePositions("d", "j", lambda: servers)
    for batch in range(5):
        live.keep(state(0, 1, [[1, [batch * 4]]]))
    assert servers[0].calls == 1  # (tried once, then passed over while the others keep it)
    assert [len(s.kept.of("d", "j")) for s in servers[1:]] == [1, 1]  # (two copies from the second on)
    assert live.kept == 5 and live.missed == 0
    for s in servers:
        s.down = True
    live.keep(state(0, 1, [[1, [20]]]))
    assert live.missed == 1 and "no server kept rank 0's position" in caplog.text
