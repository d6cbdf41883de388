"""Epoch orders: the same IDs a DataLoader would draw, planned early only when that is safe."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from kspeed.client.planning import compact, sampling
from kspeed.client.planning.sampling import EpochOrders, ShardOrder, distributed_order, sampler_order
from kspeed.errors import ConfigError, DatasetError

N = 103


def loader_ids(sampler, batch_size, drop_last, epoch=None):
    if epoch is not None and hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    loader = DataLoader(range(N), sampler=sampler, batch_size=batch_size, drop_last=drop_last)
    return [int(i) for batch in loader for i in batch]


def orders(sampler=None, **kwargs):
    args = dict(
        num_samples=N, batch_size=8, drop_last=False, seed=0, shuffle=True, rank=None, world_size=None, dataset="t"
    )
    args.update(kwargs)
    return EpochOrders(sampler, **args)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("rank", [0, 1])
def test_builtin_distributed_order_equals_dataloader(drop_last, rank):
    o = orders(rank=rank, world_size=2, seed=5, drop_last=drop_last)
    assert o.deterministic
    reference = DistributedSampler(range(N), num_replicas=2, rank=rank, shuffle=True, seed=5)
    for epoch in (0, 1, 2):
        expected = loader_ids(reference, 8, drop_last, epoch)
        assert o.order(epoch).tolist() == expected
    assert o.num_batches() == (52 // 8 if drop_last else -(-52 // 8))  # 103 IDs padded to 2 x 52


def test_epochs_differ_and_repeat():
    o = orders()
    assert o.order(0).tolist() != o.order(1).tolist()
    assert o.order(1).tolist() == o.order(1).tolist()
    assert sorted(o.order(0).tolist()) == list(range(N))
    unshuffled = orders(shuffle=False)
    assert unshuffled.order(4).tolist() == list(range(N))


def test_planning_ahead_leaves_the_users_sampler_alone():
    user = DistributedSampler(range(N), num_replicas=3, rank=2, shuffle=True, seed=1)
    o = orders(user)
    assert o.deterministic
    o.order(7)
    assert user.epoch == 0  # a copy was set to epoch 7, not the user's object
    o.set_epoch(2)
    assert user.epoch == 2
    assert o.order(2).tolist() == loader_ids(DistributedSampler(range(N), 3, 2, True, 1), 8, False, 2)


def test_random_sampler_is_drawn_like_a_dataloader():
    ours = RandomSampler(range(N), generator=torch.Generator().manual_seed(3))
    theirs = RandomSampler(range(N), generator=torch.Generator().manual_seed(3))
    o = orders(ours)
    assert not o.deterministic
    for _ in range(2):  # one draw per epoch, at the same moments as the DataLoader's
        assert o.order(0).tolist() == loader_ids(theirs, 8, False)
    assert torch.equal(ours.generator.get_state(), theirs.generator.get_state())


def test_sequential_sampler_and_duplicates():
    o = orders(SequentialSampler(range(N)), drop_last=True)
    assert o.order(0).tolist() == list(range(96))
    dup = orders([5, 5, 6, 5])
    assert dup.order(0).tolist() == [5, 5, 6, 5]
    assert dup.num_batches() == 1


def test_bad_samplers_are_named():
    with pytest.raises(ConfigError, match="either a sampler or rank"):
        orders(SequentialSampler(range(N)), rank=0, world_size=2)
    with pytest.raises(ConfigError, match=r"rank must be in 0\.\.1"):
        orders(rank=2, world_size=2)
    with pytest.raises(ConfigError, match="world_size"):
        orders(world_size=0)
    with pytest.raises(DatasetError, match="sampler yielded sample 103"):
        orders([1, 2, N]).order(0)
    with pytest.raises(ConfigError, match="has no len"):
        orders(iter(np.arange(3))).num_batches()


@pytest.mark.parametrize(
    ("n", "world", "shuffle", "drop_last"),
    [(203, 1, True, False), (203, 4, True, False), (203, 4, True, True), (10, 7, False, False), (3, 8, True, False)],
)
def test_the_distributed_order_is_the_samplers_own(n, world, shuffle, drop_last):
    # The built-in sampler's order is computed with array operations; it must be exactly what
    # iterating DistributedSampler yields, padding (even beyond the dataset) included.
    for rank in range(world):
        sampler = DistributedSampler(
            range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=5, drop_last=drop_last
        )
        for epoch in (0, 3):
            sampler.set_epoch(epoch)
            assert distributed_order(sampler).tolist() == list(sampler)


def test_the_shard_order_reads_every_sample_once_per_epoch_a_few_shards_at_a_time():
    sizes = [30, 10, 25, 40, 5, 33, 17]
    starts = np.concatenate(([0], np.cumsum(sizes)))
    shard_of = np.repeat(np.arange(len(sizes)), sizes)
    n, world, buffer = int(starts[-1]), 3, 8
    orders = [ShardOrder(starts, buffer, seed=4, rank=r, world=world) for r in range(world)]
    for epoch in (0, 1):
        for o in orders:
            o.set_epoch(epoch)
        got = [o.order() for o in orders]
        assert all(len(g) == len(orders[0]) == -(-n // world) for g in got)
        every = np.concatenate(got)
        assert sorted(set(every.tolist())) == list(range(n))  # each sample, the padding repeats a few
        assert len(every) - n == len(orders[0]) * world - n
        for g in got:  # a rank's stretch spans few shards, and the buffer keeps neighbours close
            assert len(set(shard_of[g].tolist())) <= 4
    again = ShardOrder(starts, buffer, seed=4, rank=1, world=world)
    again.set_epoch(1)
    assert np.array_equal(again.order(), orders[1].order())  # deterministic in (seed, epoch)
    again.set_epoch(2)
    assert not np.array_equal(again.order(), orders[1].order())
    unshuffled = ShardOrder(starts, 1, seed=4, rank=0, world=1)
    runs = np.flatnonzero(np.diff(unshuffled.order()) != 1)
    assert len(runs) <= len(sizes) - 1  # buffer 1: whole shards in a row


def test_a_shuffle_buffer_needs_tar_shards_and_no_sampler_of_its_own():
    with pytest.raises(ConfigError, match="has none"):
        EpochOrders(None, num_samples=10, batch_size=2, drop_last=False, seed=0, shuffle=True, rank=None,
                    world_size=None, dataset="d", shuffle_buffer=4)  # fmt: skip
    with pytest.raises(ConfigError, match="not both"):
        EpochOrders(range(10), num_samples=10, batch_size=2, drop_last=False, seed=0, shuffle=True, rank=None,
                    world_size=None, dataset="d", shard_starts=np.array([0, 10]), shuffle_buffer=4)  # fmt: skip


def _buffered(starts, buffer, seed, rank, world, epoch):
    """The shard order as WebDataset's buffer draws it, one Python list per epoch: the reference."""
    rng = np.random.default_rng([seed, epoch])
    shards = rng.permutation(len(starts) - 1)
    seq = [i for s in shards.tolist() for i in range(int(starts[s]), int(starts[s + 1]))]
    per_rank = -(-len(seq) // world)
    seq += (seq * world)[: per_rank * world - len(seq)]
    mine = seq[rank * per_rank : (rank + 1) * per_rank]
    draws = np.random.default_rng([seed, epoch, rank]).integers(0, buffer, len(mine)).tolist()
    buf, out = [], []
    for sample, j in zip(mine, draws, strict=True):
        if len(buf) < buffer:
            buf.append(sample)
        else:
            out.append(buf[j])
            buf[j] = sample
    rest = np.asarray(buf, dtype=np.int64)
    np.random.default_rng([seed, epoch, rank, 1]).shuffle(rest)
    return out + rest.tolist()


@pytest.mark.parametrize("buffer", [2, 9, 500])
def test_the_shard_order_buffer_is_drawn_in_steps_without_a_python_int_per_sample(monkeypatch, buffer):
    # The buffer's pass turns a few samples at a time into Python ints; the order must not depend
    # on where the steps fall.
    monkeypatch.setattr(sampling, "_BUFFER_STEP", 7)
    starts = np.concatenate(([0], np.cumsum([30, 10, 25, 40, 5, 33, 17])))
    for rank in range(3):
        for epoch in (0, 1):
            o = ShardOrder(starts, buffer, seed=4, rank=rank, world=3)
            o.set_epoch(epoch)
            got = o.order()
            assert got.dtype == np.int32
            assert got.tolist() == _buffered(starts, buffer, 4, rank, 3, epoch)


def test_orders_are_int32_ids_below_2_31_samples():
    # A rank holds its order of two epochs at once: 4 bytes per sample, not 8, for any sampler.
    g = torch.Generator().manual_seed(0)
    for sampler in (None, SequentialSampler(range(N)), RandomSampler(range(N), generator=g), [3, 1, 2]):
        ids = orders(sampler).order(0)
        assert ids.dtype == np.int32
    assert orders(SequentialSampler(range(N))).order(0).tolist() == list(range(N))
    assert compact.id_dtype(2**31) == np.int32
    assert compact.id_dtype(2**31 + 1) == np.int64


TORCH_SAMPLERS = {
    "random": lambda: RandomSampler(range(N)),
    "random-own-generator": lambda: RandomSampler(range(N), generator=torch.Generator().manual_seed(2)),
    "random-several-passes": lambda: RandomSampler(range(N), num_samples=2 * N + 7),
    "random-whole-passes": lambda: RandomSampler(range(N), num_samples=2 * N),  # the last, empty pass drawn too
    "random-with-replacement": lambda: RandomSampler(range(N), replacement=True, num_samples=70),
    "subset-list": lambda: SubsetRandomSampler([5, 9, 2, 40, 77, 3]),
    "subset-tensor": lambda: SubsetRandomSampler(torch.arange(0, N, 3)),
    "subset-range": lambda: SubsetRandomSampler(range(10, 60)),
    "weighted": lambda: WeightedRandomSampler(torch.arange(1.0, N + 1), 50),
    "weighted-without-replacement": lambda: WeightedRandomSampler(torch.rand(N, dtype=torch.double), 30, False),
}


@pytest.mark.parametrize("kind", sorted(TORCH_SAMPLERS))
def test_torchs_samplers_are_drawn_as_arrays_exactly_as_iterated(kind, monkeypatch):
    # The same IDs as iterating the sampler, the same draws from its generator and torch's global
    # one (a KSpeed user sees no difference), and no Python int per sample.
    make = TORCH_SAMPLERS[kind]
    torch.manual_seed(1)
    theirs = make()
    want = [[int(i) for i in theirs] for _ in range(2)]
    their_state = torch.get_rng_state()
    torch.manual_seed(1)
    ours = make()
    with monkeypatch.context() as m:
        m.setattr(np, "fromiter", None)  # (not iterated)
        got = [sampler_order(ours).tolist() for _ in range(2)]
    assert got == want
    assert torch.equal(torch.get_rng_state(), their_state)
    if ours.generator is not None:
        assert torch.equal(ours.generator.get_state(), theirs.generator.get_state())


def test_a_subclass_that_iterates_otherwise_is_iterated():
    class Reversed(RandomSampler):
        def __iter__(self):
            return reversed(list(super().__iter__()))

    sampler = Reversed(range(N), generator=torch.Generator().manual_seed(4))
    twin = RandomSampler(range(N), generator=torch.Generator().manual_seed(4))
    assert sampler_order(sampler).tolist() == list(twin)[::-1]


def test_an_order_given_is_planned_in_its_thread_only():
    o = orders(RandomSampler(range(N), generator=torch.Generator().manual_seed(6)))
    drawn = o.order(3)
    elsewhere = []
    with o.given(3, drawn):
        assert o.order(3) is drawn  # not drawn again
        thread = threading.Thread(target=lambda: elsewhere.append(o.order(3)))
        thread.start()
        thread.join()
        assert o.order(4) is not drawn
    assert not np.array_equal(elsewhere[0], drawn)  # another thread draws from the sampler
    assert o.order(3) is not drawn
