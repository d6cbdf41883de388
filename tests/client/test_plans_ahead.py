"""A user sampler's next epoch planned ahead from a prediction, against in-process fake servers: used
when the sampler then gives the predicted order, given up (and dropped by the servers) when it does
not, and the order delivered always the one the sampler gives without KSpeed."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, SubsetRandomSampler, WeightedRandomSampler

from kspeed.cli.cluster import wait_for
from tests.client.conftest import N_SAMPLES
from tests.client.test_delivery import check_batch
from tests.client.test_faults import NoFailover

EPOCHS = 4
SEED = 5


class GlobalShuffle:
    """A sampler of the user's with ``set_epoch``, drawing from torch's global generator: predicted
    from a deep copy set to the next epoch."""

    def __init__(self, n):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.n).tolist()
        shift = self.epoch % 5  # the epoch matters too
        return iter(order[shift:] + order[:shift])

    def __len__(self):
        return self.n


SAMPLERS = {
    "random": lambda: RandomSampler(range(N_SAMPLES)),
    "random-own-generator": lambda: RandomSampler(range(N_SAMPLES), generator=torch.Generator().manual_seed(3)),
    "random-with-replacement": lambda: RandomSampler(range(N_SAMPLES), replacement=True, num_samples=150),
    "subset": lambda: SubsetRandomSampler(range(0, N_SAMPLES, 2)),
    "weighted": lambda: WeightedRandomSampler(torch.arange(1.0, N_SAMPLES + 1, dtype=torch.double), 120),
    "user-class": lambda: GlobalShuffle(N_SAMPLES),
}


def sampler_orders(make, epochs, *, before=None, after=None, set_epoch=True):
    """What ``make()``'s sampler gives epoch after epoch without KSpeed, torch's global generator
    seeded :data:`SEED` first and ``before``/``after`` each draw run around it; the generator's state
    at the end, and the sampler."""
    torch.manual_seed(SEED)
    sampler = make()
    orders = []
    for epoch in range(epochs):
        if set_epoch and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        if before is not None:
            before()
        orders.append([int(i) for i in sampler])
        if after is not None:
            after()
    return orders, torch.get_rng_state(), sampler


def delivered(ds, samples, epochs, *, after=None, set_epoch=True):
    """The IDs ``ds`` delivers epoch after epoch (bytes and labels checked), torch's global generator
    seeded :data:`SEED` first and ``after`` run after each epoch; the passes each epoch used."""
    torch.manual_seed(SEED)
    orders, passes = [], []
    for epoch in range(epochs):
        if set_epoch:
            ds.set_epoch(epoch)
        ids = []
        for batch in ds:
            check_batch(batch, samples)
            ids += batch.ids.tolist()
        orders.append(ids)
        passes.append(ds._pump._current.feed_epoch)
        if after is not None:
            after()
    return orders, passes


def figures(ds):
    stats = ds.stats()
    return stats["orders_predicted"], stats["predictions_used"], stats["predictions_missed"]


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
def test_a_user_samplers_next_epoch_is_planned_ahead_and_used(make_ds, samples, kind):
    ds, _ = make_ds(sampler=SAMPLERS[kind]())
    got, _ = delivered(ds, samples, EPOCHS)
    after = torch.get_rng_state()
    want, want_after, twin = sampler_orders(SAMPLERS[kind], EPOCHS)
    assert got == want  # the sampler's own orders ...
    assert torch.equal(after, want_after)  # ... and nothing else drawn from torch's global generator
    if kind == "random-own-generator":
        assert torch.equal(ds._orders.sampler.generator.get_state(), twin.generator.get_state())
    # every epoch after the first used the plan made ahead; the last prediction is the next epoch's
    assert figures(ds) == (EPOCHS, EPOCHS - 1, 0)


def test_the_predicted_epoch_is_granted_before_the_current_one_ends(make_ds):
    ds, _ = make_ds(sampler=RandomSampler(range(N_SAMPLES)), ring_bytes=4 << 20)
    ds.set_epoch(0)
    it = iter(ds)
    next(it)
    prediction, future = ds._pump.foresight._ahead
    assert prediction.epoch == 1
    ahead = future.result(timeout=30)  # planned on the helper thread; let it finish on a loaded machine
    for _ in range(len(ds) - 1):
        next(it)
    # The last batch of epoch 0 is delivered and the ring already holds grants of the predicted epoch 1.
    assert any(slot.plan is ahead for slot in ds._pump._queue)
    ds.set_epoch(1)
    assert len(list(ds)) == len(ds)
    assert ds._pump._current is ahead
    assert figures(ds)[1:] == (1, 0)


def test_a_loop_that_draws_from_torchs_global_rng_gets_the_samplers_order_anyway(make_ds, samples, caplog):
    def draw():
        return torch.rand(1000)  # e.g. noise on the CPU, between two epochs

    make = SAMPLERS["random"]
    ds, fakes = make_ds(sampler=make())
    got, passes = delivered(ds, samples, EPOCHS, after=draw)
    want, want_after, _ = sampler_orders(make, EPOCHS, after=draw)
    assert got == want and torch.equal(torch.get_rng_state(), want_after)
    assert figures(ds) == (EPOCHS, 0, EPOCHS - 1)  # every prediction missed: each epoch planned when it started
    told = [r.getMessage() for r in caplog.records if "could not be predicted" in r.getMessage()]
    assert len(told) == 1  # once per dataset, with why
    assert "the training loop drew from torch's global RNG between epochs, so RandomSampler's next" in told[0]
    # The servers were told to drop the plans made ahead in vain: they keep the ones used and the one ahead.
    ahead = ds._pump.foresight._ahead[1].result(timeout=30)
    kept = {*passes, ahead.feed_epoch}
    wait_for(lambda: all(set(fake.plans) == kept for fake in fakes), 10, "the missed plans dropped")


def test_a_dataloader_over_the_dataset_is_predicted_past_the_seed_it_draws(make_ds, samples, caplog):
    caplog.set_level(logging.DEBUG, logger="kspeed")
    make = SAMPLERS["random"]
    ds, _ = make_ds(sampler=make())
    torch.manual_seed(SEED)
    got = []
    for epoch in range(EPOCHS):
        ds.set_epoch(epoch)
        got.append([i for batch in DataLoader(ds, batch_size=None) for i in batch.ids.tolist()])
    # A DataLoader draws its workers' base seed from torch's global generator before it iterates the dataset.
    want, _, _ = sampler_orders(make, EPOCHS, before=lambda: torch.empty((), dtype=torch.int64).random_())
    assert got == want
    assert figures(ds) == (EPOCHS, EPOCHS - 2, 1)  # the first boundary missed, then learnt
    assert any(
        "draws as much as 1 seed(s) from torch's global RNG between epochs" in r.getMessage() for r in caplog.records
    )
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # nothing to fix


def test_an_epoch_iterated_again_without_set_epoch_is_predicted_again(make_ds, samples):
    make = SAMPLERS["random"]
    ds, _ = make_ds(sampler=make())
    got, _ = delivered(ds, samples, EPOCHS, set_epoch=False)
    want, _, _ = sampler_orders(make, EPOCHS, set_epoch=False)
    assert got == want
    # epoch 1 was predicted after the first iteration; from the second on, epoch 0 again
    assert figures(ds) == (EPOCHS, EPOCHS - 2, 1)


def test_resume_draws_the_resumed_epoch_from_the_sampler(make_ds, samples):
    # As documented for a sampler not deterministic in (seed, epoch): the resumed epoch's order is
    # drawn again, its first batches skipped; the same samples when the sampler's state was restored.
    def make():
        return RandomSampler(range(N_SAMPLES), generator=torch.Generator().manual_seed(8))

    ds, _ = make_ds(sampler=make())
    ds.set_epoch(0)
    assert len(list(ds)) == len(ds)
    saved = ds._orders.sampler.generator.get_state()  # what the user saves with the checkpoint
    ds.set_epoch(1)
    full, state = [], None
    for i, batch in enumerate(ds):
        full.append(batch.ids.tolist())
        if i == 2:
            state = ds.state_dict()
    assert figures(ds)[1] == 1  # epoch 1 was the plan made ahead
    sampler = make()
    sampler.generator.set_state(saved)
    again, _ = make_ds(sampler=sampler)
    again.load_state_dict(state)
    again.set_epoch(1)
    assert [b.ids.tolist() for b in again] == full[3:]


def test_the_plan_made_ahead_before_a_failover_is_dropped_and_made_again(make_ds, samples):
    ds, fakes = make_ds(sampler=RandomSampler(range(N_SAMPLES)), ring_bytes=128 << 10)  # nothing of it granted yet
    torch.manual_seed(SEED)
    ds.set_epoch(0)
    it = iter(ds)
    got = [next(it).ids.tolist()]
    pump = ds._pump
    early = pump.foresight._ahead[1].result(timeout=10)
    assert all(early.feed_epoch in fake.plans for fake in fakes)
    pump.failover = NoFailover()
    pump._grant_again([])  # as after a failover
    pump.failover = None
    wait_for(lambda: all(early.feed_epoch not in fake.plans for fake in fakes), 10, "the early plan dropped")
    again = pump.foresight._ahead[1].result(timeout=10)
    assert again.feed_epoch > early.feed_epoch  # made again, for the servers of now
    got += [batch.ids.tolist() for batch in it]
    ds.set_epoch(1)
    got += [batch.ids.tolist() for batch in ds]
    assert pump._current is again
    want, _, _ = sampler_orders(SAMPLERS["random"], 2)
    assert [i for ids in got for i in ids] == want[0] + want[1]
