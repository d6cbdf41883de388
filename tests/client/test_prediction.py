"""Predicting a user sampler's next order: the order its next draw gives, computed from copies,
without disturbing the sampler or the global generators, and why a prediction failed."""

from __future__ import annotations

import logging
import random
import threading

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, RandomSampler, SubsetRandomSampler, WeightedRandomSampler

from kspeed.client.planning.prediction import MAX_SEEDS, Predictor, Source
from tests.client.test_sampling import N, orders


class PythonShuffle:
    """A sampler of the user's drawing from Python's random."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        order = list(range(self.n))
        random.shuffle(order)
        return iter(order)

    def __len__(self):
        return self.n


class EpochShuffle(DistributedSampler):
    """A DistributedSampler subclass with an ``__iter__`` of its own: deterministic in (seed, epoch),
    but not known to be, so predicted from a copy set to the next epoch."""

    def __iter__(self):
        return reversed(list(super().__iter__()))


SAMPLERS = {
    "random": (Source.GLOBAL, lambda: RandomSampler(range(N))),
    "random-own-generator": (Source.OWN, lambda: RandomSampler(range(N), generator=torch.Generator().manual_seed(1))),
    "subset": (Source.GLOBAL, lambda: SubsetRandomSampler(range(0, N, 2))),
    "weighted": (Source.GLOBAL, lambda: WeightedRandomSampler(torch.arange(1.0, N + 1), 40)),
    "python-random": (Source.COPY, lambda: PythonShuffle(N)),
    "set-epoch": (Source.COPY, lambda: EpochShuffle(range(N), num_replicas=2, rank=1, seed=3)),
    "list": (Source.COPY, lambda: [4, 4, 7, 1]),
}


def global_states():
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def assert_same_states(a, b):
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
    assert all(np.array_equal(x, y) for x, y in zip(a[2], b[2]))


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
def test_a_prediction_is_the_next_draw_and_disturbs_nothing(kind):
    source, make = SAMPLERS[kind]
    sampler = make()
    predictor = Predictor(orders(sampler))
    assert predictor.source is source
    torch.manual_seed(2)
    random.seed(2)
    predictor.orders.set_epoch(0)
    predictor.draw(0)
    before = global_states()
    own = sampler.generator.get_state() if getattr(sampler, "generator", None) is not None else None
    prediction = predictor.predict()
    assert prediction.epoch == 1
    done = []
    thread = threading.Thread(target=lambda: done.append(prediction.order()))  # as on the planner thread
    thread.start()
    thread.join()
    assert_same_states(global_states(), before)  # nothing drawn from the global generators ...
    if own is not None:
        assert torch.equal(sampler.generator.get_state(), own)  # ... nor from the sampler's own
    assert getattr(sampler, "epoch", 0) == 0  # (a copy was set to epoch 1)
    predictor.orders.set_epoch(1)
    real = predictor.draw(1)
    assert np.array_equal(done[0], real)
    assert predictor.check(prediction, 1, real, done[0])
    assert (predictor.predicted, predictor.used, predictor.missed) == (1, 1, 0)


def test_nothing_is_predicted_before_the_first_draw_or_of_a_sampler_that_cannot_be_copied(caplog):
    class Locked(PythonShuffle):
        def __init__(self, n):
            super().__init__(n)
            self.lock = threading.Lock()

    assert Predictor(orders(RandomSampler(range(N)))).predict() is None  # (nothing drawn yet)
    predictor = Predictor(orders(Locked(N)))
    for epoch in range(3):
        predictor.draw(epoch)
        assert predictor.predict() is None
    assert predictor.unable.startswith("Locked cannot be copied (TypeError")
    told = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(told) == 1 and "make it copyable (copy.deepcopy) to have it planned ahead" in told[0].getMessage()


def test_the_datasets_a_sampler_refers_to_are_shared_by_its_copies():
    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            return i

        def __deepcopy__(self, memo):
            raise AssertionError("a dataset is never copied")

    predictor = Predictor(orders(EpochShuffle(Data(), num_replicas=1, rank=0)))
    predictor.draw(0)
    assert predictor.predict() is not None
    seen = []

    class Recording(PythonShuffle):
        def __init__(self, data_source):
            super().__init__(len(data_source))
            self.data_source = data_source

        def __iter__(self):
            seen.append(self.data_source)
            return super().__iter__()

    files = [f"{i}.jpg" for i in range(N)]  # what a sampler draws from, whatever its type
    predictor = Predictor(orders(Recording(files)))
    predictor.draw(0)
    assert predictor.predict() is not None
    assert seen[-1] is files


def test_a_loop_drawing_seeds_between_epochs_is_learnt_and_other_draws_are_told(caplog):
    predictor = Predictor(orders(RandomSampler(range(N))))
    torch.manual_seed(4)

    def boundary(epoch, between):
        prediction = predictor.predict()
        ids = prediction.order()
        between()
        return predictor.check(prediction, epoch, predictor.draw(epoch), ids)

    def seeds(k):
        return lambda: [torch.empty((), dtype=torch.int64).random_() for _ in range(k)]

    predictor.draw(0)
    assert not boundary(1, seeds(1))  # a DataLoader's base seed: missed once, learnt ...
    assert boundary(2, seeds(1))  # ... and predicted past from then on
    assert not boundary(3, seeds(0))  # the DataLoader gone: learnt again
    assert boundary(4, seeds(0))
    assert not boundary(5, lambda: torch.rand(4))  # as much as two seeds, every time: learnt too
    assert boundary(6, lambda: torch.rand(4))
    assert not caplog.records or all(r.levelno < logging.WARNING for r in caplog.records)
    assert not boundary(7, seeds(MAX_SEEDS + 1))  # more than a few seeds: the loop draws from it
    assert not boundary(8, lambda: torch.rand(1000))
    told = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(told) == 1  # once per reason
    assert "the training loop drew from torch's global RNG between epochs, so RandomSampler's next order" in told[0]
    assert "generator=torch.Generator().manual_seed(seed)" in told[0]


def test_why_a_prediction_failed_is_told_per_sampler(caplog):
    own = RandomSampler(range(N), generator=torch.Generator().manual_seed(5))
    predictor = Predictor(orders(own))
    predictor.draw(0)
    prediction = predictor.predict()
    ids = prediction.order()
    torch.rand(1, generator=own.generator)  # the loop draws from the sampler's generator
    assert not predictor.check(prediction, 1, predictor.draw(1), ids)
    python = Predictor(orders(PythonShuffle(N)))
    python.draw(0)
    prediction = python.predict()
    random.random()  # the loop draws from Python's random
    assert not python.check(prediction, 1, python.draw(1), prediction.order())

    class FreshEntropy(PythonShuffle):
        def __iter__(self):
            return iter(np.random.default_rng().permutation(self.n).tolist())  # from the OS, every time

    fresh = Predictor(orders(FreshEntropy(N)))
    fresh.draw(0)
    prediction = fresh.predict()
    assert not fresh.check(prediction, 1, fresh.draw(1), prediction.order())
    told = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(told) == 3
    assert "RandomSampler's generator was drawn from or seeded between epochs" in told[0]
    assert "the training loop drew from Python's or numpy's global RNG between epochs, so PythonShuffle's" in told[1]
    assert "FreshEntropy's order depends on more than its own state and the global generators" in told[2]


def test_another_epoch_than_predicted_is_a_miss_and_a_repeated_epoch_is_predicted_again():
    predictor = Predictor(orders(RandomSampler(range(N))))
    predictor.draw(0)
    prediction = predictor.predict()
    assert prediction.epoch == 1
    assert not predictor.check(prediction, 0, predictor.draw(0), prediction.order())  # no set_epoch: 0 again
    assert predictor.predict().epoch == 0
    predictor.draw(1)
    assert predictor.predict().epoch == 2
