"""What is left of an epoch and each rank's part of it after a resize (:mod:`kspeed.client.planning.resize`),
checked against torch's own ``DistributedSampler`` and against exactly-once over the whole epoch."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, RandomSampler

from kspeed.client.planning.resize import Pass, part_of, remainder
from kspeed.client.planning.sampling import EpochOrders
from kspeed.errors import ConfigError


def orders(n: int, rank: int, world: int, *, seed: int = 3, drop_last: bool = False, batch: int = 4) -> EpochOrders:
    return EpochOrders(
        None,
        num_samples=n,
        batch_size=batch,
        drop_last=drop_last,
        seed=seed,
        shuffle=True,
        rank=rank,
        world_size=world,
        dataset="d",
    )


def of_sampler(sampler, n: int, batch: int = 4) -> EpochOrders:
    """The orders of a sampler of the caller's over ``n`` samples."""
    return EpochOrders(
        sampler, num_samples=n, batch_size=batch, drop_last=False, seed=0, shuffle=True,
        rank=None, world_size=None, dataset="d",
    )  # fmt: skip


@pytest.mark.parametrize(("n", "world"), [(36, 4), (37, 4), (37, 3), (5, 8)])
def test_a_part_of_the_global_order_is_what_the_distributed_sampler_gives_that_rank(n, world):
    for rank in range(world):
        o = orders(n, rank, world)
        torch_sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=3)
        torch_sampler.set_epoch(6)
        assert part_of(o.global_order(6), rank, world).tolist() == list(torch_sampler)
        assert o.order(6).tolist() == list(torch_sampler)


def consume(order: np.ndarray, world: int, batch: int, fraction: float) -> tuple[list[int], Pass]:
    """Every rank of ``world`` consumes the same number of batches, about ``fraction`` of its part."""
    parts = [part_of(order, r, world) for r in range(world)]
    batches = round(fraction * -(-len(parts[0]) // batch))
    k = min(batches * batch, len(parts[0]))
    return [i for p in parts for i in p[:k].tolist()], Pass(world, (k,) * world)


@pytest.mark.parametrize("n", [36, 37, 61])
@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 3), (3, 1), (1, 4)])
def test_a_resize_at_37_percent_delivers_every_sample_once_apart_from_the_pads(n, before, after):
    order = orders(n, 0, before).global_order(2)
    seen, done = consume(order, before, batch=3, fraction=0.37)
    rest = remainder(order, [done])
    parts = [part_of(rest, r, after) for r in range(after)]
    assert len({len(p) for p in parts}) == 1  # ranks of a pass get equal parts
    seen += [i for p in parts for i in p.tolist()]
    counts = Counter(seen)
    assert set(counts) == set(range(n))
    pads = sum(c - 1 for c in counts.values())
    assert pads == len(parts[0]) * after - len(rest) < after  # only the new pass's pads repeat a sample
    assert 0 < n - len(rest) < n  # the epoch was part way


def test_resized_twice_and_with_ranks_at_different_positions():
    n = 61
    order = orders(n, 0, 4).global_order(0)
    parts = [part_of(order, r, 4) for r in range(4)]
    positions = (6, 5, 6, 4)  # (merged states: each rank's own)
    seen = [i for p, k in zip(parts, positions, strict=True) for i in p[:k].tolist()]
    first = Pass(4, positions)
    rest = remainder(order, [first])
    assert len(rest) == n - sum(positions)
    second_parts = [part_of(rest, r, 2) for r in range(2)]
    seen += [i for p in second_parts for i in p[:7].tolist()]
    rest2 = remainder(order, [first, Pass(2, (7, 7))])
    assert len(rest2) == len(rest) - 14
    for r in range(3):
        seen += part_of(rest2, r, 3).tolist()
    counts = Counter(seen)
    assert set(counts) == set(range(n))
    assert sum(c - 1 for c in counts.values()) == -len(rest2) % 3


def test_a_finished_pass_leaves_nothing_and_a_pass_never_begun_leaves_everything():
    order = orders(37, 0, 4).global_order(1)
    assert remainder(order, [Pass(4, (10, 10, 10, 10))]).tolist() == []  # (its pads counted too)
    assert remainder(order, [Pass(3, (0, 0, 0))]).tolist() == order.tolist()


def test_only_an_order_split_from_one_global_order_resizes():
    shard = EpochOrders(
        None,
        num_samples=10,
        batch_size=2,
        drop_last=False,
        seed=1,
        shuffle=True,
        rank=0,
        world_size=2,
        dataset="d",
        shard_starts=np.array([0, 5, 10]),
        shuffle_buffer=4,
    )
    assert shard.split() is None and shard.order_identity is None
    with pytest.raises(ConfigError, match="does not split one global order"):
        shard.global_order(0)
    mine = of_sampler(DistributedSampler(range(10), num_replicas=2, rank=1, seed=4, drop_last=True), 10)
    assert mine.split() is None  # (drop_last: the tail it drops depends on the world size)
    theirs = of_sampler(DistributedSampler(range(10), num_replicas=2, rank=1, seed=4), 10)
    assert theirs.split() == (1, 2)
    assert theirs.order_identity == "DistributedSampler(samples=10,shuffle=True,seed=4)"


def test_a_resumed_order_is_this_epochs_only_and_its_length_counts():
    o = orders(40, 1, 4, batch=3)
    o.set_epoch(5)
    assert o.num_batches() == 4
    o.resume(5, np.arange(7))
    assert o.order(5).tolist() == list(range(7)) and o.num_batches() == 3
    assert o.order(6).tolist() == part_of(o.global_order(6), 1, 4).tolist()
    o.set_epoch(6)
    assert o.num_batches() == 4
    o.resume(5, None)
    assert o.order(5).tolist() == part_of(o.global_order(5), 1, 4).tolist()


def test_a_bad_pass_is_named():
    with pytest.raises(ConfigError, match="one non-negative position per rank"):
        Pass(2, (1,))
    with pytest.raises(ConfigError, match="not a pass"):
        Pass.from_state("x")


class BlockShuffle:
    """A sampler of a user's that declares its global order: blocks of four samples, shuffled per
    epoch, split over the ranks as DistributedSampler splits (written here without KSpeed's help)."""

    def __init__(self, n: int, rank: int, num_replicas: int, seed: int = 0, lie: bool = False) -> None:
        self.n, self.rank, self.num_replicas, self.seed, self.lie = n, rank, num_replicas, seed, lie
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def global_order(self, epoch: int) -> list[int]:
        blocks = [list(range(i, min(i + 4, self.n))) for i in range(0, self.n, 4)]
        np.random.default_rng([self.seed, epoch]).shuffle(blocks)
        return [i for block in blocks for i in block]

    def __iter__(self):
        order = self.global_order(self.epoch + self.lie)
        per_rank = -(-self.n // self.num_replicas)
        padded = order + order[: per_rank * self.num_replicas - self.n]
        return iter(padded[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return -(-self.n // self.num_replicas)


def declared(sampler) -> EpochOrders:
    return of_sampler(sampler, sampler.n)


def test_a_sampler_that_declares_its_global_order_is_planned_from_it_and_checked():
    sampler = BlockShuffle(37, 2, 3, seed=5)
    o = declared(sampler)
    o.check_declared()
    assert o.declared and o.deterministic and o.split() == (2, 3)
    assert o.order_identity == f"{__name__}.BlockShuffle(samples=37,seed=5)"
    sampler.set_epoch(4)
    assert o.order(4).tolist() == list(sampler) and o.global_order(4).tolist() == sampler.global_order(4)
    with pytest.raises(ConfigError, match="yields something else than rank 1's part"):
        declared(BlockShuffle(37, 1, 3, lie=True)).check_declared()


def test_a_declared_order_resumes_at_another_world_size(make_ds, samples):
    n = len(samples)
    seen, states = [], []
    for rank in range(3):
        ds, _ = make_ds(sampler=BlockShuffle(n, rank, 3, seed=1), batch_size=8)
        ds.set_epoch(2)
        for k, batch in enumerate(ds):
            seen += batch.ids.tolist()
            if k == 2:
                break
        states.append(ds.state_dict())
    for rank in range(2):
        ds, _ = make_ds(sampler=BlockShuffle(n, rank, 2, seed=1), batch_size=5)
        ds.load_state_dict(states[0])
        ds.set_epoch(2)
        seen += [i for batch in ds for i in batch.ids.tolist()]
    counts = Counter(seen)
    assert set(counts) == set(range(n)) and sum(c - 1 for c in counts.values()) < 2


def test_a_random_sampler_with_its_own_generator_resumes_at_another_batch_size(make_ds, samples):
    n = len(samples)
    reference = RandomSampler(range(n), generator=torch.Generator().manual_seed(3))
    whole = [list(reference), list(reference)]  # epochs 0 and 1 of an uninterrupted run
    ds, _ = make_ds(sampler=RandomSampler(range(n), generator=torch.Generator().manual_seed(3)), batch_size=8)
    got = []
    for k, batch in enumerate(ds):
        got += batch.ids.tolist()
        if k == 2:
            break
    state = ds.state_dict()
    assert state["position"] == 24 and "generator" in state
    other = RandomSampler(range(n), generator=torch.Generator().manual_seed(99))  # (put back from the state)
    again, _ = make_ds(sampler=other, batch_size=5)
    again.load_state_dict(state)
    again.set_epoch(0)
    assert len(again) == -(-(n - 24) // 5)
    rest = [i for batch in again for i in batch.ids.tolist()]
    assert got + rest == whole[0]  # the epoch exactly once, in its order
    again.set_epoch(1)
    assert [i for batch in again for i in batch.ids.tolist()] == whole[1]  # and the run goes on as it would have
    bad = dict(state, generator="not base64!")
    with pytest.raises(ConfigError, match="bad generator state"):
        make_ds(sampler=other, batch_size=5)[0].load_state_dict(bad)
    unseeded, _ = make_ds(sampler=RandomSampler(range(n)), batch_size=5)
    with pytest.raises(ConfigError, match="draws from torch's global generator"):
        unseeded.load_state_dict(state)  # (no generator of its own: named)
